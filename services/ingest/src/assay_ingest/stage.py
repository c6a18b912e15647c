"""Ingest: `assay.tasks`, `assay.workflows`, `assay.decisions` -> `assay.runs`.

Tasks are deduplicated on `(tenant, idempotency key)`, given a `TaskId` (the
hash of the input before any workflow touches it, or the producer's task key),
split into the selection or the held-out set, and routed by the latest
allocation (`routing.py`): each live challenger serves a deterministic share of
tasks (its entry in `shares`); a `shadow_rate` share is also run under the other
versions for comparison. Every draw is recorded. A workflow asking for more live
challengers than it may have (`grading.challengers`) is refused at registration.

Each shadow run reserves its worst case (its workflow's model-call budget, each
call its largest context, at the agent model's prices) against the tenant's replay
ceiling in calls, tokens and dollars (`assay.grading.replay`); one that does not fit
is cut — recorded
in `TaskAccepted.cut` and announced as `Cancelled` on `assay.run-status` — and
never spawned. The tenant's replay meter is one stream, compare-and-swapped, so
concurrent tasks never reserve the same calls twice.

Workflow versions form a DAG (§12.2): content-addressed (the version is the hash
of the IR), parent-pointered (each stored version names the versions it derives
from) and never edited (a re-registration of a stored version changes nothing)
(`versions.py`). A task with a rollout spec becomes a group (`rollouts.py`).

A workflow that declares `drift` has its tasks' mix watched at admission, against the
mix its current version was promoted under; what ingest finds goes on
`assay.workflows` for decide (`task_mix.py`).

One handler per message type, routed by its annotation; `create_stage` only
wires them. What the handlers record and what it folds to are in `state.py`.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from datetime import UTC, datetime

from assay.bus.topics import RUN_STATUS, RUNS
from assay.engine import StepNotExecutable, check_executable
from assay.engine.models import prices_of
from assay.grading.ladder import ChallengersRefused, check_challengers
from assay.grading.strategies import StrategyRefused, check_fits, profile
from assay.kernel import (
    Refused,
    RunId,
    RunState,
    TaskId,
    content_hash,
    digest,
    run_id_from,
)
from assay.messages import (
    AllocationChanged,
    Purpose,
    Role,
    Rung,
    RunRef,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
    WorkflowRegistered,
)
from assay.record import BranchKey
from assay.record.compaction import with_compaction
from assay.runtime import Gauge, StageDeps, StageSpec, routes
from assay.runtime.admission import CapacityRefused
from assay.runtime.timers import timer
from assay.store import EventLog
from assay.workflow import (
    SubworkflowStep,
    WorkflowDef,
    WorkflowInvalid,
    check_version_bump,
    from_document,
    validate,
)
from assay_ingest.capacity import admit_by_capacity, announce_refused
from assay_ingest.ingesting import Ingesting, IngestUnitOfWork
from assay_ingest.replay import (
    announce_cut,
    metered,
    replay_gauges,
)
from assay_ingest.rollouts import (
    RolloutGroup,
    admit,
    on_cancel_rollout,
    on_rollout_progress,
    rollout_due,
)
from assay_ingest.routing import Allocation, PlannedRun, Route, held_out, route
from assay_ingest.state import (
    INGEST_EVENTS,
    AcceptedTask,
    AllocationApplied,
    SpawnedRun,
    TaskAccepted,
    WorkflowStored,
    fold_ingest,
)
from assay_ingest.task_mix import (
    on_acknowledge_drift,
    on_promoted,
    sample,
    task_mix_gauges,
    watched,
)
from assay_ingest.versions import StoredDefinition, check_calls, parents_of, resolve


def task_id_for(task: TaskSubmitted) -> TaskId:
    """The producer's task key, hashed, or the hash of the canonical input."""
    if task.task_key is not None:
        return TaskId(digest(f"task-key\x1f{task.task_key}".encode()))
    return TaskId(content_hash(task.input))


