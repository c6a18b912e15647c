"""Execute: `assay.runs` -> `assay.episodes`, `assay.run-status`, `assay.usage`.

Each run is driven by the library's durable driver: every attempt start and
finish is its own commit, so a crash resumes the run from its log. When every
step is terminal the episode is frozen into a content-addressed blob (the
snapshot barrier of §10.2) and handed to verification.
"""

from __future__ import annotations

from assay.bus.topics import EPISODES, RUN_STATUS, RUNS
from assay.crash import crash_point
from assay.engine import WORK_EVENTS, Driver, RunFinished, RunSpec, fold_work
from assay.kernel import BranchId, Refused, RunState
from assay.messages import RunExecuted, RunSpawned, RunStatusChanged
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.runtime.leases import acquire, under_lease
from assay.workflow import WorkflowInvalid, from_document, validate


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the execute stage."""
    driver = Driver(deps.model, deps.tools)
    ttl = deps.lease_ttl_s
    known_tools = frozenset(deps.tools)

    async def on_run_spawned(msg: RunSpawned, uow: UnitOfWork) -> None:
        try:
            wf = validate(from_document(msg.definition), known_tools, deps.verifier_kinds)
        except WorkflowInvalid as exc:
            raise Refused(f"run {msg.run.run_id}: invalid pinned workflow: {exc}") from exc
        if wf.version != msg.run.workflow_version:
            raise Refused(
                f"run {msg.run.run_id}: definition hashes to {wf.version}, "
                f"not the pinned {msg.run.workflow_version}"
            )
        spec = RunSpec(ref=msg.run, definition=wf, input=msg.input, branch=BranchId(0))
        # One worker at a time drives a run: its lease fences every commit below.
        lease = await acquire(uow.log, uow.tenant, msg.run.run_id, deps.worker, ttl)
        crash_point("execute.after_claim")  # dying here, the lease must lapse to free the run
        uow.fence = lease
        history = await uow.history(spec.key)
        if any(isinstance(r.event, RunFinished) for r in history):
            return  # finished by a worker whose message commit raced this delivery
        if not history:
            uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.RUNNING))
        episode = await under_lease(uow.log, lease, ttl, driver.drive(spec, uow))
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

    return StageSpec(
        name="execute",
        events=WORK_EVENTS,
        fold=fold_work,
        handlers={RUNS: {RunSpawned.type: on_run_spawned}},
    )
