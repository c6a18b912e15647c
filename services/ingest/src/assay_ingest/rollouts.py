"""Rollout groups in ingest (DESIGN §13): admit, spawn within the budget, close.

A task with a `RolloutSpec` becomes a group of sibling runs of the current
version, from the same immutable input. Ingest is the group's single writer:
its document lives with the task (keyed `tenant:idempotency_key`), and every
message that changes it — the task, each sibling's `RolloutProgress`, a
`CancelRollout` — arrives on `assay.tasks` with that key.

- **Admission.** At most `admit` of the `n` requested, and no more than the
  group's model-call, token and cost budgets cover at the per-run maxima.
- **Spawning.** A sibling starts only while fewer than `max_concurrency` run and
  the calls (and tokens, and US dollars) spent plus every running sibling's
  maximum plus its own fit the group total — so no cap is ever exceeded (execute holds each sibling
  to its per-run maxima). Sibling ids derive from the
  task's envelope and the index: a redelivered message spawns nothing twice, and
  a retried attempt is an attempt of the same sibling, never another rollout.
- **Closing.** When nothing runs and nothing more may start — all admitted ran,
  the budget is spent, the group was cancelled or its deadline passed — ingest
  sends `RolloutClosed` to the tournament stage, which selects.
"""

from __future__ import annotations

import functools
import time
from decimal import Decimal
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from assay.bus.topics import RUN_COMMANDS, RUN_STATUS, RUNS, TASKS, VERIFIED
from assay.kernel import RunId, RunState, TaskId, TenantId, WorkflowId, WorkflowVersion
from assay.messages import (
    CancelRollout,
    CancelRun,
    RolloutClosed,
    RolloutProgress,
    RolloutRef,
    RolloutSpec,
    RunRef,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
)
from assay.messages.candidates import MatrixEstimate, PlannedCandidate
from assay.record import BranchKey, Event, LogRecord, Put, ReadModel, StateDelta
from assay.runtime.timers import Fired
from assay.workflow import WorkflowDef
from assay_ingest.ingesting import IngestUnitOfWork
from assay_ingest.matrix import (
    AdmittedMatrix,
    RolloutMatrix,
    SiblingPlan,
    admit_matrix,
    release_unstarted,
    sibling_plan,
    sibling_run_id,
)
from assay_ingest.routing import Allocation

DEADLINE = "deadline"
"""The reason of the `CancelRollout` the deadline timer sends."""


class RolloutAdmitted(Event):
    """A rollout group was admitted: its task input, kept once for every sibling."""

    type: ClassVar[str] = "RolloutAdmitted"
    version: ClassVar[int] = 1
    group: str = Field(description="The task's idempotency key.")
    input: dict[str, Any] = Field(description="The immutable task input of every sibling.")


class RolloutUpdated(Event):
    """The group's document after a change (admission, a spawn, an end, a cancel)."""

    type: ClassVar[str] = "RolloutUpdated"
    version: ClassVar[int] = 1
    group: str = Field(description="The task's idempotency key.")
    doc: dict[str, Any] = Field(description="The group's whole state after the change.")


ROLLOUT_EVENTS: list[type[Event]] = [RolloutAdmitted, RolloutUpdated]


class RolloutSibling(BaseModel):
    """One sibling of a group: its run, and what it spent once it ended."""

    model_config = ConfigDict(frozen=True)
    run_id: RunId
    index: int
    state: Literal["running", "verified", "cancelled"]
    model_calls: int = 0
    tokens: int = 0
    cost_usd: float = 0.0


