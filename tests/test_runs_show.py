"""`assay runs show RUN`: a run's branches, attempts and intents, from the execute log alone.

The logs are made by the real driver — crashes and recoveries included — on SQLite
(a data directory) and on Postgres (`ASSAY_DATABASE_URL`), and the command runs
in-process. The text layout is pinned by one golden run built record by record.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from assay.cli import main
from assay.cli.runs import render_text
from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    AttemptFinished,
    AttemptStarted,
    Driver,
    Idempotent,
    LogJournal,
    Queryable,
    RunFinished,
    RunSpec,
    RunStarted,
    StubModel,
    Tool,
    ToolCall,
    Unsafe,
    fold_work,
)
from assay.engine import events as work_events
from assay.engine.episode_view import build_run_view
from assay.engine.events import Intent
from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    IntentState,
    Lsn,
    RunId,
    StepId,
    TaskId,
    TenantId,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.kernel.schema import Versioned
from assay.messages import Episode, Purpose, Role, RunRef, Usage
from assay.record import BranchKey, Event, LogRecord
from assay.store import CommitBatch, SqliteEventLog
from assay.store.ports import EventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef

TENANT = tenant_id("2d4e6f80-1a3c-4e5f-8a7b-9c0d1e2f3a4b")
OTHER = tenant_id("7f6e5d4c-3b2a-4190-8f7e-6d5c4b3a2910")


# -- the outside world, and a worker that dies ------------------------------------------


class ProcessKilled(BaseException):
    """The worker process died here: nothing after this point happened."""


@dataclass
class World:
    """Every call that landed; each tool dies once after landing when listed in `die_after`."""

    die_after: set[str] = field(default_factory=set)
    landed: dict[str, str] = field(default_factory=dict)

    def tools(self) -> dict[str, Tool]:
        async def lookup(call: ToolCall) -> str | None:
            return self.landed.get(call.request_id)

        def effect(name: str) -> Any:
            async def fn(call: ToolCall) -> str:
                out = f"done:{call.args['item']}"
                self.landed[call.request_id] = out
                if name in self.die_after:
                    self.die_after.discard(name)
                    raise ProcessKilled(name)
                return out

            return fn

        return {
            "charge": Tool("charge", effect("charge"), Unsafe(), "unsafe"),
            "put": Tool("put", effect("put"), Idempotent(key=("item",)), "idempotent"),
            "order": Tool("order", effect("order"), Queryable(lookup=lookup), "queryable"),
            **BUILTIN_TOOLS,
        }


class DyingJournal(LogJournal):
    """Commits `survive` commits, then the process dies at the next one."""

    def __init__(self, log: EventLog, survive: int) -> None:
        super().__init__(log)
        self.survive = survive

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        if self.survive <= 0:
            raise ProcessKilled(f"died before committing {[e.type for e in events]}")
        self.survive -= 1
        await super().record_and_commit(key, *events, emits=emits)


def workflow(name: str, *tools: str, max_attempts: int = 1) -> WorkflowDef:
    steps: list[dict[str, Any]] = [
        {
            "id": tool,
            "kind": "tool",
            "tool": tool,
            "args": {"item": "{{ task.item }}"},
            "retry": {"max_attempts": max_attempts},
        }
        for tool in tools
    ]
    return WorkflowDef.model_validate({"id": name, "steps": steps})


def spec_for(
    wf: WorkflowDef, tenant: TenantId = TENANT, branch: int = 0, run: RunId | None = None
) -> RunSpec:
    task = {"item": "widget", "question": "2 + 3"}
    run_id = run or new_run_id()
    ref = RunRef(
        tenant=tenant,
        run_id=run_id,
        task_id=TaskId(content_hash(task)),
        idempotency_key=f"key-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input=task, branch=BranchId(branch))


# -- the execute log where the command looks for it -----------------------------------


@pytest.fixture(scope="module")
def show_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_show") as dsn:
        yield dsn


@dataclass
class Store:
    """The execute stage's log in one mode, and the command run against it."""

    data: Path
    dsn: str | None
    capsys: pytest.CaptureFixture[str]
    opened: list[EventLog] = field(default_factory=list)

    async def open(self) -> EventLog:
        log: EventLog
        if self.dsn is None:
            log = await SqliteEventLog(self.data / "execute.sqlite", WORK_EVENTS, fold_work).open()
        else:
            log = await PostgresEventLog(self.dsn, "execute", WORK_EVENTS, fold_work).open()
        self.opened.append(log)
        return log

    async def drive(self, spec: RunSpec, world: World, *, survive: int = 10_000) -> Episode:
        """Drive to the end, restarting after each death, then record RunFinished."""
        while True:
            log = await self.open()
            try:
                episode = await Driver(StubModel(), world.tools()).drive(
                    spec, DyingJournal(log, survive)
                )
                break
            except ProcessKilled:
                survive = 10_000
        finished = RunFinished(
            succeeded=episode.succeeded,
            failed_step=episode.failed_step,
            episode=content_hash(episode.model_dump(mode="json")),
            usage=episode.usage,
        )
        await log.commit(CommitBatch(records=[(spec.key, finished)]))
        return episode

    async def show(self, *args: str) -> tuple[int, str, str]:
        """`assay runs show ARGS`: exit code, stdout, stderr."""

        def call() -> int:
            try:
                main(["--data-dir", str(self.data), "runs", "show", *args])
            except SystemExit as exit_:
                return int(exit_.code or 0)
            raise AssertionError("main() returned without exiting")

        self.capsys.readouterr()
        code = await asyncio.to_thread(call)
        out, err = self.capsys.readouterr()
        return code, out, err

    async def show_json(self, *args: str) -> dict[str, Any]:
        code, out, err = await self.show(*args, "--json")
        assert code == 0, err
        doc: dict[str, Any] = json.loads(out)
        return doc


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> AsyncIterator[Store]:
    dsn: str | None = None
    if request.param == "postgres":
        dsn = str(request.getfixturevalue("show_database"))
        monkeypatch.setenv("ASSAY_DATABASE_URL", dsn)
    else:
        monkeypatch.delenv("ASSAY_DATABASE_URL", raising=False)
    s = Store(tmp_path / "data", dsn, capsys)
    yield s
    for log in reversed(s.opened):
        await log.close()


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, out, err)
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("assay: error: ")
    for needle in needles:
        assert needle in err, err


