"""Execute: `assay.runs`, `assay.run-commands` -> `assay.episodes`, `assay.run-status`,
`assay.usage` (and `assay.results` for a cancelled run).

Each run is driven by the library's durable driver under the run's lease:
every attempt start and finish is its own fenced commit, so a crash resumes the
run from its log. When every step is terminal the episode is frozen into a
content-addressed blob (the snapshot barrier of §10.2) and handed to
verification. A `CancelRun` stops a run wherever it is driven; a `RewindRun`
forks an ended run onto a new branch (`forks`); a `BranchRun` forks children
with deltas from a stage boundary and records their lineage (`branching`).
"""

from __future__ import annotations

from typing import Any

from assay.bus.topics import (
    EPISODES,
    RESULTS,
    RUN_COMMANDS,
    RUN_STATUS,
    RUNS,
    TASKS,
)
from assay.crash import crash_point
from assay.engine import (
    WORK_EVENTS,
    CancelScope,
    Driver,
    RunFinished,
    RunSpec,
    RunSuspended,
    StepNotExecutable,
    check_executable,
    fold_work,
    prices_of,
)
from assay.engine.events import (
    CancelRequested,
    RunCancelled,
    RunStarted,
    Signalled,
    commands_stream,
)
from assay.kernel import (
    AttemptState,
    BranchId,
    Refused,
    RunId,
    RunState,
    StepId,
    TenantId,
    run_transition,
)
from assay.messages import (
    BranchRun,
    CancelRun,
    Episode,
    RewindRun,
    RolloutProgress,
    RolloutResult,
    RunExecuted,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    SignalRun,
)
from assay.record import BranchKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.runtime.leases import acquire, under_lease
from assay.runtime.timers import Fired, timer
from assay.store import Lease
from assay.workflow import LATEST, WorkflowInvalid, from_document, validate
from assay_execute.branching import Brancher
from assay_execute.forks import forks_of, new_rewind, refuse_if_driven, run_ended
from assay_execute.retention import Retention

