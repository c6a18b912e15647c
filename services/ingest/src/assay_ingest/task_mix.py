"""Task-mix drift, watched at the door (§12.5; the statistic is `assay.grading.task_mix`).

A workflow whose current version declares `drift` has each admitted task's watched
features sampled onto the workflow's task-mix stream `task-mix:<workflow>`, in the
commit that admits the task: the last `window` tasks are kept, one document per slot
(`task_mix_row/<workflow>/<slot>`), and the summary in `task_mix/<workflow>`. Every
`window` tasks the full window is measured:

- without a reference yet, it becomes the reference (`first_window`);
- else each feature's PSI against the reference is recorded (`TaskMixMeasured`, the
  gauge `assay_task_mix_psi`), and above the threshold announced as
  `TaskMixDrifted` on `assay.workflows` — decide holds promotion on it.

The reference is retaken (announced as `TaskMixRebased`, which releases decide's hold)
when a challenger is promoted — the last full window is the mix it was promoted under;
without one yet, the next full window is — and when an operator acknowledges the drift
(`AcknowledgeDrift`): the last full window becomes the normal. A new current version
watching other features (or another window) starts sampling afresh.

Routed tasks are sampled; a rollout group (an evaluation fan-out of one task) is not.
The stream is compare-and-swapped, and one process samples a workflow's tasks one at a
time, so concurrent tasks of a workflow never take the same slot.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from assay.bus.topics import WORKFLOWS
from assay.grading.task_mix import Reference, features_of, reference_of, window_psi
from assay.kernel import Lsn, Refused, TenantId, WorkflowId, WorkflowVersion
from assay.messages import AcknowledgeDrift, TaskMixDrifted, TaskMixRebased
from assay.messages.task_mix import RebaseCause
from assay.record import BranchKey, Event, LogRecord, Patch, ReadModel, StateDelta
from assay.runtime import Gauge, UnitOfWork
from assay.store import EventLog
from assay.workflow import DriftSpec, WorkflowDef
from assay_ingest.routing import Allocation

STREAM_PREFIX = "task-mix:"


def stream_of(tenant: TenantId, workflow: WorkflowId) -> BranchKey:
    """A workflow's task-mix stream."""
    return BranchKey.main(tenant, f"{STREAM_PREFIX}{workflow}")


def row_key(workflow: WorkflowId, slot: int) -> str:
    """The key of one slot of a workflow's window."""
    return f"{workflow}/{slot:06d}"


class TaskMixReset(Event):
    """Sampling (re)starts: the current version watches these features over this window."""

    type: ClassVar[str] = "TaskMixReset"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    features: list[str] = Field(description="Features watched, the TaskId class last.")
    window: int = Field(ge=1, description="Tasks in one window.")


class TaskMixSampled(Event):
    """One admitted task's watched features, in its window slot."""

    type: ClassVar[str] = "TaskMixSampled"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    slot: int = Field(ge=0, description="Its slot: (sampled - 1) mod window.")
    row: dict[str, Any] = Field(description="Feature -> value (a number or a bin label).")
    sampled: int = Field(ge=1, description="Tasks sampled so far, this one included.")


class TaskMixReferenced(Event):
    """The reference mix later windows are compared with (None: the next full window)."""

    type: ClassVar[str] = "TaskMixReferenced"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    reference: Reference | None = Field(description="The reference; None until a full window.")
    cause: RebaseCause = Field(description="Why it was taken.")
    current: WorkflowVersion = Field(description="The current version then.")


class TaskMixMeasured(Event):
    """A full window's PSI per feature against the reference."""

    type: ClassVar[str] = "TaskMixMeasured"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    psi: dict[str, float] = Field(description="Feature -> PSI.")
    threshold: float = Field(gt=0, description="The threshold then.")
    drifted: bool = Field(description="Some feature's PSI is above the threshold.")
    sampled: int = Field(ge=1, description="Tasks sampled when the window closed.")


TASK_MIX_EVENTS = (TaskMixReset, TaskMixSampled, TaskMixReferenced, TaskMixMeasured)


class TaskMix(ReadModel):
    """A workflow's task-mix watch. Keyed by workflow id."""

    kind: ClassVar[str] = "task_mix"
    next: int = 0
    """The stream's next LSN: what a handler expects it still to be (compare-and-swap)."""
    features: list[str] = Field(default_factory=list)
    window: int = 0
    sampled: int = 0
    reference: Reference | None = None
    cause: RebaseCause | None = None
    psi: dict[str, float] | None = None
    """The last full window's PSI per feature (None before one was measured)."""
    threshold: float | None = None
    drifted: bool = False
    measured_at: int | None = None
    """Tasks sampled when the last window was measured."""