# -- runs made by the driver --------------------------------------------------------


async def test_a_finished_run_shows_its_steps_attempts_usage_and_episode(store: Store) -> None:
    wf = WorkflowDef.model_validate(
        {
            "id": "arith",
            "steps": [
                {"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"},
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ],
        }
    )
    spec = spec_for(wf)
    episode = await store.drive(spec, World())
    assert episode.succeeded

    code, out, err = await store.show(spec.ref.run_id)
    assert code == 0, err
    u = episode.usage
    assert re.sub(r"\d+ ms|\d+\.\d s|started \S+", "…", out).splitlines() == [
        f"run {spec.ref.run_id}  tenant {TENANT}",
        f"  workflow arith @ {wf.version[:12]}  role current  purpose work"
        f"  task {spec.ref.task_id[:12]}",
        "  status succeeded",
        f"  usage 1 model call, {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens",
        f"  episode {content_hash(episode.model_dump(mode='json'))}",
        "  branches 0  live 0",
        "branch 0 (live)  succeeded  …  6 records",
        "  step solve",
        f"    attempt 1  succeeded  …  1 model call, {u.prompt_tokens} prompt"
        f" + {u.completion_tokens} completion tokens",
        f"      output: {json.dumps(episode.outputs['solve'])}",
        "  step answer",
        "    attempt 1  succeeded  …",
        f"      output: {json.dumps(episode.outputs['answer'])}",
    ]

    doc = await store.show_json(spec.ref.run_id)
    assert (doc["status"], doc["live_branch"], doc["branch_ids"]) == ("succeeded", 0, [0])
    assert doc["ref"]["workflow_version"] == wf.version
    assert [s["step"] for s in doc["branches"][0]["steps"]] == ["solve", "answer"]


