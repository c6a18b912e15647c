"""Retention in the execute stage (§8.6, §10.3), on SQLite and on Postgres.

Runs are driven through the stage's real consumer path; grading's end is the
`RunResult` delivered on `assay.results`, as the tournament stage would send it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, RUN_COMMANDS, RUN_STATUS, RUNS, VERIFIED
from assay.cli.runs import RunTiered, archive_view, find_run
from assay.devstack.base import Service
from assay.devstack.postgres import scratch_database
from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    Pure,
    StubModel,
    Tool,
    ToolCall,
    ToolError,
    fold_work,
)
from assay.engine.events import (
    GradingEnded,
    Reduced,
    RunStarted,
    Tiered,
    TieringQueued,
    commands_stream,
)
from assay.engine.retention import (
    RetentionPolicy,
    decode_archive,
    episode_tokens,
    tiered_stream,
)
from assay.grading import StubJudge
from assay.kernel import BranchId, RunId, RunState, TaskId, TenantId, content_hash, new_run_id
from assay.kernel.scores import Ungraded, UngradedReason
from assay.messages import (
    CancelRun,
    Episode,
    EpisodeReduced,
    Purpose,
    ReducedEpisode,
    Role,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
)
from assay.record import BranchKey, LogRecord, StateKey
from assay.runtime import StageDeps, StageHarness
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.store import FsBlobStore, SqliteEventLog
from assay.store.ports import BlobStore, CommitBatch, EventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef, validate
from assay_execute import create_stage
from assay_execute.retention import TIERING_QUEUE, backlog_gauges

SMALL = TenantId(uuid.UUID(int=51))  # a tenant with a low ceiling: its runs are reduced
LARGE = TenantId(uuid.UUID(int=52))  # the default ceiling: its runs are not
CEILING = 1_000
KEEP = 200


# -- the store, in both modes -------------------------------------------------------


@pytest.fixture(scope="module")
def retention_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_retention") as dsn:
        yield dsn


class Stores:
    """Opens the execute stage's store in one mode; reopening gives the same store."""

    def __init__(self, where: Path | str) -> None:
        self.where = where
        self.schema = f"execute_{uuid.uuid4().hex[:10]}"
        self.opened: list[EventLog] = []

    async def open(self) -> EventLog:
        log: EventLog
        if isinstance(self.where, Path):
            log = await SqliteEventLog(self.where / "execute.sqlite", WORK_EVENTS, fold_work).open()
        else:
            log = await PostgresEventLog(self.where, self.schema, WORK_EVENTS, fold_work).open()
        self.opened.append(log)
        return log

    async def close(self, log: EventLog) -> None:
        self.opened.remove(log)
        await log.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    where: Path | str = tmp_path
    if request.param == "postgres":
        where = str(request.getfixturevalue("retention_database"))
    s = Stores(where)
    yield s
    for log in reversed(s.opened):
        await log.close()


@pytest.fixture
async def store(stores: Stores) -> EventLog:
    return await stores.open()


@pytest.fixture
def blobs(tmp_path: Path) -> FsBlobStore:
    return FsBlobStore(tmp_path / "blobs")


# -- runs with long texts ------------------------------------------------------------


async def blurt(call: ToolCall) -> str:
    """Long output; its first attempt fails with a long error (so a retry is recorded)."""
    if call.attempt == 1:
        raise ToolError("disk full while writing: " + "x" * 6_000)
    return "lorem ipsum " * int(call.args["n"])


TOOLS = dict(BUILTIN_TOOLS, blurt=Tool("blurt", blurt, Pure(), "writes at length"))


def policy(**changes: Any) -> RetentionPolicy:
    base: dict[str, Any] = {
        "ceilings": {SMALL: CEILING},
        "keep_chars": KEEP,
        "tier_after_s": 3600.0,
        "sweep_interval_s": 0.0,
    }
    return RetentionPolicy(**{**base, **changes})


def harness(
    log: EventLog, blobs: BlobStore, directory: Path, retention: RetentionPolicy
) -> StageHarness:
    deps = StageDeps(
        blobs=blobs, model=StubModel(), judge=StubJudge(), tools=TOOLS, retention=retention
    )
    return StageHarness(create_stage(deps), blobs, directory, log=log)


