"""Ingest's log records and what they fold to (§12.1, §12.2): the version DAG, the
allocation tasks are routed by, accepted tasks, the replay meter and rollout groups.

Every document kind ingest stores has a read model (`INGEST_STATE`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from assay.kernel import RunId, TaskId, WorkflowId, WorkflowVersion
from assay.messages import Purpose, Role, Rung
from assay.record import Event, EventRegistry, LogRecord, Put, ReadModel, StateDelta
from assay.record.compaction import Compacted
from assay.record.erasure import TenantErased
from assay_ingest.matrix import MATRIX_EVENTS, RolloutMatrix, fold_matrix
from assay_ingest.replay import REPLAY_EVENTS, CutRun, ReplayMeter, fold_replay
from assay_ingest.rollouts import ROLLOUT_EVENTS, RolloutGroup, RolloutInput, fold_rollout
from assay_ingest.routing import Allocation
from assay_ingest.task_mix import TASK_MIX_EVENTS, TaskMix, TaskMixRow, fold_task_mix
from assay_ingest.versions import LatestVersion, StoredDefinition


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
    [
        TenantErased,  # every stage log can hold a tenant's tombstone
        WorkflowStored,
        AllocationApplied,
        TaskAccepted,
        *REPLAY_EVENTS,
        *ROLLOUT_EVENTS,
        *TASK_MIX_EVENTS,
        *MATRIX_EVENTS,
        Compacted,
    ]
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


@INGEST_EVENTS.upcaster("MatrixAdmitted", 1)
def _matrix_admitted_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1: every candidate ran one sibling (`samples` 1); it reads as it is."""
    return dict(payload)


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
    return (
        fold_replay(record) or fold_rollout(record) or fold_task_mix(record) or fold_matrix(record)
    )


INGEST_STATE: tuple[type[ReadModel], ...] = (
    StoredDefinition,
    LatestVersion,
    Allocation,
    AcceptedTask,
    ReplayMeter,
    RolloutGroup,
    RolloutInput,
    TaskMix,
    TaskMixRow,
    RolloutMatrix,
)
"""Every kind of document ingest stores, as its read model."""