async def test_crashes_show_interrupted_attempts_and_how_recovery_resolved_each_intent(
    store: Store,
) -> None:
    # order and put each die once after their call landed; charge dies at the commit
    # of its Dispatched intent (window A), so its first attempt is closed as interrupted.
    spec = spec_for(workflow("wf-recover", "order", "put"))
    await store.drive(spec, World(die_after={"order", "put"}))
    window_a = spec_for(workflow("wf-window-a", "charge", max_attempts=2))
    await store.drive(window_a, World(), survive=3)

    code, out, err = await store.show(spec.ref.run_id)
    assert code == 0, err
    assert "  status succeeded" in out
    assert (
        "      intent order (queryable)  pending → dispatched → committed  recovered: lookup"
    ) in out
    assert (
        "      intent put (idempotent)  pending → dispatched → committed"
        "  recovered: retried under the same idempotency key"
    ) in out

    code, out, err = await store.show(window_a.ref.run_id)
    assert code == 0, err
    # its time runs to the record that closed it: a millisecond or more on a busy machine
    assert re.search(r"^    attempt 1  failed  \d+ ms  interrupted$", out, re.MULTILINE), out
    assert "      error: interrupted: the worker stopped before the attempt finished\n" in out
    assert "      intent charge (unsafe)  pending  never dispatched\n" in out
    assert "      intent charge (unsafe)  pending → dispatched → committed\n" in out

    doc = await store.show_json(window_a.ref.run_id)
    (step,) = doc["branches"][0]["steps"]
    assert [(a["attempt"], a["state"], a["interrupted"]) for a in step["attempts"]] == [
        (1, "failed", True),
        (2, "succeeded", False),
    ]
    first = step["attempts"][0]["intents"][0]
    assert (first["state"], [t["state"] for t in first["transitions"]]) == ("pending", ["pending"])
    assert first["request_id"].endswith(f"/{window_a.ref.run_id}/0/charge/1")


async def test_an_unsafe_call_cut_off_mid_flight_shows_as_indeterminate(store: Store) -> None:
    spec = spec_for(workflow("wf-charge", "charge", max_attempts=3))
    await store.drive(spec, World(die_after={"charge"}))

    code, out, err = await store.show(spec.ref.run_id)
    assert code == 0, err
    assert "  status failed at step charge, indeterminate (branch 0)\n" in out
    assert "branch 0 (live)  failed at step charge, indeterminate  started " in out
    assert "    attempt 1  indeterminate  " in out
    assert (
        "      intent charge (unsafe)  pending → dispatched  unresolved: outcome unknown\n" in out
    )
    assert "attempt 2" not in out  # never retried

    doc = await store.show_json(spec.ref.run_id)
    assert (doc["status"], doc["failed_step"], doc["indeterminate"]) == ("failed", "charge", True)
    attempt = doc["branches"][0]["steps"][0]["attempts"][0]
    assert (attempt["state"], attempt["indeterminate"]) == ("indeterminate", True)
    assert attempt["intents"][0]["state"] == "dispatched"


async def test_the_live_branch_is_shown_by_default_and_any_or_every_branch_on_request(
    store: Store,
) -> None:
    first = spec_for(workflow("wf-branches", "charge"))
    await store.drive(first, World(die_after={"charge"}))  # branch 0 ends Indeterminate
    rewound = RunSpec(
        ref=first.ref, definition=first.definition, input=first.input, branch=BranchId(1)
    )
    await store.drive(rewound, World())  # a rewind re-runs it on branch 1

    code, out, _ = await store.show(first.ref.run_id)
    assert code == 0
    assert "  status succeeded, indeterminate (branch 0)\n" in out  # still unknown
    assert "  branches 0, 1  live 1\n" in out
    assert "branch 1 (live)  succeeded" in out
    assert "\nbranch 0" not in out

    code, out, _ = await store.show(first.ref.run_id, "--branch", "0")
    assert code == 0
    assert "\nbranch 0  failed at step charge, indeterminate" in out
    assert "\nbranch 1" not in out

    code, out, _ = await store.show(first.ref.run_id, "--all-branches")
    assert code == 0
    headers = [line.split("  ")[0] for line in out.splitlines() if line.startswith("branch")]
    assert headers == ["branch 0", "branch 1 (live)"]

    doc = await store.show_json(first.ref.run_id, "--all-branches")
    assert [(b["branch"], b["live"], b["status"]) for b in doc["branches"]] == [
        (0, False, "failed"),
        (1, True, "succeeded"),
    ]
    code, out, err = await store.show(first.ref.run_id, "--branch", "7")
    assert_one_line_error(code, out, err, f"run {first.ref.run_id} has no branch 7 (it has: 0, 1)")


