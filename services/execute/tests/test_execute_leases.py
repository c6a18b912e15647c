"""Leases and fencing in the execute stage (§9.4), on SQLite and on Postgres.

Two workers share one store. Worker A is frozen mid-run — its tool call and its
heartbeat both stop, as under SIGSTOP — for twice the lease TTL; worker B gets
the run's message again (as after a rebalance), takes the lease over and
finishes the run from the log. When A thaws, none of its writes is accepted.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from assay.bus import RUN_COMMANDS, RUNS
from assay.engine import (
    BUILTIN_TOOLS,
    AttemptFinished,
    AttemptStarted,
    Pure,
    RunFinished,
    StubModel,
    Tool,
    ToolCall,
    Unsafe,
)
from assay.engine.events import Forked, Intent
from assay.grading import StubJudge
from assay.kernel import (
    AttemptState,
    BranchId,
    IntentState,
    RunState,
    TaskId,
    TenantId,
    content_hash,
    new_run_id,
)
from assay.messages import (
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
)
from assay.record import BranchKey, LogRecord
from assay.runtime import StageDeps, StageHarness
from assay.runtime.metrics import stage_registry
from assay.store import FsBlobStore
from assay.store.ports import EventLog, Lease
from assay.workflow import WorkflowDef, validate
from assay_execute import create_stage

TENANT = TenantId(uuid.UUID(int=41))
TTL_S = 0.6


@dataclass
class Freezer:
    """SIGSTOP for one worker: while frozen, its tool and its heartbeat make no progress."""

    thawed: asyncio.Event

    async def wait(self) -> None:
        await self.thawed.wait()


class FrozenRenewals:
    """A store whose renewals wait while the worker is frozen (its heartbeat is stopped)."""

    def __init__(self, inner: EventLog, freezer: Freezer) -> None:
        self._inner = inner
        self._freezer = freezer

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def renew(self, lease: Lease, ttl_ms: int) -> Lease:
        await self._freezer.wait()
        return await self._inner.renew(lease, ttl_ms)


@pytest.fixture
def store(work_log: EventLog) -> EventLog:
    """The execute stage's store, on SQLite and on Postgres (`work_log`, root conftest)."""
    return work_log


def deps(tools: dict[str, Tool], worker: str = "w") -> StageDeps:
    return StageDeps(
        blobs=FsBlobStore(Path("/nonexistent")),
        model=StubModel(),
        judge=StubJudge(),
        tools=tools,
        worker=worker,
        lease_ttl_s=TTL_S,
    )


def spawned(tool: str) -> RunSpawned:
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "slow",
                "steps": [
                    {"id": "work", "kind": "tool", "tool": tool, "args": {"x": "{{ task.x }}"}},
                    {"id": "tidy", "kind": "tool", "tool": "strip", "args": {"text": " ok "}},
                ],
            }
        ),
        frozenset([*BUILTIN_TOOLS, tool]),
    )
    task = {"x": "1"}
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key="lease-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