class RolloutGroup(ReadModel):
    """A rollout group's whole state, which ingest alone writes (`RolloutUpdated`). Keyed
    by the task's idempotency key.

    A group admitted before token or cost caps has none of their fields stored: it reads
    as uncapped, with nothing spent.
    """

    kind: ClassVar[str] = "rollout"
    task_id: TaskId
    workflow_id: WorkflowId
    workflow_version: WorkflowVersion
    spec: RolloutSpec
    admitted: int
    per_run: int
    """Model calls each sibling may make."""
    concurrency: int
    group_max_model_calls: int | None
    per_run_tokens: int | None = None
    group_max_tokens: int | None = None
    spent_tokens: int = 0
    per_run_cost_usd: float | None = None
    group_max_cost_usd: float | None = None
    spent_cost_usd: float = 0.0
    deadline_ms: float | None
    at_ms: int
    """When the task was submitted: sibling run ids derive from it."""
    origin: str
    """Id of the task's message: sibling run ids derive from it."""
    runs: list[RolloutSibling]
    spent: int
    """Model calls the ended siblings made."""
    peak: int
    cancelled: bool
    closed: bool
    reason: Literal["completed", "cancelled", "deadline"]
    detail: str
    candidates: list[PlannedCandidate] | None = None
    """A candidate matrix's candidates, in the order of their siblings' indexes (None:
    homogeneous siblings)."""
    estimate: MatrixEstimate | None = None
    """A candidate matrix's cost, declared at submission."""

    def sibling_ended(self, msg: RolloutProgress) -> RolloutGroup | None:
        """The group once the sibling `msg` reports on ended, its spend counted; None if
        that sibling is not running (a repeated report, or not one of the group's)."""
        sibling = next((r for r in self.runs if r.run_id == msg.run_id), None)
        if sibling is None or sibling.state != "running":
            return None
        spent = {"model_calls": msg.model_calls, "tokens": msg.tokens, "cost_usd": msg.cost_usd}
        ended = sibling.model_copy(update={"state": msg.ended, **spent})
        return self.model_copy(
            update={
                "runs": [ended if r is sibling else r for r in self.runs],
                "spent": self.spent + msg.model_calls,
                "spent_tokens": self.spent_tokens + msg.tokens,
                "spent_cost_usd": self.spent_cost_usd + msg.cost_usd,
            }
        )

    @property
    def next_run_id(self) -> RunId:
        """The run id of the group's next sibling."""
        return sibling_run_id(self.at_ms, self.origin, len(self.runs))

    @property
    def running(self) -> list[RolloutSibling]:
        """The siblings running now."""
        return [r for r in self.runs if r.state == "running"]

    def stopped(self, reason: Literal["cancelled", "deadline"], detail: str) -> RolloutGroup:
        """The group once nothing more may start."""
        return self.model_copy(update={"cancelled": True, "reason": reason, "detail": detail})


class RolloutInput(ReadModel):
    """The task input every sibling of a group runs on, as given. Keyed like the group."""

    model_config = ConfigDict(frozen=True, extra="allow")
    kind: ClassVar[str] = "rollout-input"

    @property
    def input(self) -> dict[str, Any]:
        """The input (the document is the input itself)."""
        return self.model_dump()


def fold_rollout(record: LogRecord) -> list[StateDelta]:
    """The group's document and its input."""
    t = record.key.tenant
    match record.event:
        case RolloutAdmitted() as e:
            return [RolloutInput.model_validate(e.input).put(t, e.group)]
        case RolloutUpdated() as e:
            return [Put(RolloutGroup.at(t, e.group), e.doc)]  # as recorded: older groups too
    return []


def may_spawn(group: RolloutGroup) -> bool:
    """Whether the group's next sibling may start: admitted, under the concurrency cap, and
    every group total still covers what is spent plus each running sibling's maximum plus its
    own (so no group cap is ever exceeded, whatever the running siblings go on to spend)."""
    if group.cancelled or group.closed or len(group.runs) >= group.admitted:
        return False
    running = len(group.running)
    if running >= group.concurrency:
        return False
    cap = group.group_max_model_calls
    if cap is not None and group.spent + (running + 1) * group.per_run > cap:
        return False
    tokens, per_run_tokens = group.group_max_tokens, group.per_run_tokens or 0
    if tokens is not None and group.spent_tokens + (running + 1) * per_run_tokens > tokens:
        return False
    cost, per_run_cost = group.group_max_cost_usd, group.per_run_cost_usd
    if cost is None or per_run_cost is None:
        return True
    # A float sum of costs drifts (twenty $0.01 siblings sum to 0.20000000000000004), which
    # would refuse the last sibling a cap of exact cents admits: spend counts to a nano-dollar.
    spent = _dollars(round(group.spent_cost_usd, 9))
    return spent + (running + 1) * _dollars(per_run_cost) <= _dollars(cost)