def spawned(tenant: TenantId, run_id: RunId | None = None) -> RunSpawned:
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "verbose",
                "steps": [
                    {
                        "id": "draft",
                        "kind": "tool",
                        "tool": "blurt",
                        "args": {"n": "{{ task.n }}"},
                        "retry": {"max_attempts": 2},
                    },
                    {
                        "id": "solve",
                        "kind": "model",
                        "prompt": "Think step by step, then reply with only the number. "
                        "What is {{ task.question }}?",
                        "max_tokens": 64,
                    },
                    {
                        "id": "answer",
                        "kind": "tool",
                        "tool": "extract_number",
                        "args": {"text": "{{ steps.solve.output }}"},
                    },
                ],
            }
        ),
        frozenset(TOOLS),
    )
    task = {"question": "(5 + 12) * 9", "answer": "153", "n": "1500", "notes": "n" * 5_000}
    ref = RunRef(
        tenant=tenant,
        run_id=run_id or new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key=f"task-{uuid.uuid4().hex[:8]}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


def result_of(msg: RunSpawned, status: str = "ungraded") -> RunResult:
    return RunResult.model_validate(
        {
            "tenant": msg.run.tenant,
            "run_id": msg.run.run_id,
            "task_id": msg.run.task_id,
            "idempotency_key": msg.run.idempotency_key,
            "workflow_id": msg.run.workflow_id,
            "workflow_version": msg.run.workflow_version,
            "status": status,
            "passed": True,
            "verification": [],
            "score": None
            if status == "cancelled"
            else Ungraded(reason=UngradedReason.NO_REFERENCE),
            "usage": {"model_calls": 1},
            "termination": "cancelled" if status == "cancelled" else "succeeded",
            "held_out": msg.run.held_out,
        }
    )


def key(msg: RunSpawned) -> BranchKey:
    return BranchKey.for_run(msg.run.tenant, msg.run.run_id, BranchId(0))


async def run_doc(log: EventLog, msg: RunSpawned) -> dict[str, Any]:
    doc = await log.get(StateKey(msg.run.tenant, "run", msg.run.run_id))
    assert doc is not None
    return doc


async def everything(log: EventLog, tenant: TenantId, run: str) -> list[LogRecord]:
    """Every record of a run: each branch of its stream and of its commands stream."""
    keys = [*await log.branches(run, tenant), *await log.branches(commands_stream(run), tenant)]
    return [r for k in keys for r in await log.read(k)]


async def documents(log: EventLog, tenant: TenantId) -> dict[tuple[str, str], Any]:
    out = {}
    for kind in ("run", "attempt", "intent", "cancel", TIERING_QUEUE):
        for k, v in await log.scan(tenant, kind):
            out[(kind, k)] = v
    return out


def events(records: list[LogRecord], of: Any) -> list[Any]:
    return [r.event for r in records if isinstance(r.event, of)]


# -- reduction ------------------------------------------------------------------------


async def test_a_run_is_reduced_only_once_its_grading_has_ended(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(SMALL)
    async with harness(store, blobs, tmp_path / "h", policy()) as stage:
        await stage.deliver(RUNS, msg, SMALL)
        doc = await run_doc(store, msg)
        original = doc["episode"]
        raw = await blobs.get(SMALL, original)
        assert raw is not None
        episode = Episode.model_validate_json(raw)
        assert episode_tokens(episode) > CEILING  # over the ceiling, and still whole:
        assert "grading" not in doc  # grading has not ended
        assert "reduced" not in doc
        assert events(await store.read(key(msg)), Reduced) == []

        await stage.deliver(RESULTS, result_of(msg), SMALL)
        told = await stage.emitted(VERIFIED)

    records = await store.read(key(msg))
    assert [type(r.event) for r in records[-2:]] == [GradingEnded, Reduced]
    (reduced,) = events(records, Reduced)
    assert (reduced.original, reduced.ceiling) == (original, CEILING)
    # tournament hears which blob stands for the episode, keyed by the run's task
    assert told == [
        EpisodeReduced(
            tenant=SMALL,
            run_id=msg.run.run_id,
            task_id=msg.run.task_id,
            original=original,
            summary=reduced.summary,
        )
    ]
    assert await blobs.get(SMALL, original) is None  # the original body is gone
    raw_summary = await blobs.get(SMALL, reduced.summary)
    assert raw_summary is not None
    summary = ReducedEpisode.model_validate_json(raw_summary)
    assert summary.original == original
    assert (summary.tokens_before, summary.tokens_after) == (
        reduced.tokens_before,
        reduced.tokens_after,
    )
    assert summary.tokens_before == episode_tokens(episode) > summary.tokens_after
    # Every transition is kept; only texts are shortened, each with a marker.
    short = summary.episode
    assert [
        (a.step, a.attempt, a.iteration, a.state, a.usage, a.duration_ms) for a in short.attempts
    ] == [
        (a.step, a.attempt, a.iteration, a.state, a.usage, a.duration_ms) for a in episode.attempts
    ]
    assert (short.run, short.definition, short.succeeded, short.usage, short.failed_step) == (
        episode.run,
        episode.definition,
        episode.succeeded,
        episode.usage,
        episode.failed_step,
    )
    paths = {e.path: e for e in summary.elisions}
    assert set(paths) == {
        "input.notes",
        "attempts[0].error",
        "attempts[1].output",
        "outputs.draft",
    }
    draft_output = episode.attempts[1].output
    assert draft_output is not None
    assert paths["attempts[1].output"].chars == len(draft_output)
    assert paths["attempts[1].output"].elided == len(draft_output) - KEEP
    cut = short.attempts[1].output
    assert cut is not None
    assert f"[{len(draft_output) - KEEP} characters elided]" in cut
    assert cut.startswith(draft_output[:100])
    assert cut.endswith(draft_output[-50:])
    assert short.input["question"] == episode.input["question"]  # short texts stay whole
    assert short.output == episode.output

    doc = await run_doc(store, msg)
    assert (doc["grading"], doc["reduced"], doc["summary"]) == ("ungraded", True, reduced.summary)
    assert doc["episode"] == original  # the record is never rewritten: a later fact stands for it
    assert (await store.rebuild(keep=False)).identical


async def test_a_redelivered_or_repeated_result_changes_nothing(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(SMALL)
    async with harness(store, blobs, tmp_path / "h", policy()) as stage:
        await stage.deliver(RUNS, msg, SMALL)
        await stage.deliver(RESULTS, result_of(msg), SMALL, idem="r")
        records = await store.read(key(msg))
        docs = await documents(store, SMALL)
        outbox = await stage.outbox()
        await stage.deliver(RESULTS, result_of(msg), SMALL, idem="r")  # redelivered
        await stage.deliver(RESULTS, result_of(msg, "graded"), SMALL, idem="other")  # repeated
        assert await store.read(key(msg)) == records
        assert await documents(store, SMALL) == docs
        assert len(await stage.outbox()) == len(outbox)
        assert stage.runner is not None
        assert stage.runner.duplicates == 1
    assert (await store.rebuild(keep=False)).identical


class Crash(BaseException):
    """The process dies here (not an error a handler's retry would catch)."""


class DiesOnDelete:
    """Blobs whose `delete` kills the process the first time."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.armed = True

    async def put(self, tenant: TenantId, content: bytes) -> str:
        return await self.inner.put(tenant, content)

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        return await self.inner.get(tenant, ref)

    async def delete(self, tenant: TenantId, ref: str) -> None:
        if self.armed:
            self.armed = False
            raise Crash("killed between the Reduced commit and the delete")
        await self.inner.delete(tenant, ref)

    async def delete_tenant(self, tenant: TenantId) -> int:
        return await self.inner.delete_tenant(tenant)


async def test_a_crash_after_the_reduced_commit_is_completed_when_the_result_comes_back(
    stores: Stores, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(SMALL)
    log = await stores.open()
    dying = DiesOnDelete(blobs)
    async with harness(log, dying, tmp_path / "a", policy()) as stage:
        await stage.deliver(RUNS, msg, SMALL)
        original = (await run_doc(log, msg))["episode"]
        with pytest.raises(Crash):
            await stage.deliver(RESULTS, result_of(msg), SMALL, idem="r")
    (reduced,) = events(await log.read(key(msg)), Reduced)  # committed before the crash
    assert await blobs.get(SMALL, original) is not None  # ... and the delete never ran
    await stores.close(log)

    log = await stores.open()  # restart: the unacknowledged result comes back
    async with harness(log, blobs, tmp_path / "b", policy()) as stage:
        await stage.deliver(RESULTS, result_of(msg), SMALL, idem="r")
    assert await blobs.get(SMALL, original) is None
    assert events(await log.read(key(msg)), Reduced) == [reduced]
    assert await blobs.get(SMALL, reduced.summary) is not None
    assert (await log.rebuild(keep=False)).identical


class DiesOnReducedCommit:
    """A store whose commit of a `Reduced` record kills the process the first time."""

    def __init__(self, inner: EventLog) -> None:
        self._inner = inner
        self.armed = True

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def commit(self, batch: CommitBatch) -> list[Any]:
        if self.armed and any(isinstance(e, Reduced) for _, e in batch.records):
            self.armed = False
            raise Crash("killed before the Reduced commit")
        return await self._inner.commit(batch)


async def test_a_crash_before_the_reduced_commit_leaves_only_a_summary_blob_written_again_later(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(SMALL)
    dying = DiesOnReducedCommit(store)
    async with harness(dying, blobs, tmp_path / "a", policy()) as stage:  # type: ignore[arg-type]
        await stage.deliver(RUNS, msg, SMALL)
        original = (await run_doc(store, msg))["episode"]
        with pytest.raises(Crash):
            await stage.deliver(RESULTS, result_of(msg), SMALL, idem="r")
    assert events(await store.read(key(msg)), GradingEnded | Reduced) == []
    assert await blobs.get(SMALL, original) is not None  # the original is untouched
    orphans = {p.name for p in (tmp_path / "blobs" / str(SMALL)).rglob("*") if p.is_file()}

    async with harness(store, blobs, tmp_path / "b", policy()) as stage:
        await stage.deliver(RESULTS, result_of(msg), SMALL, idem="r")
    (reduced,) = events(await store.read(key(msg)), Reduced)
    assert reduced.summary in orphans  # the same summary, written to the same ref
    assert await blobs.get(SMALL, original) is None


async def test_a_run_under_its_ceiling_is_left_whole_until_it_is_due(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(LARGE)
    async with harness(store, blobs, tmp_path / "h", policy()) as stage:
        await stage.deliver(RUNS, msg, LARGE)
        before = await everything(store, LARGE, msg.run.run_id)
        await stage.deliver(RESULTS, result_of(msg, "graded"), LARGE)
    after = await everything(store, LARGE, msg.run.run_id)
    assert after[: len(before)] == before
    assert [type(r.event) for r in after[len(before) :]] == [GradingEnded, TieringQueued]
    doc = await run_doc(store, msg)
    assert doc["grading"] == "graded"
    assert "reduced" not in doc
    assert "tiered" not in doc
    assert await blobs.get(LARGE, doc["episode"]) is not None
    (queued,) = await store.scan(LARGE, TIERING_QUEUE)  # due once `tier_after_s` has passed
    assert queued[0] == msg.run.run_id


async def test_a_run_under_its_ceiling_is_tiered_unreduced_and_keeps_its_episode(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(LARGE)
    run = msg.run.run_id
    async with harness(store, blobs, tmp_path / "h", policy(tier_after_s=0.0)) as stage:
        await stage.deliver(RUNS, msg, LARGE)
        before = await everything(store, LARGE, run)
        episode = (await run_doc(store, msg))["episode"]
        await stage.deliver(RESULTS, result_of(msg, "graded"), LARGE)  # due at once
    assert await everything(store, LARGE, run) == []
    (tomb,) = await store.read(BranchKey.main(LARGE, tiered_stream(run)))
    assert isinstance(tomb.event, Tiered)
    archive = await blobs.get(LARGE, tomb.event.archive)
    assert archive is not None
    archived = decode_archive(archive, WORK_EVENTS)
    assert archived[: len(before)] == before
    assert [type(r.event) for r in archived[len(before) :]] == [GradingEnded, TieringQueued]
    doc = await run_doc(store, msg)
    assert (doc["tiered"], doc["episode"], doc.get("reduced")) == (True, episode, None)
    assert await blobs.get(LARGE, episode) is not None  # the only copy of it: it stays
    assert await store.scan(LARGE, TIERING_QUEUE) == []
    assert (await store.rebuild(keep=False)).identical


class CountingBlobs(FsBlobStore):
    """The file blob store, counting the blobs read."""

    gets = 0

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        self.gets += 1
        return await super().get(tenant, ref)


async def test_a_result_of_a_run_frozen_here_under_its_ceiling_reads_no_blob(
    store: EventLog, tmp_path: Path
) -> None:
    blobs = CountingBlobs(tmp_path / "counted")
    first, second = spawned(LARGE), spawned(LARGE)
    async with harness(store, blobs, tmp_path / "h", policy()) as stage:
        await stage.deliver(RUNS, first, LARGE)
        await stage.deliver(RUNS, second, LARGE)
        gets = blobs.gets
        await stage.deliver(RESULTS, result_of(first, "graded"), LARGE)
        assert blobs.gets == gets  # its size was known when its episode was frozen
    # Another process (a restart, a replica) did not freeze it: it reads the blob.
    async with harness(store, blobs, tmp_path / "h2", policy()) as stage:
        await stage.deliver(RESULTS, result_of(second, "graded"), LARGE)
        assert blobs.gets == gets + 1
    for msg in (first, second):
        doc = await run_doc(store, msg)
        assert doc["grading"] == "graded"
        assert "reduced" not in doc
        assert await blobs.get(LARGE, doc["episode"]) is not None


async def test_each_tenant_is_held_to_its_own_ceiling(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    small, large = spawned(SMALL), spawned(LARGE)
    async with harness(store, blobs, tmp_path / "h", policy()) as stage:
        for msg in (small, large):
            await stage.deliver(RUNS, msg, msg.run.tenant)
            await stage.deliver(RESULTS, result_of(msg), msg.run.tenant)
    assert (await run_doc(store, small)).get("reduced") is True
    assert "reduced" not in await run_doc(store, large)
    # Lowered for everyone, the default reaches the other tenant's next run too.
    again = spawned(LARGE)
    async with harness(store, blobs, tmp_path / "h2", policy(token_ceiling=CEILING)) as stage:
        await stage.deliver(RUNS, again, LARGE)
        await stage.deliver(RESULTS, result_of(again), LARGE)
    assert (await run_doc(store, again)).get("reduced") is True


async def test_a_cancelled_run_has_ended_grading_too(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg = spawned(SMALL)
    async with harness(store, blobs, tmp_path / "h", policy()) as stage:
        await stage.deliver(RUN_COMMANDS, CancelRun(tenant=SMALL, run_id=msg.run.run_id), SMALL)
        await stage.deliver(RUNS, msg, SMALL)
        (result,) = [m for m in await stage.emitted(RESULTS) if isinstance(m, RunResult)]
        await stage.deliver(RESULTS, result, SMALL)  # its own result, read back
    assert events(await store.read(key(msg)), GradingEnded) == [GradingEnded(status="cancelled")]
    assert "reduced" not in await run_doc(store, msg)  # no episode was frozen: nothing to reduce


# -- tiering --------------------------------------------------------------------------


async def test_tiering_moves_a_reduced_runs_records_into_an_archive(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    first, second = spawned(SMALL), spawned(SMALL)
    run = first.run.run_id
    async with harness(store, blobs, tmp_path / "h", policy(tier_after_s=0.3)) as stage:
        await stage.deliver(RUNS, first, SMALL)
        await stage.deliver(RUN_COMMANDS, CancelRun(tenant=SMALL, run_id=run), SMALL)  # late
        await stage.deliver(RESULTS, result_of(first), SMALL)
        records = await everything(store, SMALL, run)
        docs = await documents(store, SMALL)
        assert {r.key.stream for r in records} == {run, commands_stream(run)}
        assert (await run_doc(store, first)).get("tiered") is None  # not due yet
        (due,) = await backlog_gauges(store)
        assert (due.name, dict(due.samples)) == (
            "assay_retention_tiering_due",
            {(str(SMALL),): 1.0},
        )

        await asyncio.sleep(0.4)
        await stage.deliver(RUNS, second, SMALL)
        await stage.deliver(RESULTS, result_of(second), SMALL)  # the next result sweeps

    # Moved, not copied: the rows are gone from the log, the archive holds exactly them.
    assert await everything(store, SMALL, run) == []
    (tomb,) = await store.read(BranchKey.main(SMALL, tiered_stream(run)))
    tiered = tomb.event
    assert isinstance(tiered, Tiered)
    archive = await blobs.get(SMALL, tiered.archive)
    assert archive is not None
    assert decode_archive(archive, WORK_EVENTS) == records
    assert tiered.records == len(records)
    assert sorted((s.stream, s.branch, s.records) for s in tiered.streams) == [
        (run, 0, len([r for r in records if r.key.stream == run])),
        (commands_stream(run), 0, 1),
    ]
    # The fold still knows the run: every document stands, the run's says where it went.
    after = await documents(store, SMALL)
    doc = after.pop(("run", run))
    assert (doc["tiered"], doc["archive"], doc["archived_records"]) == (
        True,
        tiered.archive,
        len(records),
    )
    assert {k: v for k, v in doc.items() if k not in ("tiered", "archive", "archived_records")} == (
        docs[("run", run)]
    )
    mine = {k: v for k, v in docs.items() if run in k[1] and k != ("run", run)}
    assert mine
    assert all(after[k] == v for k, v in mine.items() if k[0] != TIERING_QUEUE)
    assert (TIERING_QUEUE, run) not in after
    # The second run, reduced just now, is not due: untouched.
    assert (await run_doc(store, second)).get("tiered") is None
    assert await store.read(key(second))
    # The tiered run's lease row went with its records (a claim starts a new fence), the
    # untiered run's stays (a claim is refused while it is held, else takes a later fence).
    claimed = await store.claim(SMALL, run, "after-tiering", 1000)
    assert claimed is not None
    assert claimed.fence == 1
    await store.release(claimed)
    kept = await store.claim(SMALL, second.run.run_id, "after-tiering", 1000)
    assert kept is None or kept.fence > 1
    assert (await store.rebuild(keep=False)).identical
    assert (await store.rebuild(keep=True)).identical
    assert await documents(store, SMALL) == {**after, ("run", run): doc}

    with pytest.raises(RunTiered, match=tiered.archive) as shown:
        await find_run(store, run, SMALL)
    assert "archive blob" in shown.value.render()
    assert shown.value.to_json()["tiered"]["records"] == len(records)  # type: ignore[index]


async def test_a_tiered_run_reaches_archived_in_the_commit_that_moved_it(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    graded, cancelled = spawned(SMALL), spawned(SMALL)
    async with harness(store, blobs, tmp_path / "h", policy(tier_after_s=0.0)) as stage:
        await stage.deliver(RUNS, graded, SMALL)
        before = await find_run(store, graded.run.run_id, SMALL)
        assert before is not None
        await stage.deliver(RESULTS, result_of(graded, "graded"), SMALL)  # reduced, tiered
        await stage.deliver(RUNS, cancelled, SMALL)
        await stage.deliver(RESULTS, result_of(cancelled, "cancelled"), SMALL)
        statuses = [m for m in await stage.emitted(RUN_STATUS) if isinstance(m, RunStatusChanged)]
    tombs = [
        await store.read(BranchKey.main(SMALL, tiered_stream(m.run.run_id)))
        for m in (graded, cancelled)
    ]
    event = tombs[0][0].event
    assert isinstance(event, Tiered)
    assert len(tombs[1]) == 1  # both were moved to their archives
    archived = [s for s in statuses if s.state is RunState.ARCHIVED]
    assert [(s.run, s.detail) for s in archived] == [
        (graded.run, f"records moved to archive blob {event.archive}")
    ]  # the cancelled run stays Cancelled: §5.2 has no way from there to Archived

    for msg, state in ((graded, "archived"), (cancelled, "cancelled")):
        with pytest.raises(RunTiered) as shown:
            await find_run(store, msg.run.run_id, SMALL)
        assert shown.value.to_json()["state"] == state
        assert f"state {state}" in shown.value.render()
    # An archived run still reads back: its records, from the archive blob.
    archive = await blobs.get(SMALL, event.archive)
    assert archive is not None
    records = decode_archive(archive, WORK_EVENTS)
    assert isinstance(records[0].event, RunStarted)
    assert records[0].event.run == graded.run
    readback = archive_view(graded.run.run_id, archive)  # as `assay runs show` shows it
    assert readback is not None
    assert (readback.ref, readback.status, readback.episode, readback.branch_ids) == (
        before.ref,
        before.status,
        before.episode,
        before.branch_ids,
    )
    assert [b.steps for b in readback.branches] == [b.steps for b in before.branches]


class DiesOnDeletion:
    """A store whose first commit that deletes branches fails (the process dies there)."""

    def __init__(self, inner: EventLog) -> None:
        self._inner = inner
        self.armed = True

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def commit(self, batch: CommitBatch) -> list[Any]:
        if self.armed and batch.deletions:
            self.armed = False
            raise ConnectionError("the store went away mid-commit")
        return await self._inner.commit(batch)


async def test_a_failed_tiering_commit_leaves_every_row_and_is_done_by_a_later_sweep(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    msg, later = spawned(SMALL), spawned(SMALL)
    failing = DiesOnDeletion(store)
    retention = policy(tier_after_s=0.0)
    async with harness(failing, blobs, tmp_path / "h", retention) as stage:  # type: ignore[arg-type]
        await stage.deliver(RUNS, msg, SMALL)
        await stage.deliver(RESULTS, result_of(msg), SMALL)  # reduced; its tiering fails
        records = await everything(store, SMALL, msg.run.run_id)
        assert records
        assert not failing.armed
        assert (await run_doc(store, msg)).get("tiered") is None
        assert await store.read(BranchKey.main(SMALL, tiered_stream(msg.run.run_id))) == []
        assert (await store.rebuild(keep=False)).identical

        await stage.deliver(RUNS, later, SMALL)
        await stage.deliver(RESULTS, result_of(later), SMALL)  # the next sweep moves it
    assert await everything(store, SMALL, msg.run.run_id) == []
    assert (await run_doc(store, msg))["tiered"] is True
    assert (await store.rebuild(keep=False)).identical


async def test_one_tenants_retention_never_touches_another_tenants_blobs_or_rows(
    store: EventLog, blobs: FsBlobStore, tmp_path: Path
) -> None:
    run = new_run_id()  # the same run id under two tenants: two runs
    mine, theirs = spawned(SMALL, run), spawned(LARGE, run)
    retention = policy(ceilings={SMALL: CEILING, LARGE: CEILING}, tier_after_s=0.0)
    async with harness(store, blobs, tmp_path / "h", retention) as stage:
        await stage.deliver(RUNS, theirs, LARGE)
        await stage.deliver(RUNS, mine, SMALL)
        their_records = await everything(store, LARGE, run)
        their_docs = await documents(store, LARGE)
        their_blobs = sorted(p.name for p in (tmp_path / "blobs" / str(LARGE)).rglob("*"))
        await stage.deliver(RESULTS, result_of(mine), SMALL)  # reduces and tiers SMALL's run

    assert (await run_doc(store, mine))["tiered"] is True
    assert await everything(store, SMALL, run) == []
    assert await everything(store, LARGE, run) == their_records
    assert await documents(store, LARGE) == their_docs
    assert sorted(p.name for p in (tmp_path / "blobs" / str(LARGE)).rglob("*")) == their_blobs
    tiered = (await store.read(BranchKey.main(SMALL, tiered_stream(run))))[0].event
    assert isinstance(tiered, Tiered)
    assert await blobs.get(LARGE, tiered.archive) is None  # in its own tenant's namespace
    assert await store.read(BranchKey.main(LARGE, tiered_stream(run))) == []
    assert (await store.rebuild(keep=False)).identical


# -- configuration --------------------------------------------------------------------


def test_ceilings_are_configured_per_tenant_from_the_environment() -> None:
    env = {
        "ASSAY_RETENTION_TOKEN_CEILING": "50000",
        "ASSAY_RETENTION_CEILINGS": f"{SMALL}=1000, {LARGE}=2000,",
        "ASSAY_RETENTION_TIER_AFTER_S": "0",
    }
    configured = AssaySettings.from_env(env).retention
    assert [configured.ceiling_for(t) for t in (SMALL, LARGE, TenantId(uuid.uuid4()))] == [
        1000,
        2000,
        50000,
    ]
    assert configured.tier_after_s == 0
    default = AssaySettings.from_env({}).retention
    assert (default.token_ceiling, default.tier_after_s) == (200_000, 7 * 86_400)


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("CEILINGS", "abc=5", "'abc' is not a tenant UUID"),
        ("CEILINGS", str(SMALL), "is not <tenant-uuid>=<tokens>"),
        ("CEILINGS", f"{SMALL}=0", "'0' for"),
        ("CEILINGS", f"{SMALL}=1,{SMALL}=2", "given twice"),
        ("TOKEN_CEILING", "0", "greater than or equal to 1"),
        ("TIER_AFTER_S", "soon", "valid number"),
    ],
)
def test_a_bad_retention_setting_is_refused_naming_the_variable(
    name: str, value: str, reason: str
) -> None:
    with pytest.raises(SettingsInvalid, match=f"ASSAY_RETENTION_{name}=.*{reason}"):
        AssaySettings.from_env({f"ASSAY_RETENTION_{name}": value})
