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
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any, ClassVar

from pydantic import Field

from assay.bus.topics import RUN_COMMANDS, RUN_STATUS, RUNS, TASKS, VERIFIED
from assay.kernel import RunId, RunState, TaskId, TenantId, WorkflowVersion, run_id_from
from assay.messages import (
    CancelRollout,
    CancelRun,
    Purpose,
    Role,
    RolloutClosed,
    RolloutProgress,
    RolloutRef,
    RolloutSpec,
    RunRef,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
)
from assay.record import BranchKey, Event, LogRecord, Put, StateDelta, StateKey
from assay.runtime import UnitOfWork
from assay.runtime.admission import Admission
from assay.runtime.timers import Fired
from assay.workflow import WorkflowDef

DEADLINE = "deadline"
"""The reason of the `CancelRollout` the deadline timer sends."""

Resolver = Callable[[UnitOfWork[Any], WorkflowDef], Awaitable[dict[str, dict[str, Any]]]]
"""Pins the sub-workflows a definition calls (ingest's `_resolve`)."""


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


def fold_rollout(record: LogRecord) -> list[StateDelta]:
    """The group's document and its input."""
    t = record.key.tenant
    match record.event:
        case RolloutAdmitted() as e:
            return [Put(StateKey(t, "rollout-input", e.group), e.input)]
        case RolloutUpdated() as e:
            return [Put(StateKey(t, "rollout", e.group), e.doc)]
    return []


def _running(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["runs"] if r["state"] == "running"]


def _next_run_id(doc: dict[str, Any]) -> RunId:
    """The run id of the group's next sibling."""
    return run_id_from(int(doc["at_ms"]), f"{doc['origin']}:rollout:{len(doc['runs'])}")


def may_spawn(doc: dict[str, Any]) -> bool:
    """Whether the group's next sibling may start: admitted, under the concurrency cap, and
    every group total still covers what is spent plus each running sibling's maximum plus its
    own (so no group cap is ever exceeded, whatever the running siblings go on to spend)."""
    if doc["cancelled"] or doc["closed"] or len(doc["runs"]) >= doc["admitted"]:
        return False
    running = len(_running(doc))
    if running >= doc["concurrency"]:
        return False
    cap = doc["group_max_model_calls"]
    if cap is not None and doc["spent"] + (running + 1) * doc["per_run"] > cap:
        return False
    tokens = doc.get("group_max_tokens")
    if tokens is not None and doc["spent_tokens"] + (running + 1) * doc["per_run_tokens"] > tokens:
        return False
    cost = doc.get("group_max_cost_usd")
    if cost is None:
        return True
    per_run = _dollars(doc["per_run_cost_usd"])
    return _dollars(doc["spent_cost_usd"]) + (running + 1) * per_run <= _dollars(cost)


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