async def on_task(msg: TaskSubmitted, uow: IngestUnitOfWork) -> None:
    """Admit a task once: route it by its workflow's allocation and spawn its runs (a
    rollout group's: its first siblings)."""
    if msg.tenant != uow.tenant:
        raise Refused(f"task tenant {msg.tenant} differs from the envelope's {uow.tenant}")
    if await uow.get(AcceptedTask, msg.idempotency_key) is not None:
        return  # a resubmission: the first one stands
    alloc = await uow.get(Allocation, msg.workflow_id)
    if alloc is None:
        raise Refused(f"unknown workflow {msg.workflow_id!r} for tenant {msg.tenant}")
    task_id = task_id_for(msg)
    if msg.rollout is not None:
        await admit(uow, msg, task_id, alloc)
        return
    plan = route(alloc, task_id)
    shadow = any(p.purpose is Purpose.SHADOW for p in plan.runs)
    mix = watched(alloc) is not None
    if not shadow and not mix:
        await _spawn(msg, uow, alloc, task_id, plan)
        return
    # A tenant's shadow-spawning tasks reserve replay one at a time in this process, each
    # committed before the next reads the meter, and a workflow's watched tasks take their
    # window slots one at a time: each compare-and-swap then meets only writers in other
    # processes, instead of losing, again and again, to this process's own partitions.
    async with AsyncExitStack() as held:
        if shadow:
            await held.enter_async_context(uow.deps.replay_locks[uow.tenant])
        if mix:
            await held.enter_async_context(uow.deps.mix_locks[(uow.tenant, msg.workflow_id)])
        async with uow.step():
            await _spawn(msg, uow, alloc, task_id, plan)


async def _spawn(
    msg: TaskSubmitted, uow: IngestUnitOfWork, alloc: Allocation, task_id: TaskId, plan: Route
) -> None:
    """Spawn the task's runs (its shadow runs as the replay ceiling admits) and record it."""
    split, split_draw = held_out(task_id, uow.deps.ladder.held_out_fraction)
    at_ms = int(uow.envelope.occurred_at.timestamp() * 1000)

    first = alloc.challengers[0].version if alloc.challengers else None

    def run_id_of(planned: PlannedRun) -> RunId:
        seed = f"{uow.envelope.id}:{planned.role.value}:{planned.purpose.value}"
        if planned.role is Role.CHALLENGER and planned.version != first:
            seed += f":{planned.version}"  # a later challenger's run: one per version
        return run_id_from(at_ms, seed)

    deps = uow.deps
    fits, refused = admit_by_capacity(uow, deps.admission, plan, alloc.definitions, run_id_of)
    admitted = await metered(
        uow, deps.replay, fits, alloc.definitions, run_id_of, deps.admission, deps.prices
    )
    for gone in admitted.cut:  # cut by the replay ceiling: it will make no model call
        deps.admission.release(str(gone.run_id))
    deps.admission.count_budget_cuts(len(admitted.cut), uow)
    await sample(uow, alloc, msg.input, keyed=msg.task_key is not None)
    refs = []
    for planned in admitted.plan.runs:
        ref = _run_ref(msg, alloc, task_id, admitted.plan, planned, run_id_of(planned), split)
        await _spawn_run(msg, uow, alloc, ref)
        refs.append(ref)
    uow.record(
        BranchKey.main(uow.tenant, f"task:{msg.idempotency_key}"),
        TaskAccepted(
            idempotency_key=msg.idempotency_key,
            task_id=task_id,
            workflow_id=msg.workflow_id,
            generation=alloc.generation,
            serve_draw=plan.serve_draw,
            shadow_draw=plan.shadow_draw,
            runs=[
                SpawnedRun(
                    run_id=r.run_id,
                    workflow_version=r.workflow_version,
                    role=r.role,
                    purpose=r.purpose,
                )
                for r in refs
            ],
            arm=plan.arm,
            rung=_rung(alloc, plan),
            held_out=split,
            held_out_draw=split_draw,
            cut=[*refused, *admitted.cut],
            replay_calls=admitted.reserved,
        ),
    )
    for gone in refused:  # refused at admission, never queued (§14.2)
        announce_refused(uow, msg, task_id, split, alloc.current, gone)
    for gone in admitted.cut:  # ended before it began, and said so: never a silent gap
        announce_cut(uow, gone, refs[0])


def _rung(alloc: Allocation, plan: Route) -> Rung | None:
    """The rung recorded with a task: its serving challenger's, else the first one's."""
    if plan.arm is Role.CHALLENGER:
        return alloc.rung_of(plan.runs[0].version)
    return alloc.challengers[0].rung if alloc.challengers else None


def _run_ref(
    msg: TaskSubmitted,
    alloc: Allocation,
    task_id: TaskId,
    plan: Route,
    planned: PlannedRun,
    run_id: RunId,
    held_out: bool,
) -> RunRef:
    return RunRef(
        tenant=msg.tenant,
        run_id=run_id,
        task_id=task_id,
        idempotency_key=msg.idempotency_key,
        workflow_id=msg.workflow_id,
        workflow_version=planned.version,
        role=planned.role,
        purpose=planned.purpose,
        baseline_version=alloc.current if planned.role is Role.CHALLENGER else None,
        reference_expected=plan.reference_expected(planned),
        held_out=held_out,
    )


