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
from) and never edited (a re-registration of a stored version changes nothing).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from assay.bus.topics import DECISIONS, RUN_STATUS, RUNS, TASKS, WORKFLOWS
from assay.engine import StepNotExecutable, check_executable, child_key
from assay.grading.strategies import StrategyRefused, check_fits, profile
from assay.kernel import (
    Refused,
    RunId,
    RunState,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
    content_hash,
    digest,
    run_id_from,
)
from assay.messages import (
    AllocationChanged,
    CancelRollout,
    Purpose,
    Role,
    RolloutProgress,
    Rung,
    RunRef,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
    WorkflowRegistered,
)
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.runtime import Gauge, StageDeps, StageSpec, UnitOfWork
from assay.runtime.admission import CapacityRefused
from assay.runtime.timers import timer
from assay.store import EventLog
from assay.workflow import (
    LATEST,
    MAX_SUBWORKFLOW_DEPTH,
    SubworkflowStep,
    WorkflowDef,
    WorkflowInvalid,
    check_subworkflows,
    check_version_bump,
    from_document,
    validate,
)
from assay_ingest.capacity import admit_by_capacity, announce_refused
from assay_ingest.replay import (
    REPLAY_EVENTS,
    CutRun,
    announce_cut,
    fold_replay,
    metered,
    replay_gauges,
)
from assay_ingest.rollouts import ROLLOUT_EVENTS, Rollouts, fold_rollout
from assay_ingest.routing import PlannedRun, Route, held_out, route


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
            return [
                Put(
                    StateKey(t, "definition", e.workflow_version),
                    {
                        "workflow_id": e.workflow_id,
                        "parent": e.parents[0] if e.parents else None,
                        "parents": e.parents,
                        "definition": e.definition,
                    },
                ),
                Put(StateKey(t, "workflow", e.workflow_id), {"latest": e.workflow_version}),
            ]
        case AllocationApplied(allocation=a):
            return [Put(StateKey(t, "allocation", a["workflow_id"]), a)]
        case TaskAccepted() as e:
            return [Put(StateKey(t, "task", e.idempotency_key), e.model_dump(mode="json"))]
    return fold_replay(record) or fold_rollout(record)