async def test_an_unknown_run_is_a_one_line_error(store: Store) -> None:
    await store.drive(spec_for(workflow("wf-known", "put")), World())
    code, out, err = await store.show("01NOSUCHRUN0000000000000000")
    assert_one_line_error(code, out, err, "no run 01NOSUCHRUN0000000000000000")


async def test_another_tenants_run_is_not_shown(store: Store) -> None:
    mine = spec_for(workflow("wf-mine", "put"))
    await store.drive(mine, World())
    shared = new_run_id()  # one run id under two tenants: each sees its own only
    await store.drive(spec_for(workflow("wf-theirs", "put"), OTHER, run=shared), World())
    await store.drive(spec_for(workflow("wf-ours", "order"), TENANT, run=shared), World())

    code, out, err = await store.show(mine.ref.run_id, "--tenant", str(OTHER))
    assert_one_line_error(code, out, err, f"no run {mine.ref.run_id} of tenant {OTHER}")
    code, out, err = await store.show(mine.ref.run_id, "--tenant", str(TENANT))
    assert code == 0, err

    code, out, err = await store.show(shared, "--tenant", str(TENANT))
    assert code == 0, err
    assert "wf-ours" in out
    assert "wf-theirs" not in out
    assert str(OTHER) not in out
    assert (await store.show_json(shared, "--tenant", str(OTHER)))["ref"]["workflow_id"] == (
        "wf-theirs"
    )
    code, out, err = await store.show(shared)
    assert_one_line_error(code, out, err, "under 2 tenants", "--tenant")
    code, out, err = await store.show(shared, "--tenant", "not-a-uuid")
    assert_one_line_error(code, out, err, "--tenant must be a UUID")


