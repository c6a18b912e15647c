"""Pure attempts ride with the journal's next commit (§8.4).

A Pure call can simply run again after a crash, so its start and end need not be
durable before the run goes on: they are handed to the journal and committed with
whatever commits next — the next write-ahead record, the run's end. Everything else
is still written ahead. These tests drive runs on a real SQLite log, count its
transactions, and crash a run before its end to see the Pure steps run again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    AttemptFinished,
    AttemptStarted,
    Driver,
    RunFinished,
    RunSpec,
    RunStarted,
    StubModel,
    fold_work,
)
from assay.engine.journal import LogJournal
from assay.kernel import AttemptState, BranchId, TaskId, content_hash, new_run_id, tenant_id
from assay.messages import Episode, Purpose, Role, RunRef
from assay.store import SqliteEventLog
from assay.workflow import WorkflowDef, validate

TENANT = tenant_id(uuid.UUID("6f1c2a52-0d7e-4a35-9a3f-6c2b1e1d0a02"))
TASK = {"question": "2 + 5"}


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[SqliteEventLog]:
    opened = await SqliteEventLog(tmp_path / "execute.sqlite", WORK_EVENTS, fold_work).open()
    try:
        yield opened
    finally:
        await opened.close()


def workflow(kinds: str) -> WorkflowDef:
    """`p` a Pure tool step, `m` a model step (written ahead), in this order."""
    steps: list[dict[str, Any]] = []
    for i, kind in enumerate(kinds):
        if kind == "p":
            args = {"text": f"step {i} of 7"}
            steps.append({"id": f"s{i}", "kind": "tool", "tool": "extract_number", "args": args})
        else:
            steps.append({"id": f"s{i}", "kind": "model", "prompt": "What is 2 + 5?"})
    doc = {"id": "deferred", "steps": steps}
    return validate(WorkflowDef.model_validate(doc), frozenset(BUILTIN_TOOLS))


def spec_for(wf: WorkflowDef) -> RunSpec:
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash(TASK)),
        idempotency_key=f"key-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input=TASK, branch=BranchId(0))


async def finish(journal: LogJournal, spec: RunSpec, episode: Episode) -> None:
    """The run's end, committed as `assay run` and execute commit it."""
    ended = RunFinished(succeeded=episode.succeeded, episode="-", usage=episode.usage)
    await journal.record_and_commit(spec.key, ended)


def shape(records: list[Any]) -> list[tuple[str, str | None]]:
    return [(type(r.event).__name__, getattr(r.event, "step", None)) for r in records]


async def test_consecutive_pure_steps_share_the_runs_last_commit(log: SqliteEventLog) -> None:
    spec = spec_for(workflow("ppppp"))
    journal = LogJournal(log, defers=True)
    before = log.transactions
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, journal)
    assert episode.succeeded
    assert [a.state for a in episode.attempts] == [AttemptState.SUCCEEDED] * 5
    assert log.transactions - before == 1  # RunStarted: nothing else is durable yet
    assert shape(await log.read(spec.key)) == [("RunStarted", None)]

    await finish(journal, spec, episode)
    assert log.transactions - before == 2
    records = await log.read(spec.key)
    assert [r.lsn for r in records] == list(range(12))
    steps = [(kind, f"s{i}") for i in range(5) for kind in ("AttemptStarted", "AttemptFinished")]
    assert shape(records) == [("RunStarted", None), *steps, ("RunFinished", None)]

    # the same records as a drive whose journal commits every Pure step on its own
    alone = spec_for(workflow("ppppp"))
    plain = LogJournal(log)
    episode_alone = await Driver(StubModel(), BUILTIN_TOOLS).drive(alone, plain)
    await finish(plain, alone, episode_alone)
    assert shape(await log.read(alone.key)) == shape(records)
    assert episode_alone.outputs == episode.outputs


