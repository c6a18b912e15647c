"""Execute: `assay.runs`, `assay.run-commands` -> `assay.episodes`, `assay.run-status`,
`assay.usage` (and `assay.results` for a cancelled run).

Each run is driven by the library's durable driver under the run's lease (`driving`):
every attempt start and finish is its own fenced commit, so a crash resumes the
run from its log. When every step is terminal the episode is frozen into a
content-addressed blob (the snapshot barrier of §10.2) and handed to
verification. A `CancelRun` stops a run wherever it is driven; a `RewindRun`
forks an ended run onto a new branch (`forks`); a `BranchRun` forks children
with deltas from a stage boundary and records their lineage (`branching`); a
`RunResult` lets retention reduce and tier the run (`retention`). One handler per
message type, routed by its annotation; `create_stage` only wires them.
"""

from __future__ import annotations

from typing import Any

from assay.bus.topics import RUN_COMMANDS, RUN_STATUS
from assay.crash import crash_point
from assay.engine import WORK_EVENTS, Driver, RunFinished, RunSpec, fold_work, prices_of
from assay.engine.events import (
    BranchVerified,
    CancelRequested,
    RunCancelled,
    RunStarted,
    Signalled,
    commands_stream,
)
from assay.engine.run_state import BranchVerdict, GradingStatus, RunView, Waiting
from assay.engine.suspension import Suspension
from assay.kernel import BranchId, Refused, RunId, RunState, TenantId
from assay.messages import (
    CancelGrading,
    CancelRun,
    RewindRun,
    RolloutResult,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    SignalRun,
)
from assay.record import BranchKey
from assay.runtime import StageDeps, StageSpec, routes
from assay.runtime.leases import acquire
from assay.runtime.timers import Fired, timer
from assay.sandbox.port import ResidentSandboxes
from assay.store import Lease
from assay_execute.branching import on_branch
from assay_execute.driving import (
    ExecuteUnitOfWork,
    Executing,
    branch_ref,
    conclude,
    graded,
    pinned,
    recorded,
    reported,
)
from assay_execute.forks import forks_of, new_rewind, refuse_if_driven, run_ended
from assay_execute.publication import settle_staged_effects
from assay_execute.queries import QUERIES
from assay_execute.retention import Retention, backlog_gauges


async def on_run_spawned(msg: RunSpawned, uow: ExecuteUnitOfWork) -> None:
    """Claim the run's lease and drive it to its end, a wait, or a cancel."""
    deps = uow.deps
    spec = pinned(deps, msg.run, msg.definition, msg.input, msg.subworkflows, BranchId(0))
    # One worker at a time drives a run: its lease fences every commit below.
    lease = await acquire(uow.log, uow.tenant, msg.run.run_id, deps.worker, deps.ttl_s)
    crash_point("execute.after_claim")  # dying here, the lease must lapse to free the run
    uow = uow.fenced(lease)
    history = await uow.history(spec.key)
    if any(isinstance(r.event, RunFinished | RunCancelled) for r in history):
        return  # ended by a worker whose message commit raced this delivery
    if await uow.get(Waiting, msg.run.run_id) is not None:
        return  # suspended: a signal, a cancel or its deadline moves it on
    if not history:
        uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.RUNNING))
    # A new run: what was just read under the lease is all there is to replay.
    await conclude(spec, uow, lease, fresh=not history)


async def on_signal(msg: SignalRun, uow: ExecuteUnitOfWork) -> None:
    """Resume a run suspended at an await step: approval, a signal, or its deadline."""
    waiting = await uow.get(Waiting, msg.run_id)
    now_ms = uow.deps.driver.clock() * 1000
    if waiting is None or (msg.timed_out and waiting.deadline_ms > now_ms):
        await _not_waiting(msg, uow)
        return
    if not msg.timed_out and waiting.signal != msg.signal:
        raise Refused(f"run {msg.run_id} waits for {waiting.signal!r}, not {msg.signal!r}")
    found = await resumed(uow, msg.run_id)
    if found is None:
        return
    spec, lease = found
    uow = uow.fenced(lease)
    # `Running` commits with the `Signalled` that resumes the run: a redelivery after a
    # crash finds the run resumed and only drives it on (the next step may be Pure, whose
    # first commit comes only after its call).
    async with uow.step():
        signalled = Signalled(
            step=waiting.step,
            iteration=waiting.iteration,
            signal=waiting.signal,
            payload=msg.payload,
            timed_out=msg.timed_out,
        )
        uow.record(spec.key, signalled)
        if graded(spec):
            why = "its wait timed out" if msg.timed_out else f"signal {msg.signal!r}"
            ref = await reported(uow, spec)
            resumed_ = RunStatusChanged(run=ref, state=RunState.RUNNING, detail=f"resumed: {why}")
            uow.emit(RUN_STATUS, resumed_)
    await conclude(spec, uow, lease)