def task_id_for(task: TaskSubmitted) -> TaskId:
    """The producer's task key, hashed, or the hash of the canonical input."""
    if task.task_key is not None:
        return TaskId(digest(f"task-key\x1f{task.task_key}".encode()))
    return TaskId(content_hash(task.input))


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the ingest stage."""
    known_tools = frozenset(deps.tools)
    replay_locks: defaultdict[TenantId, asyncio.Lock] = defaultdict(asyncio.Lock)
    """Per tenant: held while a task reserves replay, until that reservation commits."""

    async def on_workflow(msg: WorkflowRegistered, uow: UnitOfWork[Any]) -> None:
        try:
            wf = validate(from_document(msg.definition), known_tools, deps.verifier_kinds)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable) as exc:
            raise Refused(f"invalid workflow: {exc}") from exc
        try:  # §11.1: a strategy that does not fit the declared capacity is refused at load
            grading = deps.grading
            needs = profile(
                wf.grading, deps.judge, list(wf.rubric), order_check=grading.order_check
            )
            check_fits(needs, grading)
            deps.admission.check_workflow(wf, needs)  # §14.2: resident together, never swapped
        except (StrategyRefused, CapacityRefused) as exc:
            raise Refused(f"workflow {wf.id!r} refused: {exc}") from exc
        if await uow.get_document("definition", wf.version) is not None:
            return  # already stored: registration is idempotent
        if any(isinstance(s, SubworkflowStep) for s in wf.steps):
            known: dict[tuple[WorkflowId, WorkflowVersion], WorkflowDef] = {
                (WorkflowId(d["workflow_id"]), WorkflowVersion(v)): WorkflowDef.model_validate(
                    d["definition"]
                )
                for v, d in await uow.scan_documents("definition")
            }
            known[(wf.id, wf.version)] = wf
            try:  # cycles (through `latest` too) and nesting depth are refused here, at load
                check_subworkflows(known)
            except WorkflowInvalid as exc:
                raise Refused(f"invalid workflow: {exc}") from exc
        parents = await _parents(uow, wf, msg)
        added: list[str] = sorted(s.id for s in wf.steps)
        removed: list[str] = []
        if parents:  # the retained-ids check is against the first parent
            parent_doc = await uow.get_document("definition", parents[0])
            assert parent_doc is not None
            try:
                diff = check_version_bump(
                    WorkflowDef.model_validate(parent_doc["definition"]), wf, rewrite=msg.rewrite
                )
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

    async def on_allocation(msg: AllocationChanged, uow: UnitOfWork[Any]) -> None:
        current = await uow.get_document("allocation", msg.workflow_id)
        if current is not None and current["generation"] >= msg.generation:
            return  # an older or repeated allocation: the newest generation wins
        uow.record(
            BranchKey.main(uow.tenant, f"allocation:{msg.workflow_id}"),
            AllocationApplied(allocation=msg.model_dump(mode="json")),
        )

    async def on_task(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        if msg.tenant != uow.tenant:
            raise Refused(f"task tenant {msg.tenant} differs from the envelope's {uow.tenant}")
        if await uow.get_document("task", msg.idempotency_key) is not None:
            return  # a resubmission: the first one stands
        alloc = await uow.get_document("allocation", msg.workflow_id)
        if alloc is None:
            raise Refused(f"unknown workflow {msg.workflow_id!r} for tenant {msg.tenant}")
        task_id = task_id_for(msg)
        if msg.rollout is not None:
            await rollouts.admit(uow, msg, task_id, alloc)
            return
        plan = route(alloc, task_id)
        if not any(p.purpose is Purpose.SHADOW for p in plan.runs):
            await spawn(msg, uow, alloc, task_id, plan)
            return
        # A tenant's shadow-spawning tasks reserve replay one at a time in this process, each
        # committed before the next reads the meter: the meter's compare-and-swap then meets
        # only writers in other processes, instead of losing, again and again, to this
        # process's own partitions.
        async with replay_locks[uow.tenant]:
            await spawn(msg, uow, alloc, task_id, plan)
            await uow.commit()

    async def spawn(
        msg: TaskSubmitted,
        uow: UnitOfWork[Any],
        alloc: dict[str, Any],
        task_id: TaskId,
        route_: Route,
    ) -> None:
        """Spawn the task's runs (its shadow runs as the replay ceiling admits) and record it."""
        split, split_draw = held_out(task_id, deps.ladder.held_out_fraction)
        at_ms = int(uow.envelope.occurred_at.timestamp() * 1000)

        def run_id_of(planned: PlannedRun) -> RunId:
            return run_id_from(
                at_ms, f"{uow.envelope.id}:{planned.role.value}:{planned.purpose.value}"
            )

        route_, refused = admit_by_capacity(
            uow, deps.admission, route_, alloc["definitions"], run_id_of
        )
        admitted = await metered(uow, deps.replay, route_, alloc["definitions"], run_id_of)
        for gone in admitted.cut:  # cut by the replay ceiling: it will make no model call
            deps.admission.release(str(gone.run_id))
        deps.admission.count_budget_cuts(len(admitted.cut))
        plan = admitted.plan
        spawned, refs = [], []
        for planned in plan.runs:
            role, purpose, version = planned.role, planned.purpose, planned.version
            run_id = run_id_of(planned)
            ref = RunRef(
                tenant=msg.tenant,
                run_id=run_id,
                task_id=task_id,
                idempotency_key=msg.idempotency_key,
                workflow_id=msg.workflow_id,
                workflow_version=version,
                role=role,
                purpose=purpose,
                baseline_version=alloc["current"] if role is Role.CHALLENGER else None,
                reference_expected=plan.reference_expected(planned),
                held_out=split,
            )
            definition = alloc["definitions"][version]
            children = await _resolve(uow, WorkflowDef.model_validate(definition), {})
            uow.emit(
                RUNS,
                RunSpawned(run=ref, definition=definition, input=msg.input, subworkflows=children),
            )
            uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.SCHEDULED))
            spawned.append(
                SpawnedRun(run_id=run_id, workflow_version=version, role=role, purpose=purpose)
            )
            refs.append(ref)
        uow.record(
            BranchKey.main(uow.tenant, f"task:{msg.idempotency_key}"),
            TaskAccepted(
                idempotency_key=msg.idempotency_key,
                task_id=task_id,
                workflow_id=msg.workflow_id,
                generation=alloc["generation"],
                serve_draw=plan.serve_draw,
                shadow_draw=plan.shadow_draw,
                runs=spawned,
                arm=plan.arm,
                rung=alloc.get("rung") if alloc.get("challenger") else None,
                held_out=split,
                held_out_draw=split_draw,
                cut=[*refused, *admitted.cut],
                replay_calls=admitted.reserved,
            ),
        )
        for gone in refused:  # refused at admission, never queued (§14.2)
            announce_refused(uow, msg, task_id, split, alloc.get("current"), gone)
        for gone in admitted.cut:  # ended before it began, and said so: never a silent gap
            announce_cut(uow, gone, refs[0], deps.replay.ceiling_for(str(uow.tenant)))

    rollouts = Rollouts(lambda uow, wf: _resolve(uow, wf, {}), deps.admission)

    return StageSpec(
        name="ingest",
        events=INGEST_EVENTS,
        fold=fold_ingest,
        handlers={
            TASKS: {
                TaskSubmitted.type: on_task,
                RolloutProgress.type: rollouts.on_progress,
                CancelRollout.type: rollouts.on_cancel,
            },
            WORKFLOWS: {WorkflowRegistered.type: on_workflow},
            DECISIONS: {AllocationChanged.type: on_allocation},
            **deps.admission.handlers(),  # run-status lets admitted KV go (§14.2)
        },
        background=(timer("rollout", Rollouts.deadline, time.time),),
        gauges=lambda log: _gauges(log, deps),
    )