"""How often the execute stage looks for waits whose deadline passed."""


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the execute stage."""
    driver = Driver(
        deps.model, deps.tools, deps.sandbox, checkpoint_every=deps.checkpoint_every or None
    )
    active: dict[tuple[TenantId, RunId], CancelScope] = {}
    """Runs this process is driving now, so that a cancel reaches them at once."""
    ttl = deps.lease_ttl_s
    known_tools = frozenset(deps.tools)
    retention = Retention(deps.retention)
    prices = prices_of(deps.model)  # a run's cost is its tokens at the agent model's prices

    def pinned(
        ref: RunRef,
        definition: dict[str, Any],
        input_: dict[str, Any],
        children: dict[str, dict[str, Any]],
        branch: BranchId,
    ) -> RunSpec:
        """The run as spawned: its definition and sub-workflows checked against the pins."""
        try:
            wf = validate(from_document(definition), known_tools, deps.verifier_kinds)
            calls = {
                key: validate(from_document(doc), known_tools, deps.verifier_kinds)
                for key, doc in children.items()
            }
            check_executable(wf, calls)
        except (WorkflowInvalid, StepNotExecutable) as exc:
            raise Refused(f"run {ref.run_id}: invalid pinned workflow: {exc}") from exc
        if wf.version != ref.workflow_version:
            raise Refused(
                f"run {ref.run_id}: definition hashes to {wf.version}, "
                f"not the pinned {ref.workflow_version}"
            )
        for key, child in calls.items():
            selector = key.rpartition("@")[2]
            if selector not in (LATEST, child.version):
                raise Refused(f"run {ref.run_id}: sub-workflow {key} hashes to {child.version}")
        return RunSpec(ref, wf, input_, branch, children=calls)

    async def drive(
        spec: RunSpec, uow: UnitOfWork[Any], lease: Lease, *, fresh: bool = False
    ) -> tuple[Episode, CancelScope]:
        """Drive the run's branch under its lease, stoppable by a cancel from anywhere;
        `fresh`: the branch was read empty under this lease (see `Driver.drive`)."""
        run = spec.ref.run_id
        scope = CancelScope()
        active[(uow.tenant, run)] = scope

        async def watch() -> None:  # a cancel handled by another worker reaches this one
            requested = await uow.get_document("cancel", run)
            if requested is not None:
                scope.cancel(str(requested["reason"]))

        try:
            await watch()
            episode = await under_lease(
                uow.log, lease, ttl, driver.drive(spec, uow, scope, fresh=fresh), watch=watch
            )
        finally:
            active.pop((uow.tenant, run), None)
        return episode, scope

    async def conclude(
        spec: RunSpec, uow: UnitOfWork[Any], lease: Lease, *, graded: bool, fresh: bool = False
    ) -> None:
        """Drive the branch, then record how it stopped: suspended at an await (the
        lease is given up), cancelled, or ended — handed to verification when the
        branch is the one the submission is graded by."""
        ref = spec.ref
        try:
            episode, scope = await drive(spec, uow, lease, fresh=fresh)
        except RunSuspended as waiting:
            uow = uow.released()  # what remains to commit is the message's own bookkeeping
            await uow.log.release(lease)  # a suspended run holds no lease (§9.4)
            at = waiting.suspended
            detail = f"waiting at {at.step!r} for {at.signal!r}"
            if graded:  # §5.2 is the graded branch's lifecycle: a fork's wait is not in it
                uow.emit(
                    RUN_STATUS, RunStatusChanged(run=ref, state=RunState.SUSPENDED, detail=detail)
                )
            return
        if scope.cancelled:
            if graded:
                cost = prices.cost(episode.usage.prompt_tokens, episode.usage.completion_tokens)
                _cancelled(ref, uow, spec, episode, scope.reason, cost)
            else:
                uow.record(
                    spec.key,
                    RunCancelled(
                        reason=scope.reason, indeterminate=_unknown(episode), usage=episode.usage
                    ),
                )
            return
        blob = await _finished(uow, spec, episode)
        retention.froze(uow.tenant, blob, episode)
        if not graded:
            return
        uow.emit(
            EPISODES,
            RunExecuted(
                run=ref,
                episode=blob,
                succeeded=episode.succeeded,
                failed_step=episode.failed_step,
                usage=episode.usage,
                cost_usd=prices.cost(episode.usage.prompt_tokens, episode.usage.completion_tokens),
            ),
        )
        uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.VERIFYING))

    async def conclude_child(spec: RunSpec, uow: UnitOfWork[Any], lease: Lease) -> None:
        await conclude(spec, uow, lease, graded=False)  # a branch child is never graded

    def pin(started: RunStarted, branch: BranchId) -> RunSpec:
        if started.definition is None or started.input is None:
            raise Refused(
                f"run {started.run.run_id} was recorded before runs kept their definition"
            )
        return pinned(started.run, started.definition, started.input, started.subworkflows, branch)

    brancher = Brancher(
        worker=deps.worker,
        ttl_s=ttl,
        known_tools=known_tools,
        known_verifiers=deps.verifier_kinds,
        pin=pin,
        conclude=conclude_child,
    )

    async def on_run_spawned(msg: RunSpawned, uow: UnitOfWork[Any]) -> None:
        spec = pinned(msg.run, msg.definition, msg.input, msg.subworkflows, BranchId(0))
        # One worker at a time drives a run: its lease fences every commit below.
        lease = await acquire(uow.log, uow.tenant, msg.run.run_id, deps.worker, ttl)
        crash_point("execute.after_claim")  # dying here, the lease must lapse to free the run
        uow = uow.fenced(lease)
        history = await uow.history(spec.key)
        if any(isinstance(r.event, RunFinished | RunCancelled) for r in history):
            return  # ended by a worker whose message commit raced this delivery
        if await uow.get_document("await", msg.run.run_id) is not None:
            return  # suspended: a signal, a cancel or its deadline moves it on
        if not history:
            uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.RUNNING))
        # A new run: what was just read under the lease is all there is to replay.
        await conclude(spec, uow, lease, graded=True, fresh=not history)

    async def resumed(uow: UnitOfWork[Any], run: RunId) -> tuple[RunSpec, Lease] | None:
        """Take the lease of a suspended run and build its spec from its log; None if
        it is not suspended (any more)."""
        if await uow.get_document("await", run) is None:
            return None
        lease = await acquire(uow.log, uow.tenant, run, deps.worker, ttl)
        uow = uow.fenced(lease)
        waiting = await uow.get_document("await", run)  # again, under the lease
        if waiting is None:
            return None
        key = BranchKey.for_run(uow.tenant, run, BranchId(int(waiting["branch"])))
        return await recorded(uow, key), lease

    async def redrive(uow: UnitOfWork[Any], run: RunId) -> None:
        """Finish a run whose resumption a crash interrupted (once its lease is free)."""
        lease = await acquire(uow.log, uow.tenant, run, deps.worker, ttl)
        uow = uow.fenced(lease)
        if await run_ended(uow, run) or await uow.get_document("await", run) is not None:
            return
        keys = await uow.log.branches(run, uow.tenant)
        spec = await recorded(uow, max(keys, key=lambda k: k.branch))
        await conclude(spec, uow, lease, graded=spec.branch == 0)

    async def recorded(uow: UnitOfWork[Any], key: BranchKey) -> RunSpec:
        """A branch's run, as its first record (`RunStarted` v2) pinned it, with the
        deltas its `Forked` records carry (a branch command's child, or a fork of one)."""
        return await brancher.spec(uow, key)

    async def on_signal(msg: SignalRun, uow: UnitOfWork[Any]) -> None:
        """Resume a run suspended at an await step: approval, a signal, or its deadline."""
        waiting = await uow.get_document("await", msg.run_id)
        if waiting is None or (msg.timed_out and waiting["deadline_ms"] > driver.clock() * 1000):
            if msg.timed_out:
                return  # a timer for a wait that already ended (or not due): nothing to do
            driven_here = (uow.tenant, msg.run_id) in active  # its lease is ours: never re-claim it
            if (
                not driven_here
                and await uow.log.branches(msg.run_id, uow.tenant)
                and not await run_ended(uow, msg.run_id)
            ):
                await redrive(uow, msg.run_id)  # redelivered after its Signalled was recorded
                return
            raise Refused(f"run {msg.run_id} is not waiting for a signal")
        if not msg.timed_out and waiting["signal"] != msg.signal:
            raise Refused(f"run {msg.run_id} waits for {waiting['signal']!r}, not {msg.signal!r}")
        found = await resumed(uow, msg.run_id)
        if found is None:
            return
        spec, lease = found
        uow = uow.fenced(lease)
        step = StepId(str(waiting["step"]))
        uow.record(
            spec.key,
            Signalled(
                step=step,
                iteration=int(waiting["iteration"]),
                signal=str(waiting["signal"]),
                payload=msg.payload,
                timed_out=msg.timed_out,
            ),
        )
        await uow.commit()
        why = "its wait timed out" if msg.timed_out else f"signal {msg.signal!r}"
        graded = spec.branch == 0
        if graded:
            uow.emit(
                RUN_STATUS,
                RunStatusChanged(run=spec.ref, state=RunState.RUNNING, detail=f"resumed: {why}"),
            )
        await conclude(spec, uow, lease, graded=graded)

    async def on_cancel(msg: CancelRun, uow: UnitOfWork[Any]) -> None:
        reason = msg.reason or "cancelled by an operator"
        uow.record(
            BranchKey.main(uow.tenant, commands_stream(msg.run_id)),
            CancelRequested(reason=reason),
        )
        scope = active.get((uow.tenant, msg.run_id))
        if scope is not None:  # driven here: stop it at once
            scope.cancel(reason)
            return
        await uow.commit()  # the request is recorded before a suspended run is stopped
        found = await resumed(uow, msg.run_id)
        if found is not None:  # suspended: no worker holds it, so end it here
            spec, lease = found
            uow = uow.fenced(lease)
            await conclude(spec, uow, lease, graded=spec.branch == 0)

    def wait_due(
        tenant: TenantId, run: str, waiting: dict[str, Any], now_ms: float
    ) -> Fired | None:
        """A wait whose deadline passed sends its timeout signal."""
        if waiting["deadline_ms"] > now_ms:
            return None
        signal = SignalRun(
            tenant=tenant, run_id=RunId(run), signal=str(waiting["signal"]), timed_out=True
        )
        where = f"{waiting['branch']}/{waiting['step']}/{waiting['iteration']}"
        return RUN_COMMANDS, signal, f"timeout:{run}:{where}"

    timeouts = timer("await", wait_due, driver.clock)

    async def on_rewind(msg: RewindRun, uow: UnitOfWork[Any]) -> None:
        """Fork the run at `at` onto a new branch and drive the new branch (§8.5)."""
        mine = await forks_of(uow, msg.run_id)
        if not mine:
            await refuse_if_driven(uow, msg.run_id, "rewinding")
        # An ended run's last worker may hold its lease a while longer: wait it out.
        lease = await acquire(uow.log, uow.tenant, msg.run_id, deps.worker, ttl)
        uow = uow.fenced(lease)
        if mine:  # redelivered after a crash: finish what this command began
            branch, done = mine[-1].branch, mine[-1].ended
        else:
            branch, done = await new_rewind(uow, msg), False
        if done:
            return  # a redelivered command whose fork already ran to its end
        spec = await recorded(uow, BranchKey.for_run(uow.tenant, msg.run_id, branch))
        await conclude(spec, uow, lease, graded=False)

    return StageSpec(
        name="execute",
        events=WORK_EVENTS,
        fold=fold_work,
        handlers={
            RUNS: {RunSpawned.type: on_run_spawned},
            RUN_COMMANDS: {
                CancelRun.type: on_cancel,
                RewindRun.type: on_rewind,
                BranchRun.type: brancher.on_branch,
                SignalRun.type: on_signal,
            },
            RESULTS: {
                RunResult.type: retention.on_result,
                RolloutResult.type: retention.on_rollout_result,
            },
        },
        background=(timeouts,),
    )


async def _finished(uow: UnitOfWork[Any], spec: RunSpec, episode: Episode) -> str:
    """Freeze the episode (the snapshot barrier of §10.2) and record the branch's end."""
    ref = await uow.blobs.put(uow.tenant, episode.encode())
    uow.record(
        spec.key,
        RunFinished(
            succeeded=episode.succeeded,
            failed_step=episode.failed_step,
            episode=ref,
            usage=episode.usage,
        ),
    )
    return ref


def _unknown(episode: Episode) -> bool:
    return any(a.state is AttemptState.INDETERMINATE for a in episode.attempts)


def _cancelled(
    run: RunRef, uow: UnitOfWork[Any], spec: RunSpec, episode: Episode, reason: str, cost_usd: float
) -> None:
    """Record a stopped run and give its task its one result (§5.1, §5.2); `cost_usd` is
    what its model calls cost."""
    unknown = _unknown(episode)
    run_transition(RunState.RUNNING, RunState.CANCELLED)
    uow.record(spec.key, RunCancelled(reason=reason, indeterminate=unknown, usage=episode.usage))
    detail = f"{reason}; an intent was dispatched and is unresolved" if unknown else reason
    uow.emit(RUN_STATUS, RunStatusChanged(run=run, state=RunState.CANCELLED, detail=detail))
    if run.rollout is not None:  # a sibling's end is its group's to report (§13)
        uow.emit(
            TASKS,
            RolloutProgress(
                tenant=run.tenant,
                idempotency_key=run.rollout.group,
                run_id=run.run_id,
                index=run.rollout.index,
                ended="cancelled",
                model_calls=episode.usage.model_calls,
                tokens=episode.usage.prompt_tokens + episode.usage.completion_tokens,
                cost_usd=cost_usd,
            ),
        )
        return
    uow.emit(
        RESULTS,
        RunResult(
            tenant=run.tenant,
            run_id=run.run_id,
            task_id=run.task_id,
            idempotency_key=run.idempotency_key,
            workflow_id=run.workflow_id,
            workflow_version=run.workflow_version,
            status="cancelled",
            passed=False,
            verification=[],
            score=None,
            usage=episode.usage,
            termination="cancelled",
            held_out=run.held_out,
        ),
    )