class TaskMixRow(ReadModel):
    """One slot of a workflow's window: a task's watched features."""

    kind: ClassVar[str] = "task_mix_row"
    row: dict[str, Any]


def fold_task_mix(record: LogRecord) -> list[StateDelta]:
    """The watch and its window slots, from the task-mix stream."""
    t = record.key.tenant
    head: dict[str, Any] = {"next": record.lsn + 1}
    match record.event:
        case TaskMixReset() as e:
            fresh = TaskMix(next=record.lsn + 1, features=e.features, window=e.window)
            return [fresh.put(t, e.workflow_id)]
        case TaskMixSampled() as e:
            return [
                TaskMixRow(row=e.row).put(t, row_key(e.workflow_id, e.slot)),
                Patch(TaskMix.at(t, e.workflow_id), {**head, "sampled": e.sampled}),
            ]
        case TaskMixReferenced() as e:
            ref = None if e.reference is None else e.reference.model_dump(mode="json")
            taken: dict[str, Any] = {"reference": ref, "cause": e.cause, "drifted": False}
            return [Patch(TaskMix.at(t, e.workflow_id), {**head, **taken})]
        case TaskMixMeasured() as e:
            found: dict[str, Any] = {"psi": e.psi, "threshold": e.threshold, "drifted": e.drifted}
            patch = {**head, **found, "measured_at": e.sampled}
            return [Patch(TaskMix.at(t, e.workflow_id), patch)]
    return []


def watched(alloc: Allocation) -> DriftSpec | None:
    """The drift check the allocation's current version declares, if any."""
    return WorkflowDef.model_validate(alloc.definitions[alloc.current]).drift


class _Watch:
    """One handler's view of a workflow's watch: what it read, and its writes, swapped."""

    def __init__(self, uow: UnitOfWork[Any], workflow: WorkflowId, mix: TaskMix | None) -> None:
        self.uow, self.workflow, self.mix = uow, workflow, mix or TaskMix()
        self.key = stream_of(uow.tenant, workflow)
        uow.expect(self.key, Lsn(self.mix.next))

    @classmethod
    async def open(cls, uow: UnitOfWork[Any], workflow: WorkflowId) -> _Watch:
        return cls(uow, workflow, await uow.get(TaskMix, workflow))

    def record(self, event: Event) -> None:
        self.uow.record(self.key, event)

    async def window(self, latest: TaskMixSampled | None = None) -> list[dict[str, Any]]:
        """The last full window's rows (`latest`, not committed yet, in its slot)."""
        prefix = f"{self.workflow}/"
        rows = {
            int(k[len(prefix) :]): doc.row
            for k, doc in await self.uow.scan(TaskMixRow, prefix)
            if k[len(prefix) :].isdigit()
        }
        if latest is not None:
            rows[latest.slot] = latest.row
        return [rows[s] for s in sorted(rows) if s < self.mix.window]

    async def rebase(
        self, spec: DriftSpec, current: WorkflowVersion, cause: RebaseCause, reason: str = ""
    ) -> None:
        """Take the last full window as the reference, and say so."""
        rows = await self.window()
        ref = reference_of(rows, spec)
        self.record(
            TaskMixReferenced(
                workflow_id=self.workflow, reference=ref, cause=cause, current=current
            )
        )
        self.uow.emit(WORKFLOWS, self._rebased(current, cause, ref.tasks, reason))

    def _rebased(
        self, current: WorkflowVersion, cause: RebaseCause, tasks: int, reason: str
    ) -> TaskMixRebased:
        return TaskMixRebased(
            tenant=self.uow.tenant,
            workflow_id=self.workflow,
            current=current,
            cause=cause,
            reference_tasks=tasks,
            sampled=self.mix.sampled,
            reason=reason,
        )