async def _gauges(log: EventLog, deps: StageDeps) -> list[Gauge]:
    """The replay meters, and admission's refusals and held KV."""
    today = datetime.now(UTC).date().isoformat()
    return [*await replay_gauges(log, deps.replay, today), *deps.admission.gauges()]


async def _parents(
    uow: UnitOfWork[Any], wf: WorkflowDef, msg: WorkflowRegistered
) -> list[WorkflowVersion]:
    """The versions a new version derives from: those the registration names, else the
    version registered last (none for the first).

    Raises:
        Refused: a named parent is not a stored version of this workflow, or a later
            version names none without `rewrite: true`.
    """
    latest = await uow.get_document("workflow", wf.id)
    if msg.parents is None:
        return [] if latest is None else [WorkflowVersion(latest["latest"])]
    parents = list(dict.fromkeys(msg.parents))
    for parent in parents:
        doc = await uow.get_document("definition", parent)
        if doc is None or doc["workflow_id"] != wf.id:
            raise Refused(f"workflow {wf.id!r}: parent {parent} is not a registered version of it")
    if not parents and latest is not None and not msg.rewrite:
        raise Refused(
            f"workflow {wf.id!r}: a version with no parent beside registered ones is a new "
            "root; register it with rewrite: true"
        )
    return parents


async def _resolve(
    uow: UnitOfWork[Any], wf: WorkflowDef, out: dict[str, dict[str, Any]], depth: int = 0
) -> dict[str, dict[str, Any]]:
    """Pin every sub-workflow `wf` can call, now, once (§4.4): `latest` is the version
    registered last at this moment. Nested calls are pinned too.

    Raises:
        Refused: a called workflow or version is not registered, or calls nest too deep.
    """
    if depth > MAX_SUBWORKFLOW_DEPTH:
        raise Refused(f"workflow {wf.id!r}: sub-workflows nest deeper than {MAX_SUBWORKFLOW_DEPTH}")
    for step in wf.steps:
        if not isinstance(step, SubworkflowStep) or child_key(step) in out:
            continue
        version: str | None = step.version
        if version == LATEST:
            latest = await uow.get_document("workflow", step.workflow)
            version = None if latest is None else str(latest["latest"])
        doc = None if version is None else await uow.get_document("definition", version)
        if doc is None or doc["workflow_id"] != step.workflow:
            raise Refused(
                f"workflow {wf.id!r}: step {step.id!r} calls {child_key(step)}, "
                "which is not registered"
            )
        out[child_key(step)] = doc["definition"]
        await _resolve(uow, WorkflowDef.model_validate(doc["definition"]), out, depth + 1)
    return out