async def _not_waiting(msg: SignalRun, uow: ExecuteUnitOfWork) -> None:
    """A signal for a run that waits for none (a timeout: not yet). A timer's is dropped;
    one redelivered after its `Signalled` was recorded finishes the run.

    Raises:
        Refused: the run is not waiting for a signal.
    """
    if msg.timed_out:
        return  # a timer for a wait that already ended (or not due): nothing to do
    driven_here = (uow.tenant, msg.run_id) in uow.deps.active  # its lease is ours: keep it
    if (
        not driven_here
        and await uow.log.branches(msg.run_id, uow.tenant)
        and not await run_ended(uow, msg.run_id)
    ):
        await redrive(uow, msg.run_id)  # redelivered after its Signalled was recorded
        return
    raise Refused(f"run {msg.run_id} is not waiting for a signal")


async def on_cancel(msg: CancelRun, uow: ExecuteUnitOfWork) -> None:
    """Stop a run: at once if driven here, at its driver's next look if driven elsewhere,
    and here if it is suspended (no worker holds it)."""
    reason = msg.reason or "cancelled by an operator"
    key = BranchKey.main(uow.tenant, commands_stream(msg.run_id))
    scope = uow.deps.active.get((uow.tenant, msg.run_id))
    if scope is not None:  # driven here: stop it at once
        uow.record(key, CancelRequested(reason=reason))
        scope.cancel(reason)
        return
    async with uow.step():  # the request is recorded before a suspended run is stopped
        uow.record(key, CancelRequested(reason=reason))
    found = await resumed(uow, msg.run_id)
    if found is not None:  # suspended: no worker holds it, so end it here
        spec, lease = found
        await conclude(spec, uow.fenced(lease), lease)
    await stop_grading(uow, msg.run_id, reason)


async def stop_grading(uow: ExecuteUnitOfWork, run: RunId, reason: str) -> None:
    """Cancel means stop (§5.2): each branch of the run that finished executing and whose
    grading has not ended is stopped at verify and tournament (`CancelGrading`), which
    make no further verifier command or judge call for it and give it its `cancelled`
    result. A branch whose result came back is left as it is: its record stands."""
    doc = await uow.get(RunView, run)
    if doc is None or doc.tiered:
        return
    for key in await uow.log.branches(run, uow.tenant):
        records = await uow.history(key)
        end = next((r.event for r in records if isinstance(r.event, RunFinished)), None)
        started = records[0].event if records else None
        if end is None or not isinstance(started, RunStarted) or started.run.rollout:
            continue  # not finished (or a rollout sibling: its group's cancel stops it)
        if key.branch == doc.branch and doc.grading is not None:
            continue
        if await uow.get(BranchVerdict, f"{run}/{key.branch}") is not None:
            continue
        stop = CancelGrading(
            run=branch_ref(started.run, key.branch, records),
            reason=reason,
            succeeded=end.succeeded,
            usage=end.usage,
        )
        uow.emit(RUN_COMMANDS, stop)


async def on_rewind(msg: RewindRun, uow: ExecuteUnitOfWork) -> None:
    """Fork the run at `at` onto a new branch and drive the new branch (§8.5)."""
    mine = await forks_of(uow, msg.run_id)
    if not mine:
        await refuse_if_driven(uow, msg.run_id, "rewinding")
    # An ended run's last worker may hold its lease a while longer: wait it out.
    lease = await acquire(uow.log, uow.tenant, msg.run_id, uow.deps.worker, uow.deps.ttl_s)
    uow = uow.fenced(lease)
    if mine:  # redelivered after a crash: finish what this command began
        branch, done = mine[-1].branch, mine[-1].ended
    else:
        branch, done = await new_rewind(uow, msg), False
    if done:
        return  # a redelivered command whose fork already ran to its end
    spec = await recorded(uow, BranchKey.for_run(uow.tenant, msg.run_id, branch))
    await conclude(spec, uow, lease)


async def on_result(msg: RunResult, uow: ExecuteUnitOfWork) -> None:
    """Grading of a branch ended. A forked run notes the branch's verifier outcome beside
    it; once the live branch's result is in, the run is reduced if it is over its
    tenant's ceiling (a superseded branch's result ends nothing); then the tenant's
    runs that are due are tiered (§8.6, `retention`)."""
    doc = await uow.get(RunView, msg.run_id)
    live = 0 if doc is None else doc.branch
    if doc is not None and not doc.tiered and live > 0:
        at = f"{msg.run_id}/{msg.branch}"
        if await uow.get(BranchVerdict, at) is None:
            verdict = BranchVerified(
                branch=msg.branch,
                status=msg.status,
                passed=msg.passed,
                failed_checks=[v.verifier for v in msg.verification if not v.passed],
            )
            uow.record(BranchKey.main(uow.tenant, commands_stream(msg.run_id)), verdict)
    if msg.superseded_by is None and msg.branch == live:
        await uow.deps.retention.grading_ended(uow, msg.run_id, msg.status)
    await uow.deps.retention.sweep(uow)