def admitted_within(spec: RolloutSpec, per_run_calls: int) -> int:
    """How many of the group's siblings its budget admits: at most `admit` of the `n`, and
    no more than each group total covers at its per-run maximum (a floor, never rounded up)."""
    budget = spec.budget
    admitted = spec.admit or spec.n
    if budget.group_max_model_calls is not None:
        admitted = min(admitted, budget.group_max_model_calls // per_run_calls)
    if budget.group_max_tokens is not None and budget.run_max_tokens is not None:
        admitted = min(admitted, budget.group_max_tokens // budget.run_max_tokens)
    if budget.group_max_cost_usd is not None and budget.run_max_cost_usd is not None:
        admitted = min(admitted, _times_within(budget.group_max_cost_usd, budget.run_max_cost_usd))
    return admitted


def _times_within(total: float, each: float) -> int:
    """The most k with k * each <= total, in decimal: $0.30 holds three $0.10 siblings."""
    return int(_dollars(total) // _dollars(each))


def _dollars(amount: float) -> Decimal:
    """An amount as written (`repr`), so that sums of caps are exact: 3 * 0.1 is 0.3."""
    return Decimal(repr(amount))


async def admit(
    uow: IngestUnitOfWork, msg: TaskSubmitted, task_id: TaskId, alloc: Allocation
) -> None:
    """Admit the task's group and start its first siblings."""
    spec = msg.rollout
    assert spec is not None
    if await uow.get(RolloutGroup, msg.idempotency_key) is not None:
        return  # a resubmission: the first one stands
    version = alloc.current
    budget = spec.budget
    at_ms = int(uow.envelope.occurred_at.timestamp() * 1000)
    matrix: AdmittedMatrix | None = None
    if spec.candidates is not None:  # admitted whole, or `Refused` naming a candidate
        run_id_of = functools.partial(sibling_run_id, at_ms, uow.envelope.id)
        matrix = await admit_matrix(uow, msg, alloc, run_id_of)
        per_run, admitted = matrix.per_run, matrix.siblings
    else:
        per_run = WorkflowDef.model_validate(alloc.definitions[version]).budget.max_model_calls
        if budget.run_max_model_calls is not None:
            per_run = min(per_run, budget.run_max_model_calls)
        admitted = admitted_within(spec, per_run)
    group = RolloutGroup(
        task_id=task_id,
        workflow_id=msg.workflow_id,
        workflow_version=version,
        spec=spec,
        admitted=admitted,
        per_run=per_run,
        concurrency=budget.max_concurrency or max(admitted, 1),
        group_max_model_calls=budget.group_max_model_calls,
        per_run_tokens=budget.run_max_tokens,
        group_max_tokens=budget.group_max_tokens,
        per_run_cost_usd=budget.run_max_cost_usd,
        group_max_cost_usd=budget.group_max_cost_usd,
        deadline_ms=None if budget.deadline_s is None else at_ms + budget.deadline_s * 1000,
        at_ms=at_ms,
        origin=uow.envelope.id,
        runs=[],
        spent=0,
        peak=0,
        cancelled=False,
        closed=False,
        reason="completed",
        detail="",
        candidates=None if matrix is None else matrix.candidates,
        estimate=None if matrix is None else matrix.estimate,
    )
    key = BranchKey.main(uow.tenant, f"rollout:{msg.idempotency_key}")
    uow.record(key, RolloutAdmitted(group=msg.idempotency_key, input=msg.input))
    await _advance(
        uow, msg.idempotency_key, group, msg.input, None if matrix is None else matrix.matrix
    )


async def on_rollout_progress(msg: RolloutProgress, uow: IngestUnitOfWork) -> None:
    """A sibling ended: count what it spent, start the next, close when all is done."""
    group = await uow.get(RolloutGroup, msg.idempotency_key)
    group = None if group is None else group.sibling_ended(msg)
    if group is None:
        return  # not a group of this tenant's, or a repeated report
    uow.deps.admission.release(str(msg.run_id))  # it ended: its KV is free for the next
    task_input = await uow.get(RolloutInput, msg.idempotency_key)
    await _advance(uow, msg.idempotency_key, group, {} if task_input is None else task_input.input)


async def on_cancel_rollout(msg: CancelRollout, uow: IngestUnitOfWork) -> None:
    """Stop the group: nothing more starts; running siblings are cancelled."""
    group = await uow.get(RolloutGroup, msg.idempotency_key)
    if group is None or group.closed or group.cancelled:
        return
    if msg.reason == DEADLINE:
        group = group.stopped("deadline", "the group's deadline passed")
    else:
        group = group.stopped("cancelled", msg.reason or "cancelled")
    _cancel_running(uow, msg.idempotency_key, group)
    await _advance(uow, msg.idempotency_key, group, {})


def _cancel_running(uow: IngestUnitOfWork, key: str, group: RolloutGroup) -> None:
    for sibling in group.running:
        reason = f"rollout group {key} stopped: {group.detail}"
        uow.emit(RUN_COMMANDS, CancelRun(tenant=uow.tenant, run_id=sibling.run_id, reason=reason))


async def _advance(
    uow: IngestUnitOfWork,
    key: str,
    group: RolloutGroup,
    task_input: dict[str, Any],
    admitted: RolloutMatrix | None = None,
) -> None:
    """Start what may start, close what is done, and record the group (`admitted`: its
    candidate matrix, in the commit that admits it)."""
    due = group.deadline_ms
    if due is not None and time.time() * 1000 >= due and not group.cancelled:
        # Past the deadline nothing more starts; the timer cancels what still runs.
        group = group.stopped("deadline", "the group's deadline passed")
        _cancel_running(uow, key, group)
    refused: str | None = None
    while may_spawn(group):
        matrix = group.candidates is not None
        plan = await sibling_plan(
            uow, key, group.workflow_version, len(group.runs), matrix, admitted
        )
        refused = _refused(uow, group, plan.workflow)
        if refused is not None:
            break
        group = _spawn(uow, key, group, plan, task_input)
    if not group.running and not group.closed:
        group = _close(uow, key, group, refused)
    updated = RolloutUpdated(group=key, doc=group.model_dump(mode="json"))
    uow.record(BranchKey.main(uow.tenant, f"rollout:{key}"), updated)


def _refused(uow: IngestUnitOfWork, group: RolloutGroup, workflow: WorkflowDef) -> str | None:
    """Hold the next sibling's demand against the declared capacity (§14.2; let go if `uow`
    is discarded); why not, if it does not fit beside the runs in flight."""
    admission, run = uow.deps.admission, str(group.next_run_id)
    why = admission.admit(run, workflow, uow)
    if why is None:
        uow.on_discard(functools.partial(admission.release, run))
    return why


def _close(
    uow: IngestUnitOfWork, key: str, group: RolloutGroup, refused: str | None
) -> RolloutGroup:
    """Close a group with nothing running and nothing more to start; tell the tournament."""
    detail = group.detail
    if refused is not None:
        detail = f"the declared capacity admits no further sibling: {refused}"
    elif not group.cancelled and len(group.runs) < group.admitted:
        detail = "the group's budget admits no further sibling"
    group = group.model_copy(update={"closed": True, "detail": detail})
    uow.emit(VERIFIED, _closed(uow.tenant, key, group))
    if group.candidates is not None:
        release_unstarted(uow, group.at_ms, group.origin, len(group.runs), group.admitted)
    return group


def _spawn(
    uow: IngestUnitOfWork,
    key: str,
    group: RolloutGroup,
    plan: SiblingPlan,
    task_input: dict[str, Any],
) -> RolloutGroup:
    """Start the group's next sibling; the group with it running."""
    index, run_id = len(group.runs), group.next_run_id
    ref = RunRef(
        tenant=uow.tenant,
        run_id=run_id,
        task_id=group.task_id,
        idempotency_key=key,
        workflow_id=plan.workflow.id,
        workflow_version=plan.workflow.version,
        role=plan.role,
        purpose=plan.purpose,
        baseline_version=plan.baseline,
        rollout=RolloutRef(
            group=key,
            index=index,
            size=group.admitted,
            mode=group.spec.mode,
            max_model_calls=min(group.per_run, plan.max_model_calls),
            max_tokens=group.per_run_tokens,
            max_cost_usd=group.per_run_cost_usd,
        ),
    )
    spawned = RunSpawned(
        run=ref, definition=plan.definition, input=task_input, subworkflows=plan.children
    )
    uow.emit(RUNS, spawned)
    uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.SCHEDULED))
    runs = [*group.runs, RolloutSibling(run_id=run_id, index=index, state="running")]
    grown = group.model_copy(update={"runs": runs})
    return grown.model_copy(update={"peak": max(group.peak, len(grown.running))})


def _closed(tenant: TenantId, key: str, group: RolloutGroup) -> RolloutClosed:
    return RolloutClosed(
        tenant=tenant,
        task_id=group.task_id,
        idempotency_key=key,
        workflow_id=group.workflow_id,
        workflow_version=group.workflow_version,
        spec=group.spec,
        admitted=group.admitted,
        runs=[r.run_id for r in group.runs],
        cancelled=[r.run_id for r in group.runs if r.state == "cancelled"],
        reason=group.reason,
        detail=group.detail,
        model_calls=group.spent,
        tokens=group.spent_tokens,
        cost_usd=group.spent_cost_usd,
        peak_concurrency=group.peak,
        candidates=group.candidates,
        estimate=group.estimate,
    )


def rollout_due(tenant: TenantId, key: str, doc: dict[str, Any], now_ms: float) -> Fired | None:
    """An open group whose deadline passed sends itself its `CancelRollout`."""
    group = RolloutGroup.model_validate(doc)
    due = group.deadline_ms
    if due is None or due > now_ms or group.closed or group.cancelled:
        return None
    cancel = CancelRollout(tenant=tenant, idempotency_key=key, reason=DEADLINE)
    return TASKS, cancel, f"rollout-deadline:{key}"