async def sample(
    uow: UnitOfWork[Any], alloc: Allocation, task_input: dict[str, Any], keyed: bool
) -> None:
    """Sample an admitted task's features; measure (or take as the reference) a full
    window. Nothing for a workflow whose current version watches no task mix."""
    spec = watched(alloc)
    if spec is None:
        return
    w = await _Watch.open(uow, alloc.workflow_id)
    if (w.mix.features, w.mix.window) != (spec.tracked(), spec.window):
        w.record(TaskMixReset(workflow_id=w.workflow, features=spec.tracked(), window=spec.window))
        w.mix = TaskMix(features=spec.tracked(), window=spec.window)
    sampled = w.mix.sampled + 1
    e = TaskMixSampled(
        workflow_id=w.workflow,
        slot=(sampled - 1) % spec.window,
        row=features_of(spec, task_input, keyed),
        sampled=sampled,
    )
    w.record(e)
    if sampled % spec.window:
        return
    rows = await w.window(e)
    w.mix = w.mix.model_copy(update={"sampled": sampled})
    if w.mix.reference is None:
        ref = reference_of(rows, spec)
        w.record(
            TaskMixReferenced(
                workflow_id=w.workflow, reference=ref, cause="first_window", current=alloc.current
            )
        )
        uow.emit(WORKFLOWS, w._rebased(alloc.current, "first_window", ref.tasks, ""))
        return
    _measure(w, spec, alloc.current, w.mix.reference, rows)


def _measure(
    w: _Watch,
    spec: DriftSpec,
    current: WorkflowVersion,
    ref: Reference,
    rows: list[dict[str, Any]],
) -> None:
    psi = window_psi(ref, rows)
    drifted = max(psi.values()) > spec.threshold
    sampled = w.mix.sampled
    w.record(
        TaskMixMeasured(
            workflow_id=w.workflow,
            psi=psi,
            threshold=spec.threshold,
            drifted=drifted,
            sampled=sampled,
        )
    )
    if drifted:
        w.uow.emit(
            WORKFLOWS,
            TaskMixDrifted(
                tenant=w.uow.tenant,
                workflow_id=w.workflow,
                current=current,
                psi=psi,
                threshold=spec.threshold,
                window=len(rows),
                sampled=sampled,
                reference_tasks=ref.tasks,
            ),
        )


async def on_promoted(uow: UnitOfWork[Any], before: Allocation, after: Allocation) -> None:
    """A new current version: the mix it was promoted under (the last full window, or
    the next one) becomes the reference."""
    spec = watched(after)
    if spec is None or before.current == after.current:
        return
    w = await _Watch.open(uow, after.workflow_id)
    full = (w.mix.features, w.mix.window) == (spec.tracked(), spec.window) and (
        w.mix.sampled >= spec.window
    )
    if full:
        await w.rebase(spec, after.current, "promoted")
        return
    w.record(
        TaskMixReferenced(
            workflow_id=w.workflow, reference=None, cause="promoted", current=after.current
        )
    )


async def on_acknowledge_drift(msg: AcknowledgeDrift, uow: UnitOfWork[Any]) -> None:
    """An operator accepts the drifted mix: the last full window becomes the reference.

    Raises:
        Refused: no such workflow, it watches no task mix, or it has no drift to
            acknowledge.
    """
    if msg.tenant != uow.tenant:
        raise Refused(f"acknowledgement tenant {msg.tenant} differs from the envelope's")
    alloc = await uow.get(Allocation, msg.workflow_id)
    if alloc is None:
        raise Refused(f"unknown workflow {msg.workflow_id!r} for tenant {msg.tenant}")
    spec = watched(alloc)
    if spec is None:
        raise Refused(f"workflow {msg.workflow_id!r} watches no task mix (it declares no drift)")
    w = await _Watch.open(uow, msg.workflow_id)
    if not w.mix.drifted:
        raise Refused(f"workflow {msg.workflow_id!r} has no task-mix drift to acknowledge")
    await w.rebase(spec, alloc.current, "acknowledged", msg.reason)


async def task_mix_gauges(log: EventLog) -> list[Gauge]:
    """Each watched workflow's last measured PSI (its most drifted feature's)."""
    samples = [
        ((str(tenant), key), max(mix.psi.values()))
        for tenant, key, doc in sorted(await log.scan_kind(TaskMix.kind), key=lambda r: r[:2])
        if (mix := TaskMix.model_validate(doc)).psi
    ]
    return [
        Gauge(
            "assay_task_mix_psi",
            "Population stability index of the workflow's last full window of tasks against "
            "the reference mix (its most drifted feature).",
            ("tenant", "workflow"),
            tuple(samples),
        )
    ]
