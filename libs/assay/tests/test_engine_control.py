"""Control steps, cancellation, sandbox workspaces and log evolution in the driver —
on SQLite and on Postgres."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import uuid
from pathlib import Path
from typing import Any, Protocol

import pytest

from assay.engine import (
    BUILTIN_TOOLS,
    AttemptFinished,
    CancelScope,
    Driver,
    LogJournal,
    Pure,
    RunSpec,
    StepNotExecutable,
    StubModel,
    Tool,
    ToolCall,
    ToolError,
    Unsafe,
    check_executable,
)
from assay.engine.events import WORK_EVENTS, Intent, Routed, RunStarted, fold_work
from assay.engine.sandbox_tools import sandbox_tools
from assay.kernel import (
    AttemptState,
    BranchId,
    IntentState,
    TaskId,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.messages import AttemptIndeterminate, Purpose, Role, RunRef
from assay.record import BranchKey, Event
from assay.sandbox.local import LocalSandbox
from assay.store import FsBlobStore, SqliteEventLog
from assay.store.ports import EventLog
from assay.workflow import WorkflowDef, validate

TENANT = tenant_id(uuid.UUID("2d1f6a7b-5c4e-4b3a-8f9e-0a1b2c3d4e05"))


class WorkLogs(Protocol):
    async def open(self) -> EventLog: ...


def spec_for(doc: dict[str, Any], task: dict[str, Any], tools: dict[str, Tool]) -> RunSpec:
    wf = validate(WorkflowDef.model_validate({"id": "wf", **doc}), frozenset(tools))
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash(task)),
        idempotency_key=f"k-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input=task, branch=BranchId(0))


async def events(log: EventLog, spec: RunSpec) -> list[Event]:
    return [r.event for r in await log.read(spec.key)]


def echo(name: str, out: str, delay: float = 0.0, calls: list[str] | None = None) -> Tool:
    async def fn(call: ToolCall) -> str:
        if calls is not None:
            calls.append(name)
        await asyncio.sleep(delay)
        return out

    return Tool(name, fn, Pure(), name)


# -- conditional -------------------------------------------------------------------------

ROUTING = {
    "steps": [
        {
            "id": "measure",
            "kind": "tool",
            "tool": "extract_number",
            "args": {"text": "{{ task.t }}"},
        },
        {
            "id": "route",
            "kind": "conditional",
            "branches": [{"when": "number(steps.measure.output) > 100", "to": "big"}],
            "otherwise": "small",
        },
        {"id": "big", "kind": "tool", "tool": "strip", "args": {"text": " big "}},
        {"id": "small", "kind": "tool", "tool": "strip", "args": {"text": " small "}},
    ],
    "transitions": [
        {"from": "measure", "to": "route"},
        {"from": "small", "to": "big", "max_iterations": 1},
    ],
    "output": "big",
}


@pytest.mark.parametrize(("text", "path"), [("it is 250", ["big"]), ("only 7", ["small", "big"])])
async def test_a_conditional_routes_by_prior_outputs_and_records_its_choice(
    work_log: EventLog, text: str, path: list[str]
) -> None:
    spec = spec_for(ROUTING, {"t": text}, dict(BUILTIN_TOOLS))
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(work_log))
    assert episode.succeeded
    assert [a.step for a in episode.attempts] == ["measure", *path]
    (routed,) = [e for e in await events(work_log, spec) if isinstance(e, Routed)]
    assert routed.to == path[0]
    # Replaying never re-evaluates: a finished run appends nothing.
    before = await events(work_log, spec)
    await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(work_log))
    assert await events(work_log, spec) == before


async def test_a_condition_that_cannot_be_evaluated_fails_the_run_with_the_reason(
    work_log: EventLog,
) -> None:
    spec = spec_for(
        {
            **ROUTING,
            "steps": [
                {
                    "id": "measure",
                    "kind": "tool",
                    "tool": "strip",
                    "args": {"text": "{{ task.t }}"},
                },
                *ROUTING["steps"][1:],
            ],
        },
        {"t": "not a number"},
        dict(BUILTIN_TOOLS),
    )
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(work_log))
    assert not episode.succeeded
    assert episode.failed_step == "route"
    (routed,) = [e for e in await events(work_log, spec) if isinstance(e, Routed)]
    assert routed.error is not None
    assert "number" in routed.error


# -- parallel ----------------------------------------------------------------------------


def fan(join: str, quorum: int | None = None) -> dict[str, Any]:
    step: dict[str, Any] = {"id": "fan", "kind": "parallel", "branches": ["a", "b", "c"]}
    step["join"] = join
    if quorum is not None:
        step["quorum"] = quorum
    return {
        "steps": [
            step,
            {"id": "a", "kind": "tool", "tool": "fast", "args": {}},
            {"id": "b", "kind": "tool", "tool": "slow", "args": {}},
            {"id": "c", "kind": "tool", "tool": "medium", "args": {}},
        ],
        "output": "fan",
    }


def fan_tools() -> dict[str, Tool]:
    return {
        **BUILTIN_TOOLS,
        "fast": echo("fast", "A", 0.0),
        "medium": echo("medium", "C", 0.2),
        "slow": echo("slow", "B", 30.0),
    }


async def test_parallel_all_waits_for_every_branch(work_log: EventLog) -> None:
    tools = {**fan_tools(), "slow": echo("slow", "B", 0.3)}
    spec = spec_for(fan("all"), {}, tools)
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    assert episode.succeeded
    assert json.loads(episode.output or "") == {"a": "A", "b": "B", "c": "C"}


@pytest.mark.parametrize(
    ("join", "quorum", "winners"), [("any", None, {"a"}), ("quorum", 2, {"a", "c"})]
)
async def test_parallel_any_and_quorum_cancel_the_branches_they_no_longer_need(
    work_log: EventLog, join: str, quorum: int | None, winners: set[str]
) -> None:
    tools = fan_tools()
    spec = spec_for(fan(join, quorum), {}, tools)
    episode = await asyncio.wait_for(
        Driver(StubModel(), tools).drive(spec, LogJournal(work_log)), 10
    )
    assert episode.succeeded
    assert set(json.loads(episode.output or "")) == winners
    states: dict[str, AttemptState] = {a.step: a.state for a in episode.attempts}
    assert states["b"] is AttemptState.CANCELLED  # the slow branch was stopped, not awaited
    assert {s for s, st in states.items() if st is AttemptState.SUCCEEDED} >= winners


async def test_parallel_all_fails_when_a_branch_fails(work_log: EventLog) -> None:
    async def broken(call: ToolCall) -> str:
        raise ToolError("no")

    tools = {**fan_tools(), "slow": Tool("slow", broken, Pure(), "fails")}
    spec = spec_for(fan("all"), {}, tools)
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    assert not episode.succeeded
    assert episode.failed_step == "fan"


async def test_a_parallel_run_resumed_after_a_crash_reruns_only_unfinished_branches(
    work_logs: WorkLogs,
) -> None:
    calls: list[str] = []
    tools = {
        **BUILTIN_TOOLS,
        "fast": echo("fast", "A", 0.0, calls),
        "medium": echo("medium", "C", 0.0, calls),
        "slow": echo("slow", "B", 30.0, calls),
    }
    spec = spec_for(fan("all"), {}, tools)
    first = await work_logs.open()
    task = asyncio.create_task(Driver(StubModel(), tools).drive(spec, LogJournal(first)))
    await asyncio.sleep(0.5)  # a and c finished, b is stuck
    task.cancel()  # the worker dies
    await asyncio.gather(task, return_exceptions=True)
    tools["slow"] = echo("slow", "B", 0.0, calls)
    second = await work_logs.open()
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(second))
    assert episode.succeeded
    assert sorted(calls) == ["fast", "medium", "slow", "slow"]  # a and c were not run again


# -- cancellation ------------------------------------------------------------------------


def one_step(tool: str) -> dict[str, Any]:
    return {"steps": [{"id": "act", "kind": "tool", "tool": tool, "args": {"x": "1"}}]}


async def test_cancelling_an_attempt_without_a_dispatched_intent_is_cancelled(
    work_log: EventLog,
) -> None:
    tools = {"wait": echo("wait", "done", 30.0)}
    spec = spec_for(one_step("wait"), {}, tools)
    scope = CancelScope()
    task = asyncio.create_task(Driver(StubModel(), tools).drive(spec, LogJournal(work_log), scope))
    await asyncio.sleep(0.2)
    scope.cancel("by the user")
    episode = await asyncio.wait_for(task, 5)
    assert not episode.succeeded
    assert episode.failed_step is None
    assert [a.state for a in episode.attempts] == [AttemptState.CANCELLED]
    assert "by the user" in (episode.attempts[0].error or "")


async def test_cancelling_a_dispatched_call_is_indeterminate(work_log: EventLog) -> None:
    async def charge(call: ToolCall) -> str:
        await asyncio.sleep(30)
        return "charged"

    tools = {"charge": Tool("charge", charge, Unsafe(), "charges")}
    spec = spec_for(one_step("charge"), {}, tools)
    scope = CancelScope()
    journal = LogJournal(work_log)
    task = asyncio.create_task(Driver(StubModel(), tools).drive(spec, journal, scope))
    await asyncio.sleep(0.2)
    scope.cancel("by the user")
    episode = await asyncio.wait_for(task, 5)
    assert [a.state for a in episode.attempts] == [AttemptState.INDETERMINATE]
    recorded = [(e.state) for e in await events(work_log, spec) if isinstance(e, Intent)]
    assert recorded == [IntentState.PENDING, IntentState.DISPATCHED]
    assert [type(m) for _, m in journal.emitted] == [AttemptIndeterminate]


async def test_a_run_cancelled_before_it_starts_runs_nothing(work_log: EventLog) -> None:
    calls: list[str] = []
    tools = {"wait": echo("wait", "done", 0.0, calls)}
    spec = spec_for(one_step("wait"), {}, tools)
    scope = CancelScope()
    scope.cancel("before admission")
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log), scope)
    assert episode.attempts == []
    assert calls == []


async def test_a_drive_stopped_from_outside_stops_its_tool_call(work_log: EventLog) -> None:
    """A drive cancelled as a whole (its lease was lost, its worker shuts down) takes the
    call it was making with it, rather than leaving it running with nobody to record it."""
    started, ended = asyncio.Event(), asyncio.Event()

    async def wait(call: ToolCall) -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            ended.set()
        return "never"

    tools = {"wait": Tool("wait", wait, Pure(), "waits")}
    spec = spec_for(one_step("wait"), {}, tools)
    drive = asyncio.create_task(Driver(StubModel(), tools).drive(spec, LogJournal(work_log)))
    await asyncio.wait_for(started.wait(), 5)
    drive.cancel()
    await asyncio.gather(drive, return_exceptions=True)
    await asyncio.wait_for(ended.wait(), 1)


# -- sandbox workspaces ------------------------------------------------------------------


@pytest.fixture
def sandbox(tmp_path: Path) -> LocalSandbox:
    return LocalSandbox(tmp_path / "sandbox", FsBlobStore(tmp_path / "blobs"))


FILES = {
    "steps": [
        {
            "id": "write",
            "kind": "tool",
            "tool": "write_file",
            "args": {"path": "a.txt", "content": "hi"},
        },
        {"id": "read", "kind": "tool", "tool": "command", "args": {"argv": '["cat", "a.txt"]'}},
    ],
    "output": "read",
}


async def test_steps_share_the_runs_workspace_and_a_resumed_run_restores_its_snapshot(
    work_logs: WorkLogs, sandbox: LocalSandbox
) -> None:
    tools = {**BUILTIN_TOOLS, **sandbox_tools()}
    spec = spec_for(FILES, {}, tools)
    log = await work_logs.open()
    # The first worker writes the file, then dies before the second step.

    class DiesBeforeRead(LogJournal):
        async def record_and_commit(self, key: Any, *evs: Event, emits: Any = ()) -> None:
            if any(getattr(e, "step", None) == "read" for e in evs):
                raise asyncio.CancelledError
            await super().record_and_commit(key, *evs, emits=emits)

    with pytest.raises(asyncio.CancelledError):
        await Driver(StubModel(), tools, sandbox).drive(spec, DiesBeforeRead(log))
    finished = [e for e in await events(log, spec) if isinstance(e, AttemptFinished)]
    assert finished[0].workspace is not None  # the snapshot after `write`
    reopened = await work_logs.open()
    episode = await Driver(StubModel(), tools, sandbox).drive(spec, LogJournal(reopened))
    assert episode.succeeded, episode.attempts
    assert episode.output == "hi"
    assert episode.workspace is not None


async def test_a_sandboxed_tool_without_a_sandbox_is_refused(work_log: EventLog) -> None:
    tools = {**BUILTIN_TOOLS, **sandbox_tools()}
    spec = spec_for(FILES, {}, tools)
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    assert not episode.succeeded
    assert "sandbox" in (episode.attempts[0].error or "")


# -- step kinds this executor refuses, and log evolution ---------------------------------


CHILD = {
    "id": "child",
    "steps": [
        {
            "id": "double",
            "kind": "tool",
            "tool": "strip",
            "args": {"text": " {{ task.x }}{{ task.x }} "},
        }
    ],
}


async def test_a_subworkflow_runs_on_its_own_stream_and_its_output_is_the_steps(
    work_log: EventLog,
) -> None:
    tools = dict(BUILTIN_TOOLS)
    child = validate(WorkflowDef.model_validate(CHILD), frozenset(tools))
    parent = {
        "steps": [
            {
                "id": "call",
                "kind": "subworkflow",
                "workflow": "child",
                "version": "latest",
                "input": {"x": "{{ task.n }}"},
            },
            {
                "id": "after",
                "kind": "tool",
                "tool": "strip",
                "args": {"text": "{{ steps.call.output }}!"},
            },
        ],
        "output": "after",
    }
    spec = spec_for(parent, {"n": "4"}, tools)
    spec = dataclasses.replace(spec, children={"child@latest": child})
    journal = LogJournal(work_log)
    episode = await Driver(StubModel(), tools).drive(spec, journal)
    assert episode.succeeded
    assert episode.output == "44!"
    inner = BranchKey(TENANT, f"{spec.ref.run_id}/sub/call/0", BranchId(0))
    inner_events = [r.event for r in await work_log.read(inner)]
    assert [e.type for e in inner_events][:2] == ["RunStarted", "AttemptStarted"]
    started = next(r.event for r in await work_log.read(spec.key))
    assert isinstance(started, RunStarted)
    assert started.subworkflows["child@latest"]["id"] == "child"  # the pin is recorded
    # Driving it again re-runs nothing, in the run or in the sub-workflow.
    before = [r.event for r in await work_log.read(spec.key)] + inner_events
    await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    after = [r.event for r in await work_log.read(spec.key)]
    assert after + [r.event for r in await work_log.read(inner)] == before


def test_an_await_inside_a_subworkflow_is_refused_before_a_run_starts() -> None:
    parent = WorkflowDef.model_validate(
        {
            "id": "p",
            "steps": [{"id": "c", "kind": "subworkflow", "workflow": "w", "version": "latest"}],
        }
    )
    waits = WorkflowDef.model_validate(
        {"id": "w", "steps": [{"id": "ask", "kind": "await", "timeout_s": 60}]}
    )
    with pytest.raises(StepNotExecutable, match="await"):
        check_executable(parent, {"w@latest": waits})


async def test_a_log_written_at_attempt_finished_v1_still_resumes(tmp_path: Path) -> None:
    tools = dict(BUILTIN_TOOLS)
    spec = spec_for(ROUTING, {"t": "it is 250"}, tools)
    path = tmp_path / "execute.sqlite"
    log = await SqliteEventLog(path, WORK_EVENTS, fold_work).open()
    await Driver(StubModel(), tools).drive(spec, LogJournal(log))
    await log.close()
    # Rewrite every AttemptFinished as the version-1 code stored it (no workspace field).
    with sqlite3.connect(path) as db:
        for seq, payload in db.execute(
            "SELECT seq, payload FROM log WHERE type = 'AttemptFinished'"
        ).fetchall():
            doc = json.loads(payload)
            doc.pop("workspace")
            db.execute(
                "UPDATE log SET schema_version = 1, payload = ? WHERE seq = ?",
                (json.dumps(doc).encode(), seq),
            )
    log = await SqliteEventLog(path, WORK_EVENTS, fold_work).open()
    try:
        olds = [r for r in await log.read(spec.key) if isinstance(r.event, AttemptFinished)]
        assert {r.schema_version for r in olds} == {1}
        assert all(r.event.workspace is None for r in olds)  # type: ignore[attr-defined]
        journal = LogJournal(log)
        episode = await Driver(StubModel(), tools).drive(spec, journal)
        assert episode.succeeded
        assert (await log.rebuild(keep=False)).identical
    finally:
        await log.close()


# -- checkpoints: an optimisation only ---------------------------------------------------

LONG = {
    "steps": [
        {"id": f"s{i}", "kind": "tool", "tool": "strip", "args": {"text": f" {i} "}}
        for i in range(6)
    ]
    + [
        {
            "id": "route",
            "kind": "conditional",
            "branches": [{"when": "steps.s5.output == '5'", "to": "end"}],
        },
        {"id": "end", "kind": "tool", "tool": "strip", "args": {"text": "{{ steps.s2.output }}"}},
    ],
    "output": "end",
}


async def test_a_resumed_run_starts_from_its_checkpoint_and_deleting_them_changes_nothing(
    work_logs: WorkLogs,
) -> None:
    tools = dict(BUILTIN_TOOLS)
    spec = spec_for(LONG, {}, tools)
    log = await work_logs.open()

    class DiesAtEnd(LogJournal):
        async def record_and_commit(self, key: Any, *evs: Event, emits: Any = ()) -> None:
            if any(getattr(e, "step", None) == "end" for e in evs):
                raise asyncio.CancelledError
            await super().record_and_commit(key, *evs, emits=emits)

    with pytest.raises(asyncio.CancelledError):
        await Driver(StubModel(), tools, checkpoint_every=3).drive(spec, DiesAtEnd(log))
    cp = await log.latest_checkpoint(spec.key)
    assert cp is not None  # written at a step boundary, every 3 records or so
    assert cp.upto > 0

    class Reads(LogJournal):
        def __init__(self, log: EventLog) -> None:
            super().__init__(log)
            self.read_from: list[int] = []

        async def history(self, key: Any) -> list[Any]:
            self.read_from.append(0)
            return await super().history(key)

        async def history_after(self, key: Any, upto: Any) -> list[Any]:
            self.read_from.append(upto + 1)
            return await super().history_after(key, upto)

    resumed_log = await work_logs.open()
    reads = Reads(resumed_log)
    episode = await Driver(StubModel(), tools, checkpoint_every=3).drive(spec, reads)
    assert reads.read_from == [cp.upto + 1]  # not from LSN 0
    assert episode.succeeded
    assert episode.output == "2"
    records = [r.event for r in await resumed_log.read(spec.key)]

    # Without any checkpoint, the same drive gives the same episode and appends nothing.
    await resumed_log.delete_checkpoints(spec.key)
    assert await resumed_log.latest_checkpoint(spec.key) is None
    again = await Driver(StubModel(), tools, checkpoint_every=3).drive(
        spec, LogJournal(resumed_log)
    )
    assert again.model_dump(exclude={"attempts"}) == episode.model_dump(exclude={"attempts"})
    assert [(a.step, a.attempt, a.state, a.output) for a in again.attempts] == [
        (a.step, a.attempt, a.state, a.output) for a in episode.attempts
    ]
    assert [r.event for r in await resumed_log.read(spec.key)] == records