async def test_a_frozen_worker_is_taken_over_and_none_of_its_writes_land(
    store: EventLog, tmp_path: Path
) -> None:
    freezer = Freezer(asyncio.Event())
    started = asyncio.Event()

    async def slow(call: ToolCall) -> str:  # worker A's copy freezes mid-call
        started.set()
        await freezer.wait()
        return "from A"

    async def quick(call: ToolCall) -> str:
        return "from B"

    blobs = FsBlobStore(tmp_path / "blobs")
    tools_a = dict(BUILTIN_TOOLS, work=Tool("work", slow, Pure(), "slow"))
    tools_b = dict(BUILTIN_TOOLS, work=Tool("work", quick, Pure(), "quick"))
    deps_a = deps(tools_a, worker="worker-a")
    deps_b = deps(tools_b, worker="worker-b")
    deps_a.blobs = deps_b.blobs = blobs
    msg = spawned("work")
    key = BranchKey.for_run(TENANT, msg.run.run_id, BranchId(0))
    frozen_a = FrozenRenewals(store, freezer)

    async with (
        StageHarness(create_stage(deps_a), blobs, tmp_path / "a", log=frozen_a) as a,  # type: ignore[arg-type]
        StageHarness(create_stage(deps_b), blobs, tmp_path / "b", log=store) as b,
    ):
        worker_a = asyncio.create_task(a.deliver(RUNS, msg, TENANT, idem="m"))
        await started.wait()
        await asyncio.sleep(2 * TTL_S)  # A stays frozen for twice the TTL
        await asyncio.wait_for(b.deliver(RUNS, msg, TENANT, idem="m"), 10)
        records_after_b = await store.read(key)
        assert [r.event for r in records_after_b if isinstance(r.event, RunFinished)]

        freezer.thawed.set()  # SIGCONT
        await asyncio.wait_for(worker_a, 10)

        assert await store.read(key) == records_after_b  # no write of A's was accepted
        assert a.runner is not None
        assert a.runner.abandoned == 1
        metrics = stage_registry(a.runner)
        assert metrics.get_sample_value("assay_messages_abandoned_total", {"stage": "execute"}) == 1
        assert b.runner is not None
        assert (
            stage_registry(b.runner).get_sample_value(
                "assay_messages_abandoned_total", {"stage": "execute"}
            )
            == 0
        )
        finished = [r.event for r in records_after_b if isinstance(r.event, AttemptFinished)]
        # A's attempt of the Pure step left nothing on record (its start commits with its
        # end): B ran the step again, as attempt 1.
        starts = [r.event for r in records_after_b if isinstance(r.event, AttemptStarted)]
        assert [(e.step, e.attempt) for e in starts] == [("work", 1), ("tidy", 1)]
        assert [(f.step, f.attempt, f.interrupted) for f in finished][:1] == [("work", 1, False)]
        assert [f.output for f in finished if f.step == "work"] == ["from B"]
        # One outbox (the store is shared): the run was handed on once, by B.
        executed = [m for m in await b.emitted() if isinstance(m, RunExecuted)]
        assert len(executed) == 1


# -- cancellation through assay.run-commands ------------------------------------------------


def cancel_of(msg: RunSpawned, reason: str = "stop it") -> CancelRun:
    return CancelRun(tenant=TENANT, run_id=msg.run.run_id, reason=reason)


async def test_a_cancel_stops_a_run_this_worker_drives(store: EventLog, tmp_path: Path) -> None:
    started = asyncio.Event()

    async def slow(call: ToolCall) -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    blobs = FsBlobStore(tmp_path / "blobs")
    d = deps(dict(BUILTIN_TOOLS, work=Tool("work", slow, Pure(), "slow")))
    d.blobs = blobs
    msg = spawned("work")
    async with StageHarness(create_stage(d), blobs, tmp_path / "w", log=store) as stage:
        running = asyncio.create_task(stage.deliver(RUNS, msg, TENANT, idem="m"))
        await started.wait()
        await stage.deliver(RUN_COMMANDS, cancel_of(msg), TENANT)
        await asyncio.wait_for(running, 5)
        out = await stage.emitted()
        (result,) = [m for m in out if isinstance(m, RunResult)]
        assert (result.status, result.termination, result.score) == ("cancelled", "cancelled", None)
        statuses = [m.state for m in out if isinstance(m, RunStatusChanged)]
        assert statuses == [RunState.RUNNING, RunState.CANCELLED]
        assert [m for m in out if isinstance(m, RunExecuted)] == []
        doc = await stage.state(TENANT, "run", msg.run.run_id)
        assert doc is not None
        assert (doc["status"], doc["indeterminate"]) == ("cancelled", False)
        key = BranchKey.for_run(TENANT, msg.run.run_id, BranchId(0))
        finished = [r.event for r in await store.read(key) if isinstance(r.event, AttemptFinished)]
        assert [f.state for f in finished] == [AttemptState.CANCELLED]


async def test_a_cancel_before_the_run_starts_means_it_never_runs(
    store: EventLog, tmp_path: Path
) -> None:
    calls: list[str] = []

    async def work(call: ToolCall) -> str:
        calls.append("work")
        return "done"

    blobs = FsBlobStore(tmp_path / "blobs")
    d = deps(dict(BUILTIN_TOOLS, work=Tool("work", work, Pure(), "work")))
    d.blobs = blobs
    msg = spawned("work")
    async with StageHarness(create_stage(d), blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUN_COMMANDS, cancel_of(msg, "not needed"), TENANT)
        await stage.deliver(RUNS, msg, TENANT)
        assert calls == []
        (result,) = [m for m in await stage.emitted() if isinstance(m, RunResult)]
        assert result.status == "cancelled"


