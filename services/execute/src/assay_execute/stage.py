"""Execute: `assay.runs`, `assay.run-commands` -> `assay.episodes`, `assay.run-status`,
`assay.usage` (and `assay.results` for a cancelled run).

Each run is driven by the library's durable driver under the run's lease:
every attempt start and finish is its own fenced commit, so a crash resumes the
run from its log. When every step is terminal the episode is frozen into a
content-addressed blob (the snapshot barrier of §10.2) and handed to
verification. A `CancelRun` stops a run wherever it is driven.
"""

from __future__ import annotations

from assay.bus.topics import EPISODES, RESULTS, RUN_COMMANDS, RUN_STATUS, RUNS
from assay.engine import (
    WORK_EVENTS,
    CancelScope,
    Driver,
    RunFinished,
    RunSpec,
    StepNotExecutable,
    check_executable,
    fold_work,
)
from assay.engine.events import CancelRequested, RunCancelled, commands_stream
from assay.kernel import (
    AttemptState,
    BranchId,
    Refused,
    RunId,
    RunState,
    TenantId,
    run_transition,
)
from assay.messages import (
    CancelRun,
    Episode,
    RunExecuted,
    RunResult,
    RunSpawned,
    RunStatusChanged,
)
from assay.record import BranchKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.runtime.leases import acquire, under_lease
from assay.workflow import WorkflowInvalid, from_document, validate
from assay_execute.retention import Retention


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the execute stage."""
    driver = Driver(deps.model, deps.tools, deps.sandbox)
    active: dict[tuple[TenantId, RunId], CancelScope] = {}
    """Runs this process is driving now, so that a cancel reaches them at once."""
    ttl = deps.lease_ttl_s
    known_tools = frozenset(deps.tools)

    async def on_run_spawned(msg: RunSpawned, uow: UnitOfWork) -> None:
        try:
            wf = validate(from_document(msg.definition), known_tools, deps.verifier_kinds)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable) as exc:
            raise Refused(f"run {msg.run.run_id}: invalid pinned workflow: {exc}") from exc
        if wf.version != msg.run.workflow_version:
            raise Refused(
                f"run {msg.run.run_id}: definition hashes to {wf.version}, "
                f"not the pinned {msg.run.workflow_version}"
            )
        spec = RunSpec(ref=msg.run, definition=wf, input=msg.input, branch=BranchId(0))
        # One worker at a time drives a run: its lease fences every commit below.
        lease = await acquire(uow.log, uow.tenant, msg.run.run_id, deps.worker, ttl)
        uow.fence = lease
        history = await uow.history(spec.key)
        if any(isinstance(r.event, RunFinished | RunCancelled) for r in history):
            return  # ended by a worker whose message commit raced this delivery
        if not history:
            uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.RUNNING))
        scope = CancelScope()
        active[(uow.tenant, msg.run.run_id)] = scope

        async def watch() -> None:  # a cancel handled by another worker reaches this one
            requested = await uow.get("cancel", msg.run.run_id)
            if requested is not None:
                scope.cancel(str(requested["reason"]))

        try:
            await watch()
            episode = await under_lease(
                uow.log, lease, ttl, driver.drive(spec, uow, scope), watch=watch
            )
        finally:
            active.pop((uow.tenant, msg.run.run_id), None)
        if scope.cancelled:
            _cancelled(msg, uow, spec, episode, scope.reason)
            return
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
        uow.emit(
            EPISODES,
            RunExecuted(
                run=msg.run,
                episode=ref,
                succeeded=episode.succeeded,
                failed_step=episode.failed_step,
                usage=episode.usage,
            ),
        )
        uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.VERIFYING))

    async def on_cancel(msg: CancelRun, uow: UnitOfWork) -> None:
        reason = msg.reason or "cancelled by an operator"
        uow.record(
            BranchKey.main(uow.tenant, commands_stream(msg.run_id)),
            CancelRequested(reason=reason),
        )
        scope = active.get((uow.tenant, msg.run_id))
        if scope is not None:  # driven here: stop it at once
            scope.cancel(reason)

    return StageSpec(
        name="execute",
        events=WORK_EVENTS,
        fold=fold_work,
        handlers={
            RUNS: {RunSpawned.type: on_run_spawned},
            RUN_COMMANDS: {CancelRun.type: on_cancel},
            RESULTS: {RunResult.type: Retention(deps.retention).on_result},
        },
    )


def _cancelled(
    msg: RunSpawned, uow: UnitOfWork, spec: RunSpec, episode: Episode, reason: str
) -> None:
    """Record a stopped run and give its task its one result (§5.1, §5.2)."""
    unknown = any(a.state is AttemptState.INDETERMINATE for a in episode.attempts)
    run_transition(RunState.RUNNING, RunState.CANCELLED)
    uow.record(spec.key, RunCancelled(reason=reason, indeterminate=unknown, usage=episode.usage))
    detail = f"{reason}; an intent was dispatched and is unresolved" if unknown else reason
    uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.CANCELLED, detail=detail))
    uow.emit(
        RESULTS,
        RunResult(
            tenant=msg.run.tenant,
            run_id=msg.run.run_id,
            task_id=msg.run.task_id,
            idempotency_key=msg.run.idempotency_key,
            workflow_id=msg.run.workflow_id,
            workflow_version=msg.run.workflow_version,
            status="cancelled",
            passed=False,
            verification=[],
            score=None,
            usage=episode.usage,
            termination="cancelled",
        ),
    )