class Rollouts:
    """Ingest's rollout handlers: admission, progress, cancellation and the deadline timer."""

    def __init__(self, resolve: Resolver, admission: Admission | None = None) -> None:
        self.resolve = resolve
        self.admission = Admission(None) if admission is None else admission
        """§14.2: each sibling's demand is held against the declared capacity; one that
        does not fit is not started, and a group with nothing running closes."""

    async def admit(
        self, uow: UnitOfWork[Any], msg: TaskSubmitted, task_id: TaskId, alloc: dict[str, Any]
    ) -> None:
        """Admit the task's group and start its first siblings."""
        spec = msg.rollout
        assert spec is not None
        if await uow.get_document("rollout", msg.idempotency_key) is not None:
            return  # a resubmission: the first one stands
        version = str(alloc["current"])
        definition = WorkflowDef.model_validate(alloc["definitions"][version])
        budget = spec.budget
        per_run = definition.budget.max_model_calls
        if budget.run_max_model_calls is not None:
            per_run = min(per_run, budget.run_max_model_calls)
        admitted = admitted_within(spec, per_run)
        at_ms = int(uow.envelope.occurred_at.timestamp() * 1000)
        doc: dict[str, Any] = {
            "task_id": task_id,
            "workflow_id": msg.workflow_id,
            "workflow_version": version,
            "spec": spec.model_dump(mode="json"),
            "admitted": admitted,
            "per_run": per_run,
            "concurrency": budget.max_concurrency or max(admitted, 1),
            "group_max_model_calls": budget.group_max_model_calls,
            "per_run_tokens": budget.run_max_tokens,
            "group_max_tokens": budget.group_max_tokens,
            "spent_tokens": 0,
            "per_run_cost_usd": budget.run_max_cost_usd,
            "group_max_cost_usd": budget.group_max_cost_usd,
            "spent_cost_usd": 0.0,
            "deadline_ms": None if budget.deadline_s is None else at_ms + budget.deadline_s * 1000,
            "at_ms": at_ms,
            "origin": uow.envelope.id,
            "runs": [],
            "spent": 0,
            "peak": 0,
            "cancelled": False,
            "closed": False,
            "reason": "completed",
            "detail": "",
        }
        key = BranchKey.main(uow.tenant, f"rollout:{msg.idempotency_key}")
        uow.record(key, RolloutAdmitted(group=msg.idempotency_key, input=msg.input))
        await self._advance(uow, msg.idempotency_key, doc, msg.input)

    async def on_progress(self, msg: RolloutProgress, uow: UnitOfWork[Any]) -> None:
        """A sibling ended: count its calls, start the next, close when all is done."""
        doc = await uow.get_document("rollout", msg.idempotency_key)
        if doc is None:
            return  # not a group of this tenant's: nothing to advance
        sibling = next((r for r in doc["runs"] if r["run_id"] == msg.run_id), None)
        if sibling is None or sibling["state"] != "running":
            return  # a repeated report
        self.admission.release(str(msg.run_id))  # it ended: its KV is free for the next
        sibling.update(
            state=msg.ended, model_calls=msg.model_calls, tokens=msg.tokens, cost_usd=msg.cost_usd
        )
        doc["spent"] += msg.model_calls
        doc["spent_tokens"] += msg.tokens
        # A group admitted before cost caps has no such key: its spend starts counting here.
        doc["spent_cost_usd"] = doc.get("spent_cost_usd", 0.0) + msg.cost_usd
        task_input = await uow.get_document("rollout-input", msg.idempotency_key) or {}
        await self._advance(uow, msg.idempotency_key, doc, task_input)

    async def on_cancel(self, msg: CancelRollout, uow: UnitOfWork[Any]) -> None:
        """Stop the group: nothing more starts; running siblings are cancelled."""
        doc = await uow.get_document("rollout", msg.idempotency_key)
        if doc is None or doc["closed"] or doc["cancelled"]:
            return
        deadline = msg.reason == DEADLINE
        doc.update(
            cancelled=True,
            reason="deadline" if deadline else "cancelled",
            detail="the group's deadline passed" if deadline else msg.reason or "cancelled",
        )
        for sibling in _running(doc):
            uow.emit(RUN_COMMANDS, self._cancel(uow.tenant, msg.idempotency_key, sibling, doc))
        await self._advance(uow, msg.idempotency_key, doc, {})

    @staticmethod
    def _cancel(
        tenant: TenantId, group: str, sibling: dict[str, Any], doc: dict[str, Any]
    ) -> CancelRun:
        return CancelRun(
            tenant=tenant,
            run_id=RunId(sibling["run_id"]),
            reason=f"rollout group {group} stopped: {doc['detail']}",
        )

    async def _advance(
        self, uow: UnitOfWork[Any], group: str, doc: dict[str, Any], task_input: dict[str, Any]
    ) -> None:
        """Start what may start, close what is done, and record the document."""
        spec = RolloutSpec.model_validate(doc["spec"])
        due = doc["deadline_ms"]
        if due is not None and time.time() * 1000 >= due and not doc["cancelled"]:
            # Past the deadline nothing more starts; the timer cancels what still runs.
            doc.update(cancelled=True, reason="deadline", detail="the group's deadline passed")
            for sibling in _running(doc):
                uow.emit(RUN_COMMANDS, self._cancel(uow.tenant, group, sibling, doc))
        stored: dict[str, Any] | None = None
        refused: str | None = None
        while may_spawn(doc):
            if stored is None:
                stored = await uow.get_document("definition", doc["workflow_version"])
                assert stored is not None, "a routed version is always stored"
            refused = self._refused(uow, doc, stored["definition"])
            if refused is not None:
                break
            await self._spawn(uow, group, doc, spec, stored["definition"], task_input)
        if not _running(doc) and not doc["closed"]:
            doc["closed"] = True
            if refused is not None:
                doc["detail"] = f"the declared capacity admits no further sibling: {refused}"
            elif not doc["cancelled"] and len(doc["runs"]) < doc["admitted"]:
                doc["detail"] = "the group's budget admits no further sibling"
            uow.emit(VERIFIED, self._closed(uow.tenant, group, doc, spec))
        uow.record(
            BranchKey.main(uow.tenant, f"rollout:{group}"), RolloutUpdated(group=group, doc=doc)
        )

    def _refused(
        self, uow: UnitOfWork[Any], doc: dict[str, Any], pinned: dict[str, Any]
    ) -> str | None:
        """Hold the next sibling's demand (let go if `uow` is discarded); why not, if it
        does not fit beside the runs in flight."""
        run = str(_next_run_id(doc))
        why = self.admission.admit(run, WorkflowDef.model_validate(pinned))
        if why is None:
            uow.on_discard(functools.partial(self.admission.release, run))
        return why

    async def _spawn(
        self,
        uow: UnitOfWork[Any],
        group: str,
        doc: dict[str, Any],
        spec: RolloutSpec,
        pinned: dict[str, Any],
        task_input: dict[str, Any],
    ) -> None:
        definition = WorkflowDef.model_validate(pinned)
        index = len(doc["runs"])
        run_id = _next_run_id(doc)
        ref = RunRef(
            tenant=uow.tenant,
            run_id=run_id,
            task_id=TaskId(doc["task_id"]),
            idempotency_key=group,
            workflow_id=definition.id,
            workflow_version=WorkflowVersion(doc["workflow_version"]),
            role=Role.CURRENT,
            purpose=Purpose.WORK,
            rollout=RolloutRef(
                group=group,
                index=index,
                size=doc["admitted"],
                mode=spec.mode,
                max_model_calls=doc["per_run"],
                max_tokens=doc["per_run_tokens"],
                max_cost_usd=doc.get("per_run_cost_usd"),
            ),
        )
        children = await self.resolve(uow, definition)
        uow.emit(
            RUNS,
            RunSpawned(
                run=ref,
                definition=pinned,
                input=task_input,
                subworkflows=children,
            ),
        )
        uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.SCHEDULED))
        doc["runs"].append(
            {
                "run_id": run_id,
                "index": index,
                "state": "running",
                "model_calls": 0,
                "tokens": 0,
                "cost_usd": 0.0,
            }
        )
        doc["peak"] = max(doc["peak"], len(_running(doc)))

    @staticmethod
    def _closed(
        tenant: TenantId, group: str, doc: dict[str, Any], spec: RolloutSpec
    ) -> RolloutClosed:
        return RolloutClosed(
            tenant=tenant,
            task_id=TaskId(doc["task_id"]),
            idempotency_key=group,
            workflow_id=doc["workflow_id"],
            workflow_version=WorkflowVersion(doc["workflow_version"]),
            spec=spec,
            admitted=doc["admitted"],
            runs=[RunId(r["run_id"]) for r in doc["runs"]],
            cancelled=[RunId(r["run_id"]) for r in doc["runs"] if r["state"] == "cancelled"],
            reason=doc["reason"],
            detail=doc["detail"],
            model_calls=doc["spent"],
            tokens=doc["spent_tokens"],
            cost_usd=doc.get("spent_cost_usd", 0.0),
            peak_concurrency=doc["peak"],
        )

    @staticmethod
    def deadline(tenant: TenantId, group: str, doc: dict[str, Any], now_ms: float) -> Fired | None:
        """An open group whose deadline passed sends itself its `CancelRollout`."""
        due = doc.get("deadline_ms")
        if due is None or due > now_ms or doc["closed"] or doc["cancelled"]:
            return None
        cancel = CancelRollout(tenant=tenant, idempotency_key=group, reason=DEADLINE)
        return TASKS, cancel, f"rollout-deadline:{group}"