async def test_a_cancel_handled_by_another_worker_reaches_the_driving_one(
    store: EventLog, tmp_path: Path
) -> None:
    started = asyncio.Event()

    async def slow(call: ToolCall) -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    blobs = FsBlobStore(tmp_path / "blobs")
    driving = deps(dict(BUILTIN_TOOLS, work=Tool("work", slow, Pure(), "slow")), "worker-a")
    other = deps(dict(BUILTIN_TOOLS, work=Tool("work", slow, Pure(), "slow")), "worker-b")
    driving.blobs = other.blobs = blobs
    msg = spawned("work")
    async with (
        StageHarness(create_stage(driving), blobs, tmp_path / "a", log=store) as a,
        StageHarness(create_stage(other), blobs, tmp_path / "b", log=store) as b,
    ):
        running = asyncio.create_task(a.deliver(RUNS, msg, TENANT, idem="m"))
        await started.wait()
        await b.deliver(RUN_COMMANDS, cancel_of(msg, "from elsewhere"), TENANT)
        await asyncio.wait_for(running, 2 * TTL_S + 3)  # seen at the next heartbeat
        (result,) = [m for m in await a.emitted() if isinstance(m, RunResult)]
        assert result.status == "cancelled"


# -- rewind: a fork, nothing deleted (§8.5) ------------------------------------------------


def rewind_of(msg: RunSpawned, at: int, branch: int | None = None) -> RewindRun:
    return RewindRun(tenant=TENANT, run_id=msg.run.run_id, at=at, branch=branch, reason="retry")


def key_of(msg: RunSpawned, branch: int) -> BranchKey:
    return BranchKey.for_run(TENANT, msg.run.run_id, BranchId(branch))