async def _spawn_run(
    msg: TaskSubmitted, uow: IngestUnitOfWork, alloc: Allocation, ref: RunRef
) -> None:
    definition = alloc.definitions[ref.workflow_version]
    children = await resolve(uow, WorkflowDef.model_validate(definition))
    spawned = RunSpawned(run=ref, definition=definition, input=msg.input, subworkflows=children)
    uow.emit(RUNS, spawned)
    uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.SCHEDULED))


async def on_workflow(msg: WorkflowRegistered, uow: IngestUnitOfWork) -> None:
    """Store a valid new version in its workflow's version DAG (registration is
    idempotent: a stored version changes nothing)."""
    wf = _loadable(msg, uow.deps)
    if await uow.get(StoredDefinition, wf.version) is not None:
        return  # already stored
    if any(isinstance(s, SubworkflowStep) for s in wf.steps):
        await check_calls(uow, wf)
    parents = await parents_of(uow, wf, msg)
    added: list[str] = sorted(s.id for s in wf.steps)
    removed: list[str] = []
    if parents:  # the retained-ids check is against the first parent
        parent = await uow.get(StoredDefinition, parents[0])
        assert parent is not None
        try:
            diff = check_version_bump(parent.workflow, wf, rewrite=msg.rewrite)
        except WorkflowInvalid as exc:
            raise Refused(str(exc)) from exc
        added, removed = sorted(diff.added), sorted(diff.removed)
    uow.record(
        BranchKey.main(uow.tenant, f"workflow:{wf.id}"),
        WorkflowStored(
            workflow_id=wf.id,
            workflow_version=wf.version,
            parents=parents,
            definition=wf.model_dump(mode="json", by_alias=True),
            added=added,
            removed=removed,
        ),
    )


def _loadable(msg: WorkflowRegistered, deps: Ingesting) -> WorkflowDef:
    """The registered workflow, if it is valid and executable here and its grading
    strategy fits the declared capacity (§11.1).

    Raises:
        Refused: it is not, or does not.
    """
    try:
        wf = validate(from_document(msg.definition), deps.known_tools, deps.known_verifiers)
        check_executable(wf)
    except (WorkflowInvalid, StepNotExecutable) as exc:
        raise Refused(f"invalid workflow: {exc}") from exc
    grading = deps.grading
    try:
        needs = profile(
            wf.grading,
            deps.judge,
            list(wf.rubric),
            order_check=grading.order_check,
            strategies=deps.strategies,
        )
        check_fits(needs, grading)
        check_challengers(wf.grading, deps.strategies, deps.ladder)
        deps.admission.check_workflow(wf, needs)  # §14.2: resident together, never swapped
    except (StrategyRefused, ChallengersRefused, CapacityRefused) as exc:
        raise Refused(f"workflow {wf.id!r} refused: {exc}") from exc
    return wf


async def on_allocation(msg: AllocationChanged, uow: IngestUnitOfWork) -> None:
    """Route the workflow's tasks by `msg` from now on, unless a newer one applies."""
    current = await uow.get(Allocation, msg.workflow_id)
    if current is not None and current.generation >= msg.generation:
        return  # an older or repeated allocation: the newest generation wins
    if current is not None:
        await on_promoted(uow, current, Allocation.model_validate(msg.model_dump(mode="json")))
    uow.record(
        BranchKey.main(uow.tenant, f"allocation:{msg.workflow_id}"),
        AllocationApplied(allocation=msg.model_dump(mode="json")),
    )


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the ingest stage: its handlers, what they share, the rollout deadline timer
    and the replay gauges."""
    ingesting = Ingesting(
        known_tools=frozenset(deps.tools),
        known_verifiers=deps.verifier_kinds,
        judge=deps.judge,
        grading=deps.grading,
        ladder=deps.ladder,
        replay=deps.replay,
        admission=deps.admission,
        strategies=deps.strategies,
        prices=prices_of(deps.model),
    )
    return StageSpec(
        name="ingest",
        events=INGEST_EVENTS,
        fold=with_compaction(fold_ingest),
        handlers={
            **routes(
                on_task,
                on_rollout_progress,
                on_cancel_rollout,
                on_workflow,
                on_allocation,
                on_acknowledge_drift,
            ),
            **deps.admission.handlers(),  # run-status lets admitted KV go (§14.2)
        },
        deps=ingesting,
        background=(timer(RolloutGroup.kind, rollout_due, time.time),),
        gauges=lambda log: _gauges(log, deps),
    )


async def _gauges(log: EventLog, deps: StageDeps) -> list[Gauge]:
    """The replay meters, each watched workflow's task-mix PSI, and admission's refusals
    and held KV."""
    today = datetime.now(UTC).date().isoformat()
    return [
        *await replay_gauges(log, deps.replay, today),
        *await task_mix_gauges(log),
        *deps.admission.gauges(),
    ]