async def test_a_write_ahead_record_carries_the_pure_steps_before_it(
    log: SqliteEventLog,
) -> None:
    spec = spec_for(workflow("ppmp"))
    journal = LogJournal(log, defers=True)
    before = log.transactions
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, journal)
    # RunStarted; s0+s1 with the model step's start; the model step's end; s3 waits
    assert log.transactions - before == 3
    records = await log.read(spec.key)
    assert shape(records)[-2:] == [("AttemptStarted", "s2"), ("AttemptFinished", "s2")]
    model_start = records[-2]
    assert isinstance(model_start.event, AttemptStarted)
    assert shape(records[1:5]) == [
        ("AttemptStarted", "s0"),
        ("AttemptFinished", "s0"),
        ("AttemptStarted", "s1"),
        ("AttemptFinished", "s1"),
    ]
    await finish(journal, spec, episode)
    assert shape(await log.read(spec.key))[-3:] == [
        ("AttemptStarted", "s3"),
        ("AttemptFinished", "s3"),
        ("RunFinished", None),
    ]


async def test_a_crash_before_the_next_commit_runs_the_pure_steps_again_once(
    log: SqliteEventLog,
) -> None:
    """The worker dies after its Pure steps ran, before anything committed them: the
    next drive finds only `RunStarted`, runs them again, and commits each as it goes
    (a recovering drive defers nothing), so every step is on record exactly once."""
    spec = spec_for(workflow("pppm"))
    died = LogJournal(log, defers=True)
    crashed_with = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, died)
    assert crashed_with.succeeded
    # ... the process dies here: its held records and the run's end never commit
    records = await log.read(spec.key)
    assert shape(records)[:3] == [
        ("RunStarted", None),
        ("AttemptStarted", "s0"),  # the model step s3's start carried s0..s2 with it
        ("AttemptFinished", "s0"),
    ]
    assert shape(records)[-1] == ("AttemptFinished", "s3")

    spec_lost = spec_for(workflow("pppp"))
    await Driver(StubModel(), BUILTIN_TOOLS).drive(spec_lost, LogJournal(log, defers=True))
    assert shape(await log.read(spec_lost.key)) == [("RunStarted", None)]  # all lost

    again = LogJournal(log, defers=True)
    before = log.transactions
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec_lost, again)
    assert episode.succeeded
    assert log.transactions - before >= 4  # recovering: committed step by step
    await finish(again, spec_lost, episode)
    records = await log.read(spec_lost.key)
    assert [r.lsn for r in records] == list(range(len(records)))
    finished = [r.event.step for r in records if isinstance(r.event, AttemptFinished)]
    assert finished == ["s0", "s1", "s2", "s3"]
    assert isinstance(records[0].event, RunStarted)


async def test_no_checkpoint_claims_what_is_only_held(log: SqliteEventLog) -> None:
    """A checkpoint is taken only where this drive's records are all committed: one
    taken while Pure steps are held would name outputs no record on the log has."""
    spec = spec_for(workflow("pppppp"))
    journal = LogJournal(log, defers=True)
    await Driver(StubModel(), BUILTIN_TOOLS, checkpoint_every=1).drive(spec, journal)
    assert await log.latest_checkpoint(spec.key) is None

    mixed = spec_for(workflow("pmpmpm"))
    held = LogJournal(log, defers=True)
    episode = await Driver(StubModel(), BUILTIN_TOOLS, checkpoint_every=1).drive(mixed, held)
    await finish(held, mixed, episode)
    checkpoint = await log.latest_checkpoint(mixed.key)
    assert checkpoint is not None
    on_log = {
        r.event.step: r.lsn
        for r in await log.read(mixed.key)
        if isinstance(r.event, AttemptFinished)
    }
    # every output the checkpoint holds is of a step whose end is on the log before it
    outputs = json.loads(checkpoint.state)["outputs"]
    assert outputs
    assert all(on_log[step] <= checkpoint.upto for step in outputs)