async def on_rollout_result(msg: RolloutResult, uow: ExecuteUnitOfWork) -> None:
    """Grading of every sibling of a rollout group ended with its selection (§13): the
    winner's staged effects are published and the others' discarded (`publication`),
    before retention may reduce or tier any sibling."""
    await settle_staged_effects(msg, uow)
    for sibling in msg.siblings:
        status: GradingStatus = "cancelled" if sibling.ended == "cancelled" else "graded"
        await uow.deps.retention.grading_ended(uow, sibling.run_id, status)
    await uow.deps.retention.sweep(uow)


async def resumed(uow: ExecuteUnitOfWork, run: RunId) -> tuple[RunSpec, Lease] | None:
    """Take the lease of a suspended run and build its spec from its log; None if it is
    not suspended (any more)."""
    if await uow.get(Waiting, run) is None:
        return None
    lease = await acquire(uow.log, uow.tenant, run, uow.deps.worker, uow.deps.ttl_s)
    uow = uow.fenced(lease)
    waiting = await uow.get(Waiting, run)  # again, under the lease
    if waiting is None:
        return None
    key = BranchKey.for_run(uow.tenant, run, BranchId(waiting.branch))
    return await recorded(uow, key), lease


async def redrive(uow: ExecuteUnitOfWork, run: RunId) -> None:
    """Finish a run whose resumption a crash interrupted (once its lease is free)."""
    lease = await acquire(uow.log, uow.tenant, run, uow.deps.worker, uow.deps.ttl_s)
    uow = uow.fenced(lease)
    if await run_ended(uow, run) or await uow.get(Waiting, run) is not None:
        return
    keys = await uow.log.branches(run, uow.tenant)
    spec = await recorded(uow, max(keys, key=lambda k: k.branch))
    await conclude(spec, uow, lease)


def wait_due(tenant: TenantId, run: str, doc: dict[str, Any], now_ms: float) -> Fired | None:
    """A wait whose deadline passed sends its timeout signal."""
    waiting = Waiting.model_validate(doc)
    if waiting.deadline_ms > now_ms:
        return None
    signal = SignalRun(tenant=tenant, run_id=RunId(run), signal=waiting.signal, timed_out=True)
    where = f"{waiting.branch}/{waiting.step}/{waiting.iteration}"
    return RUN_COMMANDS, signal, f"timeout:{run}:{where}"


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the execute stage: its handlers, what they share, and the await timer."""
    checkpoint_every = deps.checkpoint_every or None
    suspension = suspension_of(deps)
    driver = Driver(
        deps.model,
        deps.tools,
        deps.sandbox,
        checkpoint_every=checkpoint_every,
        suspension=suspension,
    )
    executing = Executing(
        driver=driver,
        worker=deps.worker,
        ttl_s=deps.lease_ttl_s,
        known_tools=frozenset(deps.tools),
        known_verifiers=deps.verifier_kinds,
        retention=Retention(deps.retention),
        prices=prices_of(deps.model),
        episode_inline_max_bytes=deps.episode_inline_max_bytes,
    )
    return StageSpec(
        name="execute",
        events=WORK_EVENTS,
        fold=fold_work,
        handlers=routes(
            on_run_spawned,
            on_signal,
            on_cancel,
            on_rewind,
            on_branch,
            on_result,
            on_rollout_result,
        ),
        deps=executing,
        background=(timer(Waiting.kind, wait_due, executing.driver.clock),),
        gauges=backlog_gauges,
        metrics=() if suspension is None else (suspension.metrics.registry,),
        queries=QUERIES,
        sandbox=deps.sandbox,
    )


def suspension_of(deps: StageDeps) -> Suspension | None:
    """The suspension controller `deps.suspend` asks for; None when it is off.

    Raises:
        Refused: suspension is on but the sandbox keeps no resident sandboxes.
    """
    if deps.suspend is None:
        return None
    if not isinstance(deps.sandbox, ResidentSandboxes):
        raise Refused(
            "ASSAY_SANDBOX_SUSPEND_IDLE_AFTER_S is set, but no sandbox here can keep "
            "a resident sandbox (is the sandbox available?)"
        )
    return Suspension(deps.sandbox, deps.suspend)
