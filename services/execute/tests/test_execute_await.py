"""Await steps (§5.2): a run suspends, holds no lease, and resumes on a signal, an
approval, its deadline or a cancel — on SQLite and on Postgres."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RUN_COMMANDS, RUNS
from assay.engine import BUILTIN_TOOLS, Pure, RunFinished, StubModel, Tool, ToolCall
from assay.grading import StubJudge
from assay.kernel import BranchId, RunState, TaskId, TenantId, content_hash, new_run_id
from assay.messages import (
    MESSAGES,
    CancelRun,
    Purpose,
    RewindRun,
    Role,
    RunExecuted,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    SignalRun,
    open_envelope,
)
from assay.record import BranchKey
from assay.runtime import StageDeps, StageHarness
from assay.store import FsBlobStore
from assay.store.ports import EventLog
from assay.workflow import WorkflowDef, validate
from assay_execute import create_stage

TENANT = TenantId(uuid.UUID(int=77))


@pytest.fixture
def store(work_log: EventLog) -> EventLog:
    """The execute stage's store, on SQLite and on Postgres (`work_log`, root conftest)."""
    return work_log


def deps(tmp_path: Path) -> StageDeps:
    return StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        worker=f"w-{uuid.uuid4().hex[:6]}",
        lease_ttl_s=5.0,
    )


def spawned(
    timeout_s: float = 3600, on_timeout: str = "fail", *, then_pure: bool = False
) -> RunSpawned:
    """`then_pure`: the wait is followed straight by a Pure tool step, no conditional."""
    doc: dict[str, Any] = {
        "id": "approve",
        "steps": [
            {
                "id": "ask",
                "kind": "await",
                "signal": "approval",
                "timeout_s": timeout_s,
                "on_timeout": on_timeout,
            },
            {
                "id": "route",
                "kind": "conditional",
                "branches": [{"when": "steps.ask.succeeded", "to": "use"}],
                "otherwise": "fallback",
            },
            {
                "id": "use",
                "kind": "tool",
                "tool": "strip",
                "args": {"text": "{{ steps.ask.output }}"},
            },
            {"id": "fallback", "kind": "tool", "tool": "strip", "args": {"text": " none "}},
        ],
        "transitions": [{"from": "ask", "to": "route"}],
    }
    if then_pure:
        doc = {"id": "approve", "steps": [doc["steps"][0], doc["steps"][2]]}
    wf = validate(WorkflowDef.model_validate(doc), frozenset(BUILTIN_TOOLS))
    task = {"n": "1"}
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key="await-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


def _forked(m: Any) -> bool:
    return isinstance(m, RunStatusChanged | RunExecuted) and m.run.branch is not None


def statuses(out: list[Any]) -> list[RunState]:
    return [m.state for m in out if isinstance(m, RunStatusChanged)]


