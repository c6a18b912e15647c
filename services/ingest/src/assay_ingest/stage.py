"""Ingest: `assay.tasks`, `assay.workflows`, `assay.decisions` -> `assay.runs`.

Tasks are deduplicated on `(tenant, idempotency key)`, given a `TaskId` (the
hash of the input before any workflow touches it, or the producer's task key),
split into the selection or the held-out set, and routed by the latest
allocation (`routing.py`): the challenger serves a deterministic
`challenger_share` of tasks; a `shadow_rate` share is also run under the other
version for comparison. Every draw is recorded.

Each shadow run reserves its workflow's model-call budget against the tenant's
replay ceiling (`assay.grading.replay`); one that does not fit is cut — recorded
in `TaskAccepted.cut` and announced as `Cancelled` on `assay.run-status` — and
never spawned. The tenant's replay meter is one stream, compare-and-swapped, so
concurrent tasks never reserve the same calls twice.

Workflow versions form a DAG (§12.2): content-addressed (the version is the hash
of the IR), parent-pointered (each stored version names the versions it derives
from) and never edited (a re-registration of a stored version changes nothing)
(`versions.py`). A task with a rollout spec becomes a group (`rollouts.py`).

One handler per message type, routed by its annotation; `create_stage` only
wires them.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from assay.bus.topics import RUN_STATUS, RUNS
from assay.engine import StepNotExecutable, check_executable
from assay.grading.strategies import StrategyRefused, check_fits, profile
from assay.kernel import (
    Refused,
    RunId,
    RunState,
    TaskId,
    WorkflowId,
    WorkflowVersion,
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
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, ReadModel, StateDelta
from assay.runtime import StageDeps, StageSpec, routes
from assay.runtime.timers import timer
from assay.workflow import (
    SubworkflowStep,
    WorkflowDef,
    WorkflowInvalid,
    check_version_bump,
    from_document,
    validate,
)
from assay_ingest.ingesting import Ingesting, IngestUnitOfWork
from assay_ingest.replay import (
    REPLAY_EVENTS,
    CutRun,
    announce_cut,
    fold_replay,
    metered,
    replay_gauges,
)
from assay_ingest.rollouts import (
    ROLLOUT_EVENTS,
    RolloutGroup,
    admit,
    fold_rollout,
    on_cancel_rollout,
    on_rollout_progress,
    rollout_due,
)
from assay_ingest.routing import Allocation, PlannedRun, Route, held_out, route
from assay_ingest.versions import LatestVersion, StoredDefinition, check_calls, parents_of, resolve


class WorkflowStored(Event):
    """A validated workflow version joined the version DAG.

    Version 2 names every parent (`parents`, several for a merge) where version 1
    named the version registered before it (`parent`).
    """

    type: ClassVar[str] = "WorkflowStored"
    version: ClassVar[int] = 2
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Version (hash of the IR).")
    parents: list[WorkflowVersion] = Field(
        description="v2: the versions it derives from (none for the first, several for a merge)."
    )
    definition: dict[str, Any] = Field(description="The IR.")
    added: list[str] = Field(description="Step ids added relative to the first parent.")
    removed: list[str] = Field(description="Step ids removed.")


class AllocationApplied(Event):
    """Ingest now routes by this allocation (the newest generation wins)."""

    type: ClassVar[str] = "AllocationApplied"
    version: ClassVar[int] = 1
    allocation: dict[str, Any] = Field(description="The AllocationChanged payload.")


class SpawnedRun(BaseModel):
    """One run spawned for a task (part of `TaskAccepted`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    run_id: RunId = Field(description="Run.")
    workflow_version: WorkflowVersion = Field(description="Pinned version.")
    role: Role = Field(description="Current or challenger.")
    purpose: Purpose = Field(description="Work or shadow.")


class TaskAccepted(Event):
    """A task was admitted and its runs spawned, with the routing draws.

    Version 2 adds the arm that served the task, the challenger's rung, and the
    task's held-out split with its draw. Version 3 adds the shadow runs the replay
    ceiling cut (`cut`) and the model calls its shadow runs reserved.
    """

    type: ClassVar[str] = "TaskAccepted"
    version: ClassVar[int] = 3
    idempotency_key: str = Field(description="Producer's key.")
    task_id: TaskId = Field(description="Task id.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    generation: int = Field(description="Allocation generation routed by.")
    serve_draw: float = Field(description="Uniform draw compared with challenger_share.")
    shadow_draw: float = Field(description="Uniform draw compared with shadow_rate.")
    runs: list[SpawnedRun] = Field(description="Runs spawned.")
    arm: Role = Field(description="v2: the version that served the task: current or challenger.")
    rung: Rung | None = Field(description="v2: the challenger's rung then; None without one.")
    held_out: bool = Field(description="v2: the task is in the held-out set.")
    held_out_draw: float | None = Field(
        description="v2: uniform draw compared with the held-out fraction (None before v2)."
    )
    cut: list[CutRun] = Field(description="v3: planned shadow runs cut and never spawned.")
    replay_calls: int = Field(
        ge=0, description="v3: model calls its spawned shadow runs reserved (replay ceiling)."
    )


class AcceptedTask(ReadModel):
    """A task ingest admitted: the `TaskAccepted` that admitted it. Keyed by the task's
    idempotency key."""

    kind: ClassVar[str] = "task"
    idempotency_key: str
    task_id: TaskId
    workflow_id: WorkflowId
    generation: int
    serve_draw: float
    shadow_draw: float
    runs: list[SpawnedRun]
    arm: Role
    rung: Rung | None
    held_out: bool
    held_out_draw: float | None
    cut: list[CutRun]
    replay_calls: int


INGEST_EVENTS = EventRegistry(
    [WorkflowStored, AllocationApplied, TaskAccepted, *REPLAY_EVENTS, *ROLLOUT_EVENTS]
)


@INGEST_EVENTS.upcaster("WorkflowStored", 1)
def _workflow_stored_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 named one parent: the version registered before it."""
    out = {k: v for k, v in payload.items() if k != "parent"}
    return {**out, "parents": [payload["parent"]] if payload.get("parent") else []}


@INGEST_EVENTS.upcaster("TaskAccepted", 1)
def _task_accepted_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 knew no held-out set (every task was a selection task) and kept no rung."""
    served = next(r["role"] for r in payload["runs"] if r["purpose"] == Purpose.WORK.value)
    return {**payload, "arm": served, "rung": None, "held_out": False, "held_out_draw": None}


@INGEST_EVENTS.upcaster("TaskAccepted", 2)
def _task_accepted_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v2 knew no replay ceiling: nothing was cut, nothing reserved."""
    return {**payload, "cut": [], "replay_calls": 0}


def fold_ingest(record: LogRecord) -> list[StateDelta]:
    """Definitions, latest version per workflow, allocations and accepted tasks."""
    t = record.key.tenant
    match record.event:
        case WorkflowStored() as e:
            stored = StoredDefinition(
                workflow_id=e.workflow_id,
                parent=e.parents[0] if e.parents else None,
                parents=e.parents,
                definition=e.definition,
            )
            latest = LatestVersion(latest=e.workflow_version)
            return [stored.put(t, e.workflow_version), latest.put(t, e.workflow_id)]
        case AllocationApplied(allocation=a):
            # As applied: an allocation from before AllocationChanged v2 stays as it was.
            return [Put(Allocation.at(t, Allocation.model_validate(a).workflow_id), a)]
        case TaskAccepted() as e:
            return [AcceptedTask.model_validate(e.model_dump()).put(t, e.idempotency_key)]
    return fold_replay(record) or fold_rollout(record)


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
    if not any(p.purpose is Purpose.SHADOW for p in plan.runs):
        await _spawn(msg, uow, alloc, task_id, plan)
        return
    # A tenant's shadow-spawning tasks reserve replay one at a time in this process, each
    # committed before the next reads the meter: the meter's compare-and-swap then meets
    # only writers in other processes, instead of losing, again and again, to this
    # process's own partitions.
    async with uow.deps.replay_locks[uow.tenant], uow.step():
        await _spawn(msg, uow, alloc, task_id, plan)


async def _spawn(
    msg: TaskSubmitted, uow: IngestUnitOfWork, alloc: Allocation, task_id: TaskId, plan: Route
) -> None:
    """Spawn the task's runs (its shadow runs as the replay ceiling admits) and record it."""
    split, split_draw = held_out(task_id, uow.deps.ladder.held_out_fraction)
    at_ms = int(uow.envelope.occurred_at.timestamp() * 1000)

    def run_id_of(planned: PlannedRun) -> RunId:
        return run_id_from(at_ms, f"{uow.envelope.id}:{planned.role.value}:{planned.purpose.value}")

    admitted = await metered(uow, uow.deps.replay, plan, alloc.definitions, run_id_of)
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
            rung=alloc.rung if alloc.challenger else None,
            held_out=split,
            held_out_draw=split_draw,
            cut=list(admitted.cut),
            replay_calls=admitted.reserved,
        ),
    )
    for gone in admitted.cut:  # ended before it began, and said so: never a silent gap
        announce_cut(uow, gone, refs[0], uow.deps.replay.ceiling_for(str(uow.tenant)))


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
    strategy = profile(wf.grading, deps.judge, list(wf.rubric), order_check=grading.order_check)
    try:
        check_fits(strategy, grading)
    except StrategyRefused as exc:
        raise Refused(f"workflow {wf.id!r} refused: {exc}") from exc
    return wf


async def on_allocation(msg: AllocationChanged, uow: IngestUnitOfWork) -> None:
    """Route the workflow's tasks by `msg` from now on, unless a newer one applies."""
    current = await uow.get(Allocation, msg.workflow_id)
    if current is not None and current.generation >= msg.generation:
        return  # an older or repeated allocation: the newest generation wins
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
    )
    return StageSpec(
        name="ingest",
        events=INGEST_EVENTS,
        fold=fold_ingest,
        handlers=routes(
            on_task, on_rollout_progress, on_cancel_rollout, on_workflow, on_allocation
        ),
        deps=ingesting,
        background=(timer(RolloutGroup.kind, rollout_due, time.time),),
        gauges=lambda log: replay_gauges(log, deps.replay, datetime.now(UTC).date().isoformat()),
    )