async def test_a_rewind_forks_a_new_branch_and_keeps_the_old_one(
    store: EventLog, tmp_path: Path
) -> None:
    outputs = iter(["first", "second"])

    async def work(call: ToolCall) -> str:
        return next(outputs)

    blobs = FsBlobStore(tmp_path / "blobs")
    d = deps(dict(BUILTIN_TOOLS, work=Tool("work", work, Pure(), "work")))
    d.blobs = blobs
    msg = spawned("work")
    async with StageHarness(create_stage(d), blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        parent = await store.read(key_of(msg, 0))
        at = next(
            r.lsn for r in parent if isinstance(r.event, AttemptStarted) and r.event.step == "work"
        )
        await stage.deliver(RUN_COMMANDS, rewind_of(msg, at), TENANT)

        assert await store.read(key_of(msg, 0)) == parent  # kept, unchanged
        child = await store.read(key_of(msg, 1))
        assert [r.lsn for r in child] == list(range(len(child)))  # LSNs from zero
        assert [r.event for r in child[:at]] == [r.event for r in parent[:at]]
        forked = child[at].event
        assert isinstance(forked, Forked)
        assert (forked.from_branch, forked.at) == (0, at)
        outs = [r.event.output for r in child if isinstance(r.event, AttemptFinished)]
        assert outs[0] == "second"  # the step ran again on the new branch
        assert isinstance(child[-1].event, RunFinished)
        doc = await stage.state(TENANT, "run", msg.run.run_id)
        assert doc is not None
        assert doc["branch"] == 1  # queries default to the live branch
        assert doc["forked_from"] == {"branch": 0, "at": at}
        assert await stage.dead_letters() == []


async def test_a_rewind_past_a_committed_unsafe_call_flags_it(
    store: EventLog, tmp_path: Path
) -> None:
    async def charge(call: ToolCall) -> str:
        return "charged"

    blobs = FsBlobStore(tmp_path / "blobs")
    d = deps(dict(BUILTIN_TOOLS, work=Tool("work", charge, Unsafe(), "charges")))
    d.blobs = blobs
    msg = spawned("work")
    async with StageHarness(create_stage(d), blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        parent = await store.read(key_of(msg, 0))
        committed = [
            r.event
            for r in parent
            if isinstance(r.event, Intent) and r.event.state is IntentState.COMMITTED
        ]
        await stage.deliver(RUN_COMMANDS, rewind_of(msg, 1), TENANT)
        forked = next(
            r.event for r in await store.read(key_of(msg, 1)) if isinstance(r.event, Forked)
        )
        assert forked.discarded_effects == [committed[0].request_id]


@pytest.mark.parametrize(
    ("at", "branch", "reason"),
    [(10_000, None, "past the end"), (1, 7, "no branch 7"), (0, None, "LSN 1 or later")],
)
async def test_an_impossible_rewind_is_refused_with_the_reason(
    store: EventLog, tmp_path: Path, at: int, branch: int | None, reason: str
) -> None:
    blobs = FsBlobStore(tmp_path / "blobs")
    d = deps(dict(BUILTIN_TOOLS, work=echo_tool()))
    d.blobs = blobs
    msg = spawned("work")
    async with StageHarness(create_stage(d), blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        await stage.deliver(RUN_COMMANDS, rewind_of(msg, at, branch), TENANT)
        ((_, why),) = await stage.dead_letters()
        assert reason in why
        assert await store.read(key_of(msg, 1)) == []


async def test_rewinding_an_unknown_run_is_refused(store: EventLog, tmp_path: Path) -> None:
    blobs = FsBlobStore(tmp_path / "blobs")
    d = deps(dict(BUILTIN_TOOLS, work=echo_tool()))
    d.blobs = blobs
    async with StageHarness(create_stage(d), blobs, tmp_path / "w", log=store) as stage:
        await stage.deliver(RUN_COMMANDS, rewind_of(spawned("work"), 0), TENANT)
        ((_, why),) = await stage.dead_letters()
        assert "no run" in why


def echo_tool() -> Tool:
    async def work(call: ToolCall) -> str:
        return "ok"

    return Tool("work", work, Pure(), "work")


async def test_a_run_that_is_being_driven_is_not_rewound(store: EventLog, tmp_path: Path) -> None:
    started = asyncio.Event()

    async def slow(call: ToolCall) -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    blobs = FsBlobStore(tmp_path / "blobs")
    driving = deps(dict(BUILTIN_TOOLS, work=Tool("work", slow, Pure(), "slow")), "worker-a")
    other = deps(dict(BUILTIN_TOOLS, work=echo_tool()), "worker-b")
    driving.blobs = other.blobs = blobs
    msg = spawned("work")
    async with (
        StageHarness(create_stage(driving), blobs, tmp_path / "a", log=store) as a,
        StageHarness(create_stage(other), blobs, tmp_path / "b", log=store) as b,
    ):
        running = asyncio.create_task(a.deliver(RUNS, msg, TENANT, idem="m"))
        await started.wait()
        await b.deliver(RUN_COMMANDS, rewind_of(msg, 1), TENANT)
        ((_, why),) = await b.dead_letters()
        assert "being driven" in why
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


# -- one worker's own runs: what a second command for a run must not do -----------------------


@dataclass
class Gated:
    """The `work` tool: calls numbered in `hang` wait for `release` (or to be cancelled)."""

    hang: set[int]
    release: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0

    async def call(self, call: ToolCall) -> str:
        self.calls += 1
        n = self.calls
        if n in self.hang:
            self.waiting.set()
            await self.release.wait()
        return f"call {n}"

    def tool(self) -> Tool:
        return Tool("work", self.call, Pure(), "answers when the test says")


def stage_of(gate: Gated, tmp_path: Path, store: EventLog, worker: str = "w") -> StageHarness:
    d = deps(dict(BUILTIN_TOOLS, work=gate.tool()), worker)
    d.blobs = FsBlobStore(tmp_path / "blobs")
    return StageHarness(create_stage(d), d.blobs, tmp_path / worker, log=store)


def events_of(records: list[LogRecord]) -> list[str]:
    return [r.event.type for r in records]


async def test_a_worker_does_not_rewind_a_run_it_is_driving(
    store: EventLog, tmp_path: Path
) -> None:
    gate = Gated(hang={1})
    msg = spawned("work")
    async with stage_of(gate, tmp_path, store) as stage:
        running = asyncio.create_task(stage.deliver(RUNS, msg, TENANT, idem="m"))
        await gate.waiting.wait()
        # Its lease is this worker's own: claiming it again must not take the run over.
        await asyncio.wait_for(stage.deliver(RUN_COMMANDS, rewind_of(msg, 1), TENANT), 5)
        ((_, why),) = await stage.dead_letters()
        assert "being driven" in why
        gate.release.set()
        await asyncio.wait_for(running, 5)
        assert stage.runner is not None
        assert stage.runner.abandoned == 0  # the drive kept its lease and ended the run
        assert [k.branch for k in await store.branches(msg.run.run_id, TENANT)] == [0]
        assert len([m for m in await stage.emitted() if isinstance(m, RunExecuted)]) == 1


async def test_a_stray_signal_leaves_a_run_this_worker_drives_alone(
    store: EventLog, tmp_path: Path
) -> None:
    gate = Gated(hang={1})
    msg = spawned("work")
    signal = SignalRun(tenant=TENANT, run_id=msg.run.run_id, signal="approval")
    async with stage_of(gate, tmp_path, store) as stage:
        running = asyncio.create_task(stage.deliver(RUNS, msg, TENANT, idem="m"))
        await gate.waiting.wait()
        await asyncio.wait_for(stage.deliver(RUN_COMMANDS, signal, TENANT), 5)
        ((_, why),) = await stage.dead_letters()
        assert "not waiting" in why
        gate.release.set()
        await asyncio.wait_for(running, 5)
        assert stage.runner is not None
        assert stage.runner.abandoned == 0
        finished = [r.event for r in await store.read(key_of(msg, 0))]
        closed = [(f.step, f.attempt) for f in finished if isinstance(f, AttemptFinished)]
        assert closed == [("work", 1), ("tidy", 1)]  # closed once, by the drive that called
        assert gate.calls == 1


async def test_a_cancelled_run_can_be_rewound_and_its_fork_runs(
    store: EventLog, tmp_path: Path
) -> None:
    gate = Gated(hang={1})
    msg = spawned("work")
    async with stage_of(gate, tmp_path, store) as stage:
        running = asyncio.create_task(stage.deliver(RUNS, msg, TENANT, idem="m"))
        await gate.waiting.wait()
        await stage.deliver(RUN_COMMANDS, cancel_of(msg), TENANT)  # "cancel it first"
        await asyncio.wait_for(running, 5)
        await stage.deliver(RUN_COMMANDS, rewind_of(msg, 1), TENANT)
        fork = await store.read(key_of(msg, 1))
        # The cancel stopped what ran when it was asked for, not the fork made after it.
        assert events_of(fork)[-1] == "RunFinished"
        outputs = [r.event.output for r in fork if isinstance(r.event, AttemptFinished)]
        assert outputs == ["call 2", "ok"]  # the fork ran the step again, to its end
        results = [m for m in await stage.emitted() if isinstance(m, RunResult)]
        assert [r.status for r in results] == ["cancelled"]  # the task's one result stands


async def test_a_fork_of_a_fork_redelivered_after_a_crash_finishes_its_own_branch(
    store: EventLog, tmp_path: Path
) -> None:
    gate = Gated(hang={3})
    msg = spawned("work")
    async with stage_of(gate, tmp_path, store, "worker-a") as a:
        await a.deliver(RUNS, msg, TENANT)
        await a.deliver(RUN_COMMANDS, rewind_of(msg, 2), TENANT)  # branch 1 forks at 2
        assert events_of(await store.read(key_of(msg, 1)))[2] == "Forked"
        # Branch 2 forks branch 1 past its fork point, so it begins with a copy of
        # branch 1's Forked; its worker dies in the middle of driving it.
        second = asyncio.create_task(a.deliver(RUN_COMMANDS, rewind_of(msg, 4), TENANT, idem="r2"))
        await gate.waiting.wait()
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
    gate.hang.clear()
    async with stage_of(gate, tmp_path, store, "worker-b") as b:
        await asyncio.wait_for(b.deliver(RUN_COMMANDS, rewind_of(msg, 4), TENANT, idem="r2"), 10)
        assert await b.dead_letters() == []
        assert [k.branch for k in await store.branches(msg.run.run_id, TENANT)] == [0, 1, 2]
        fork = await store.read(key_of(msg, 2))
        assert events_of(fork).count("Forked") == 2
        assert events_of(fork)[-1] == "RunFinished"  # the command drove its own fork on