async def test_a_run_suspends_without_a_lease_and_an_approval_resumes_it(
    store: EventLog, tmp_path: Path
) -> None:
    d = deps(tmp_path)
    msg = spawned()
    async with StageHarness(create_stage(d), d.blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        assert statuses(await stage.emitted()) == [RunState.RUNNING, RunState.SUSPENDED]
        assert [m for m in await stage.emitted() if isinstance(m, RunExecuted)] == []
        # No lease is held: any worker may take the run at once.
        other = await store.claim(TENANT, msg.run.run_id, "someone-else", 1000)
        assert other is not None
        await store.release(other)

        approval = SignalRun(
            tenant=TENANT, run_id=msg.run.run_id, signal="approval", payload=" yes "
        )
        await stage.deliver(RUN_COMMANDS, approval, TENANT)
        out = await stage.emitted()
        assert statuses(out) == [
            RunState.RUNNING,
            RunState.SUSPENDED,
            RunState.RUNNING,
            RunState.VERIFYING,
        ]
        (executed,) = [m for m in out if isinstance(m, RunExecuted)]
        assert executed.succeeded
        doc = await stage.state(TENANT, "run", msg.run.run_id)
        assert doc is not None
        assert doc["status"] == "verifying"
        assert await stage.dead_letters() == []


async def test_running_commits_with_the_signal_before_the_next_step_runs(
    store: EventLog, tmp_path: Path
) -> None:
    """The step after the wait is Pure: its first commit comes only after its call. A
    worker that dies in that call must not take `Running` with it — a redelivered signal
    only drives the resumed run on, and the run would go from Suspended to Verifying."""
    called, release = asyncio.Event(), asyncio.Event()

    async def held(call: ToolCall) -> str:
        called.set()
        await release.wait()
        return call.args["text"].strip()

    d = deps(tmp_path)
    d.tools["strip"] = Tool("strip", held, Pure(), "strip, once released")
    msg = spawned(then_pure=True)
    async with StageHarness(create_stage(d), d.blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        approval = SignalRun(tenant=TENANT, run_id=msg.run.run_id, signal="approval", payload="y")
        resuming = asyncio.create_task(stage.deliver(RUN_COMMANDS, approval, TENANT))
        await called.wait()  # the Pure step's call is under way: nothing of it is committed
        assert statuses(await stage.emitted()) == [
            RunState.RUNNING,
            RunState.SUSPENDED,
            RunState.RUNNING,
        ]
        release.set()
        await resuming
        assert statuses(await stage.emitted())[-1] is RunState.VERIFYING


@pytest.mark.parametrize(
    ("signal", "reason"), [("deploy", "waits for 'approval'"), ("approval", "not waiting")]
)
async def test_a_signal_the_run_does_not_wait_for_is_refused(
    store: EventLog, tmp_path: Path, signal: str, reason: str
) -> None:
    d = deps(tmp_path)
    msg = spawned()
    async with StageHarness(create_stage(d), d.blobs, tmp_path / "w", log=store) as stage:
        if reason != "not waiting":
            await stage.deliver(RUNS, msg, TENANT)
        await stage.deliver(
            RUN_COMMANDS, SignalRun(tenant=TENANT, run_id=msg.run.run_id, signal=signal), TENANT
        )
        ((_, why),) = await stage.dead_letters()
        assert reason in why


@pytest.mark.parametrize(("on_timeout", "succeeded"), [("fail", False), ("continue", True)])
async def test_an_await_timeout_is_a_recorded_outcome(
    store: EventLog, tmp_path: Path, on_timeout: str, succeeded: bool
) -> None:
    d = deps(tmp_path)
    msg = spawned(timeout_s=1, on_timeout=on_timeout)
    spec = create_stage(d)
    async with StageHarness(spec, d.blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        stop = asyncio.Event()
        timers = asyncio.create_task(spec.background[0](store, stop))
        try:
            timer = None
            for _ in range(100):  # the timer fires within a tick of the deadline
                if timer := await timeout_signal(stage):
                    break
                await asyncio.sleep(0.1)
            assert timer is not None
        finally:
            stop.set()
            await timers
        await stage.deliver_raw(RUN_COMMANDS, timer)
        (executed,) = [m for m in await stage.emitted() if isinstance(m, RunExecuted)]
        assert executed.succeeded is succeeded
        if succeeded:  # it went on past the step, which did not succeed
            assert executed.failed_step is None
        else:
            assert executed.failed_step == "ask"


async def timeout_signal(stage: StageHarness) -> bytes | None:
    for row in await stage.outbox():
        env = open_envelope(row.entry.value)
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        if isinstance(msg, SignalRun) and msg.timed_out:
            return row.entry.value
    return None


async def test_a_suspended_run_can_be_cancelled(store: EventLog, tmp_path: Path) -> None:
    d = deps(tmp_path)
    msg = spawned()
    async with StageHarness(create_stage(d), d.blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        cancel = CancelRun(tenant=TENANT, run_id=msg.run.run_id, reason="no longer needed")
        await stage.deliver(RUN_COMMANDS, cancel, TENANT)
        out = await stage.emitted()
        assert statuses(out)[-1] is RunState.CANCELLED
        (result,) = [m for m in out if isinstance(m, RunResult)]
        assert result.status == "cancelled"
        assert result.held_out is msg.run.held_out  # a cancelled result says its split too
        assert await stage.state(TENANT, "await", msg.run.run_id) is None


def rewind(msg: RunSpawned, at: int) -> RewindRun:
    return RewindRun(tenant=TENANT, run_id=msg.run.run_id, at=at, reason="again")


def approval(msg: RunSpawned) -> SignalRun:
    return SignalRun(tenant=TENANT, run_id=msg.run.run_id, signal="approval", payload="yes")


async def test_a_waiting_run_is_not_rewound_until_it_is_cancelled(
    store: EventLog, tmp_path: Path
) -> None:
    d = deps(tmp_path)
    msg = spawned()
    async with StageHarness(create_stage(d), d.blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        await stage.deliver(RUN_COMMANDS, rewind(msg, 1), TENANT)
        ((_, why),) = await stage.dead_letters()
        assert "cancel it before rewinding it" in why
        assert [k.branch for k in await store.branches(msg.run.run_id, TENANT)] == [0]
        # The run still waits where it was, and its approval still ends it.
        await stage.deliver(RUN_COMMANDS, approval(msg), TENANT)
        out = await stage.emitted()
        assert len([m for m in out if isinstance(m, RunExecuted)]) == 1
        assert statuses(out)[-1] is RunState.VERIFYING


async def test_a_fork_that_waits_has_its_own_lifecycle_beside_the_runs(
    store: EventLog, tmp_path: Path
) -> None:
    d = deps(tmp_path)
    msg = spawned()
    async with StageHarness(create_stage(d), d.blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        await stage.deliver(RUN_COMMANDS, approval(msg), TENANT, idem="first")
        lifecycle = statuses(await stage.emitted())
        assert lifecycle[-1] is RunState.VERIFYING
        await stage.deliver(RUN_COMMANDS, rewind(msg, 1), TENANT)  # the fork waits at `ask`
        doc = await stage.state(TENANT, "run", msg.run.run_id)
        assert doc is not None
        assert (doc["branch"], doc["status"]) == (1, "suspended")
        await stage.deliver(RUN_COMMANDS, approval(msg), TENANT, idem="second")
        out = await stage.emitted()
        # Branch 0's lifecycle never goes back from Verifying to Suspended: the fork's
        # transitions are its own, each marked with its branch and parent.
        assert statuses([m for m in out if not _forked(m)]) == lifecycle
        forked = [m for m in out if isinstance(m, RunStatusChanged) and _forked(m)]
        assert [m.state for m in forked] == [
            RunState.RUNNING,
            RunState.SUSPENDED,
            RunState.RUNNING,
            RunState.VERIFYING,
        ]
        assert {(m.run.branch.branch, m.run.branch.parent) for m in forked if m.run.branch} == {
            (1, 0)
        }
        executed = [m for m in out if isinstance(m, RunExecuted)]
        assert [m.run.branch_id for m in executed] == [0, 1]  # the fork goes on too
        fork = await store.read(BranchKey.for_run(TENANT, msg.run.run_id, BranchId(1)))
        assert isinstance(fork[-1].event, RunFinished)