async def test_an_empty_data_dir_or_database_is_a_one_line_error_and_stays_empty(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("ASSAY_DATABASE_URL", raising=False)
    empty = Store(tmp_path / "empty", None, capsys)
    code, out, err = await empty.show("01NOSUCHRUN0000000000000000")
    assert_one_line_error(code, out, err, "no execute log in")
    assert not (tmp_path / "empty").exists()


@pytest.mark.postgres
async def test_a_database_without_an_execute_schema_is_left_untouched(
    postgres: Service,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import asyncpg

    with scratch_database(postgres, "assay_show_empty") as dsn:
        monkeypatch.setenv("ASSAY_DATABASE_URL", dsn)
        code, out, err = await Store(tmp_path, dsn, capsys).show("01NOSUCHRUN0000000000000000")
        assert_one_line_error(code, out, err, "no execute log")
        assert dsn not in err
        conn = await asyncpg.connect(dsn)
        try:
            found = await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = 'execute'")
            assert found is None  # nothing was created
        finally:
            await conn.close()


# -- the text layout, pinned ----------------------------------------------------------


class Forked(Event):
    """A stand-in for the fork record a rewind will write: the view knows no such class."""

    type: ClassVar[str] = "Forked"
    version: ClassVar[int] = 1
    from_branch: int
    at_lsn: int
    reason: str


GOLDEN = "\n".join(
    [
        "run 01HZY3T5V6W7X8Y9Z0ABCDEFGH  tenant 2d4e6f80-1a3c-4e5f-8a7b-9c0d1e2f3a4b",
        "  workflow wf-golden @ aaaaaaaaaaaa  role current  purpose work  task bbbbbbbbbbbb",
        "  status running, indeterminate (branch 0)",
        "  usage 0 model calls, 0 prompt + 0 completion tokens",
        "  episode (none yet)",
        "  branches 0, 1  live 1",
        "branch 0  failed at step charge, indeterminate  started 2025-01-01T00:00:00.000Z"
        "  8 records",
        "  step solve",
        "    attempt 1  succeeded  42 ms  1 model call, 12 prompt + 5 completion tokens",
        '      output: "The answer is 5."',
        "  step charge",
        "    attempt 1  indeterminate  1.5 s",
        "      error: outcome unknown: unsafe tool 'charge' was dispatched and never resolved",
        "      intent charge (unsafe)  pending → dispatched  unresolved: outcome unknown",
        f"        request {TENANT}/01HZY3T5V6W7X8Y9Z0ABCDEFGH/0/charge/1",
        "branch 1 (live)  forked from branch 0 at lsn 2  running  6 records",
        "  step put",
        "    attempt 1  succeeded  2.3 s",
        '      output: "done:widget"',
        "      intent put (idempotent)  pending → dispatched → committed"
        "  recovered: retried under the same idempotency key",
        f"        request {TENANT}/01HZY3T5V6W7X8Y9Z0ABCDEFGH/1/put/1  key k-put",
        "",
    ]
)


def golden_records() -> dict[int, list[LogRecord]]:
    run = RunId("01HZY3T5V6W7X8Y9Z0ABCDEFGH")
    ref = RunRef.model_validate(
        {
            "tenant": str(TENANT),
            "run_id": run,
            "task_id": "b" * 64,
            "idempotency_key": "golden",
            "workflow_id": "wf-golden",
            "workflow_version": "a" * 64,
            "role": "current",
            "purpose": "work",
        }
    )
    t0 = 1_735_689_600_000  # 2025-01-01T00:00:00Z
    one, act = AttemptNo(1), {"item": "widget"}

    def intent(branch: int, step: str, state: IntentState, **more: Any) -> Intent:
        return Intent(
            step=StepId(step),
            attempt=one,
            state=state,
            tool=step,
            effect="unsafe" if step == "charge" else "idempotent",
            request_id=f"{TENANT}/{run}/{branch}/{step}/1",
            **more,
        )

    zero: list[Event] = [
        RunStarted(run=ref),
        AttemptStarted(step=StepId("solve"), attempt=one, iteration=0, prompt="2 + 3?"),
        AttemptFinished(
            step=StepId("solve"),
            attempt=one,
            state=AttemptState.SUCCEEDED,
            output="The answer is 5.",
            usage=Usage(model_calls=1, prompt_tokens=12, completion_tokens=5),
            duration_ms=42,
        ),
        AttemptStarted(step=StepId("charge"), attempt=one, iteration=0, args=act),
        intent(0, "charge", IntentState.PENDING),
        intent(0, "charge", IntentState.DISPATCHED),
        AttemptFinished(
            step=StepId("charge"),
            attempt=one,
            state=AttemptState.INDETERMINATE,
            error="outcome unknown: unsafe tool 'charge' was dispatched and never resolved",
            usage=Usage(),
            duration_ms=1500,
        ),
        RunFinished(succeeded=False, failed_step=StepId("charge"), episode="e" * 64, usage=Usage()),
    ]
    key = dict(idempotency_key="k-put")
    fork: list[Event] = [
        Forked(from_branch=0, at_lsn=2, reason="rewind to before charge"),
        AttemptStarted(step=StepId("put"), attempt=one, iteration=0, args=act),
        intent(1, "put", IntentState.PENDING, **key),
        intent(1, "put", IntentState.DISPATCHED, **key),
        intent(
            1,
            "put",
            IntentState.COMMITTED,
            output="done:widget",
            resolved_by="retried under the same idempotency key",
            **key,
        ),
        AttemptFinished(
            step=StepId("put"),
            attempt=one,
            state=AttemptState.SUCCEEDED,
            output="done:widget",
            usage=Usage(),
            duration_ms=2300,
        ),
    ]
    return {
        b: [
            LogRecord(BranchKey(TENANT, run, BranchId(b)), Lsn(n), 1, t0 + 1000 * n, e)
            for n, e in enumerate(events)
        ]
        for b, events in ((0, zero), (1, fork))
    }


def test_the_text_layout_is_pinned() -> None:
    view = build_run_view(golden_records())
    assert render_text(view) == GOLDEN
    assert render_text(view.only([1])).count("\nbranch ") == 1


def test_the_json_keys_are_stable() -> None:
    doc = build_run_view(golden_records()).to_json()
    assert list(doc) == [
        "version",
        "run_id",
        "tenant",
        "ref",
        "live_branch",
        "branch_ids",
        "status",
        "failed_step",
        "indeterminate",
        "indeterminate_branches",
        "usage",
        "episode",
        "branches",
        "branchings",  # added within version 1: keys are added, never renamed or removed
    ]
    assert doc["branchings"] == []
    zero, one = doc["branches"]
    assert list(zero) == [
        "branch",
        "live",
        "fork",
        "records",
        "last_lsn",
        "status",
        "failed_step",
        "indeterminate",
        "started_at_ms",
        "finished_at_ms",
        "usage",
        "episode",
        "steps",
        "other",
    ]
    attempt = zero["steps"][1]["attempts"][0]
    assert list(attempt) == [
        "attempt",
        "iteration",
        "state",
        "started_lsn",
        "started_at_ms",
        "finished_lsn",
        "duration_ms",
        "interrupted",
        "indeterminate",
        "output",
        "error",
        "usage",
        "intents",
    ]
    assert list(attempt["intents"][0]) == [
        "request_id",
        "tool",
        "effect",
        "idempotency_key",
        "state",
        "transitions",
        "output",
        "error",
        "resolved_by",
    ]
    assert one["fork"] == {
        "type": "Forked",
        "lsn": 0,
        "from_branch": 0,
        "at_lsn": 2,
        "fields": {"from_branch": 0, "at_lsn": 2, "reason": "rewind to before charge"},
    }
    assert (doc["version"], doc["live_branch"], doc["status"], one["other"]) == (
        1,
        1,
        "running",
        [],
    )


def test_records_the_view_cannot_read_are_kept_as_logged() -> None:
    class Odd(Event):
        type: ClassVar[str] = "SomethingNew"
        version: ClassVar[int] = 1
        note: str

    class VagueFork(Event):
        type: ClassVar[str] = "BranchForked"
        version: ClassVar[int] = 1
        parent: str

    records = golden_records()
    last = records[1][-1]
    records[1][0] = LogRecord(last.key, Lsn(0), 1, last.at_ms, VagueFork(parent="0@2"))
    records[1].append(LogRecord(last.key, Lsn(last.lsn + 1), 1, last.at_ms, Odd(note="hi")))
    text = render_text(build_run_view(records))
    assert 'branch 1 (live)  forked: BranchForked {"parent": "0@2"}  running  7 records' in text
    assert '  record 6 SomethingNew {"note": "hi"}' in text


def test_a_fork_of_a_fork_shows_its_own_fork_point() -> None:
    wf = WorkflowDef.model_validate(
        {"id": "wf", "steps": [{"id": "s", "kind": "tool", "tool": "strip", "args": {}}]}
    )
    ref = spec_for(wf).ref
    key = BranchKey.for_run(TENANT, ref.run_id, BranchId(2))
    records = [
        LogRecord(key, Lsn(0), 2, 0, RunStarted(run=ref)),
        LogRecord(key, Lsn(1), 1, 0, work_events.Forked(from_branch=0, at=1)),  # branch 1's copy
        LogRecord(key, Lsn(2), 1, 0, work_events.Forked(from_branch=1, at=2)),  # its own
    ]
    view = build_run_view({2: records})
    fork = view.branches[0].fork
    assert fork is not None
    assert (fork.from_branch, fork.at_lsn, fork.lsn) == (1, 2, 2)
