"""Ingest: `assay.tasks`, `assay.workflows`, `assay.decisions` -> `assay.runs`.

Tasks are deduplicated on `(tenant, idempotency key)`, given a `TaskId` (the
hash of the input before any workflow touches it, or the producer's task key),
and routed by the latest allocation: the challenger serves a deterministic
`challenger_share` of tasks; of the rest, a `shadow_rate` share is also
re-executed under the challenger for comparison. Every draw is recorded.
"""

from __future__ import annotations

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
    RunRef,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
    WorkflowRegistered,
)
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork
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
from assay_ingest.rollouts import ROLLOUT_EVENTS, Rollouts, fold_rollout


class WorkflowStored(Event):
    """A validated workflow version joined the version DAG."""

    type: ClassVar[str] = "WorkflowStored"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Version (hash of the IR).")
    parent: WorkflowVersion | None = Field(None, description="Previous latest version.")
    definition: dict[str, Any] = Field(description="The IR.")
    added: list[str] = Field(description="Step ids added relative to the parent.")
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
    """A task was admitted and its runs spawned, with the routing draws."""

    type: ClassVar[str] = "TaskAccepted"
    version: ClassVar[int] = 1
    idempotency_key: str = Field(description="Producer's key.")
    task_id: TaskId = Field(description="Task id.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    generation: int = Field(description="Allocation generation routed by.")
    serve_draw: float = Field(description="Uniform draw compared with challenger_share.")
    shadow_draw: float = Field(description="Uniform draw compared with shadow_rate.")
    runs: list[SpawnedRun] = Field(description="Runs spawned.")


INGEST_EVENTS = EventRegistry([WorkflowStored, AllocationApplied, TaskAccepted, *ROLLOUT_EVENTS])


def fold_ingest(record: LogRecord) -> list[StateDelta]:
    """Definitions, latest version per workflow, allocations and accepted tasks."""
    t = record.key.tenant
    match record.event:
        case WorkflowStored() as e:
            return [
                Put(
                    StateKey(t, "definition", e.workflow_version),
                    {"workflow_id": e.workflow_id, "parent": e.parent, "definition": e.definition},
                ),
                Put(StateKey(t, "workflow", e.workflow_id), {"latest": e.workflow_version}),
            ]
        case AllocationApplied(allocation=a):
            return [Put(StateKey(t, "allocation", a["workflow_id"]), a)]
        case TaskAccepted() as e:
            return [Put(StateKey(t, "task", e.idempotency_key), e.model_dump(mode="json"))]
    return fold_rollout(record)


def task_id_for(task: TaskSubmitted) -> TaskId:
    """The producer's task key, hashed, or the hash of the canonical input."""
    if task.task_key is not None:
        return TaskId(digest(f"task-key\x1f{task.task_key}".encode()))
    return TaskId(content_hash(task.input))


def draw(task_id: TaskId, purpose: str) -> float:
    """A deterministic uniform draw in [0, 1) for one routing decision of a task."""
    return int(digest(f"{task_id}\x1f{purpose}".encode())[:13], 16) / float(1 << 52)


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the ingest stage."""
    known_tools = frozenset(deps.tools)

    async def on_workflow(msg: WorkflowRegistered, uow: UnitOfWork) -> None:
        try:
            wf = validate(from_document(msg.definition), known_tools, deps.verifier_kinds)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable) as exc:
            raise Refused(f"invalid workflow: {exc}") from exc
        try:  # §11.1: a strategy that does not fit the declared capacity is refused at load
            grading = deps.grading
            check_fits(
                profile(wf.grading, deps.judge, list(wf.rubric), order_check=grading.order_check),
                grading.capacity,
            )
        except StrategyRefused as exc:
            raise Refused(f"workflow {wf.id!r} refused: {exc}") from exc
        if await uow.get("definition", wf.version) is not None:
            return  # already stored: registration is idempotent
        if any(isinstance(s, SubworkflowStep) for s in wf.steps):
            known: dict[tuple[WorkflowId, WorkflowVersion], WorkflowDef] = {
                (WorkflowId(d["workflow_id"]), WorkflowVersion(v)): WorkflowDef.model_validate(
                    d["definition"]
                )
                for v, d in await uow.scan("definition")
            }
            known[(wf.id, wf.version)] = wf
            try:  # cycles (through `latest` too) and nesting depth are refused here, at load
                check_subworkflows(known)
            except WorkflowInvalid as exc:
                raise Refused(f"invalid workflow: {exc}") from exc
        latest = await uow.get("workflow", wf.id)
        parent: WorkflowVersion | None = None
        added: list[str] = sorted(s.id for s in wf.steps)
        removed: list[str] = []
        if latest is not None:
            parent = WorkflowVersion(latest["latest"])
            parent_doc = await uow.get("definition", parent)
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
                parent=parent,
                definition=wf.model_dump(mode="json", by_alias=True),
                added=added,
                removed=removed,
            ),
        )

    async def on_allocation(msg: AllocationChanged, uow: UnitOfWork) -> None:
        current = await uow.get("allocation", msg.workflow_id)
        if current is not None and current["generation"] >= msg.generation:
            return  # an older or repeated allocation: the newest generation wins
        uow.record(
            BranchKey.main(uow.tenant, f"allocation:{msg.workflow_id}"),
            AllocationApplied(allocation=msg.model_dump(mode="json")),
        )

    async def on_task(msg: TaskSubmitted, uow: UnitOfWork) -> None:
        if msg.tenant != uow.tenant:
            raise Refused(f"task tenant {msg.tenant} differs from the envelope's {uow.tenant}")
        if await uow.get("task", msg.idempotency_key) is not None:
            return  # a resubmission: the first one stands
        alloc = await uow.get("allocation", msg.workflow_id)
        if alloc is None:
            raise Refused(f"unknown workflow {msg.workflow_id!r} for tenant {msg.tenant}")
        task_id = task_id_for(msg)
        if msg.rollout is not None:
            await rollouts.admit(uow, msg, task_id, alloc)
            return
        serve, shadow = draw(task_id, "serve"), draw(task_id, "shadow")
        challenger = alloc.get("challenger")
        plan: list[tuple[Role, Purpose, str]] = []
        if challenger and serve < alloc["challenger_share"]:
            plan.append((Role.CHALLENGER, Purpose.WORK, challenger))
        else:
            plan.append((Role.CURRENT, Purpose.WORK, alloc["current"]))
            if challenger and shadow < alloc["shadow_rate"]:
                plan.append((Role.CHALLENGER, Purpose.SHADOW, challenger))
        at_ms = int(uow.envelope.occurred_at.timestamp() * 1000)
        spawned = []
        for role, purpose, version in plan:
            run_id = run_id_from(at_ms, f"{uow.envelope.id}:{role.value}:{purpose.value}")
            ref = RunRef(
                tenant=msg.tenant,
                run_id=run_id,
                task_id=task_id,
                idempotency_key=msg.idempotency_key,
                workflow_id=msg.workflow_id,
                workflow_version=WorkflowVersion(version),
                role=role,
                purpose=purpose,
                baseline_version=alloc["current"] if role is Role.CHALLENGER else None,
                reference_expected=purpose is Purpose.SHADOW,
            )
            definition = alloc["definitions"][version]
            children = await _resolve(uow, WorkflowDef.model_validate(definition), {})
            uow.emit(
                RUNS,
                RunSpawned(run=ref, definition=definition, input=msg.input, subworkflows=children),
            )
            uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.SCHEDULED))
            spawned.append(
                SpawnedRun(
                    run_id=run_id,
                    workflow_version=WorkflowVersion(version),
                    role=role,
                    purpose=purpose,
                )
            )
        uow.record(
            BranchKey.main(uow.tenant, f"task:{msg.idempotency_key}"),
            TaskAccepted(
                idempotency_key=msg.idempotency_key,
                task_id=task_id,
                workflow_id=msg.workflow_id,
                generation=alloc["generation"],
                serve_draw=serve,
                shadow_draw=shadow,
                runs=spawned,
            ),
        )

    rollouts = Rollouts(lambda uow, wf: _resolve(uow, wf, {}))

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
        },
        background=(rollouts.deadlines,),
    )


async def _resolve(
    uow: UnitOfWork, wf: WorkflowDef, out: dict[str, dict[str, Any]], depth: int = 0
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
            latest = await uow.get("workflow", step.workflow)
            version = None if latest is None else str(latest["latest"])
        doc = None if version is None else await uow.get("definition", version)
        if doc is None or doc["workflow_id"] != step.workflow:
            raise Refused(
                f"workflow {wf.id!r}: step {step.id!r} calls {child_key(step)}, "
                "which is not registered"
            )
        out[child_key(step)] = doc["definition"]
        await _resolve(uow, WorkflowDef.model_validate(doc["definition"]), out, depth + 1)
    return out
