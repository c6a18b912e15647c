"""Admission by capacity, not backpressure (§14.2): a run that cannot fit the declared
VRAM beside what is in flight is refused when its task arrives, never queued.

`Admission` is what ingest asks. At registration, a workflow's model and its grading
strategy's models must fit resident together (`check_workflow`); at admission, a run's
demand — its model, its largest context per call, its concurrent calls — is held
against the residency invariant with every run admitted before it (`admit`), and let
go when the run stops executing (`on_run_status`). Without a declared capacity every
check passes.

The ledger is the process's: in distributed mode each ingest replica holds what it
admitted, so the invariant is exact with one ingest replica; after a restart, runs
admitted before it are no longer held.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import TYPE_CHECKING, Any

from assay.bus.topics import RUN_STATUS
from assay.grading.strategies import ResourceProfile
from assay.kernel.capacity import CapacityExceeded, CapacityInvalid, CapacityLedger, Demand
from assay.kernel.lifecycle import RunState
from assay.messages import RunStatusChanged
from assay.runtime.capacity_plan import CapacityPlan
from assay.workflow.ir import WorkflowDef

if TYPE_CHECKING:
    from assay.runtime.stage import Gauge, UnitOfWork

__all__ = ["Admission", "CapacityRefused"]

HOLDING = frozenset({RunState.SCHEDULED, RunState.RUNNING})
"""States in which a run may still make model calls: its KV stays held."""


class CapacityRefused(Exception):
    """A workflow whose models or whose runs cannot fit the declared capacity."""


class Admission:
    """Capacity checks at registration and admission (see the module's docstring).

    Args:
        plan: the declared capacity's plan (None: nothing declared, everything fits).
        default_context_tokens: context per call of a workflow that declares none.
    """

    def __init__(self, plan: CapacityPlan | None, default_context_tokens: int = 8192) -> None:
        self.plan = plan
        self.default_context_tokens = default_context_tokens
        self.ledger = None if plan is None else CapacityLedger(plan.capacity)
        if self.ledger is not None and plan is not None:
            self.ledger.make_resident(*plan.resident)
        self.refused: Counter[str] = Counter()
        """Refused admissions since start, by reason (`capacity_<limit>`, `replay_budget`)."""

    def demand(self, wf: WorkflowDef) -> Demand | None:
        """What one run of `wf` holds at its peak (None: no capacity declared, or a
        stub agent that needs no VRAM and a workflow naming no model)."""
        if self.plan is None:
            return None
        spec = wf.resources
        model = spec.model if spec is not None and spec.model else self.plan.agent_model
        if model is None:
            return None
        calls = spec.concurrent_calls if spec and spec.concurrent_calls else None
        return Demand(
            model,
            context_tokens=self.context_tokens(wf),
            concurrent_calls=calls or wf.model_call_width(),
        )

    def context_tokens(self, wf: WorkflowDef) -> int:
        """The largest context (prompt and answer) of one of `wf`'s model calls: its
        `resources.max_context_tokens`, else the deployment's default."""
        spec = wf.resources
        declared = spec.max_context_tokens if spec is not None else None
        return declared or self.default_context_tokens

    def check_workflow(self, wf: WorkflowDef, grading: ResourceProfile) -> None:
        """Refuse a workflow whose model and grading models cannot be resident together
        with the resident ones (never swapped per call), or one run of which cannot fit
        even alone. The check is of the deployment, not of the moment: runs in flight do
        not refuse a registration; the models become resident now if they fit beside
        them, else at their first admission.

        Raises:
            CapacityRefused: the reason names the model or the limit and the numbers.
        """
        if self.ledger is None or self.plan is None:
            return
        capacity = self.ledger.capacity
        demand = self.demand(wf)
        # a stub judge (no judge model served) needs no VRAM
        judges = grading.models if self.plan.judge_model is not None else ()
        models = [*((demand.model,) if demand else ()), *judges]
        try:
            resident = capacity.resident_with(*self.ledger.resident, *models)
            one_run = (
                {}
                if demand is None
                else {demand.model: demand.kv_bytes(capacity.profile(demand.model))}
            )
            capacity.check(resident, one_run)
            for judge in judges:
                ceiling = capacity.max_context_tokens(judge, resident)
                if grading.max_context_tokens > ceiling:
                    raise CapacityExceeded(
                        "max_context_tokens",
                        f"grading strategy {grading.strategy!r} asks for "
                        f"{grading.max_context_tokens} tokens per call of {judge!r}; its "
                        f"derived ceiling is {ceiling}",
                    )
        except (CapacityExceeded, CapacityInvalid) as exc:
            raise CapacityRefused(f"it does not fit the declared capacity: {exc}") from exc
        with contextlib.suppress(CapacityExceeded):
            self.ledger.make_resident(*models)

    def admit(self, run: str, wf: WorkflowDef, uow: UnitOfWork[Any]) -> str | None:
        """Hold one run of `wf` under `run`'s id if it fits; why not, if it does not (the
        refusal is counted once `uow` commits it). A run already held is admitted again
        without holding twice."""
        demand = self.demand(wf)
        if self.ledger is None or demand is None:
            return None
        try:
            refusal = self.ledger.admit(run, demand)
        except CapacityInvalid as exc:
            refusal = CapacityExceeded("model", str(exc))
        if refusal is None:
            return None
        uow.on_landed(functools.partial(self._count, f"capacity_{refusal.limit}", 1))
        return (
            f"capacity: a run of {wf.id!r} needs {demand.concurrent_calls} call(s) of "
            f"{demand.context_tokens} tokens on {demand.model!r} and does not fit beside the "
            f"{self.ledger.held} run(s) in flight: {refusal}"
        )

    def count_budget_cuts(self, cuts: int, uow: UnitOfWork[Any]) -> None:
        """Count runs the replay budget cut at admission, beside the capacity refusals,
        once `uow` commits them."""
        if cuts:
            uow.on_landed(functools.partial(self._count, "replay_budget", cuts))

    def _count(self, reason: str, n: int) -> None:
        self.refused[reason] += n

    def release(self, run: str) -> None:
        """Let go of what `run` was admitted with."""
        if self.ledger is not None:
            self.ledger.release(run)

    async def on_run_status(self, msg: RunStatusChanged, uow: object) -> None:
        """A handler of `assay.run-status`: a run no longer executing lets its KV go."""
        if msg.state not in HOLDING:
            self.release(str(msg.run.run_id))

    def handlers(self) -> dict[str, dict[str, Any]]:
        """What ingest must also consume: `assay.run-status`, to let KV go — only with a
        declared capacity (without one there is nothing to let go)."""
        if self.ledger is None:
            return {}
        return {RUN_STATUS: {RunStatusChanged.type: self.on_run_status}}

    def gauges(self) -> list[Gauge]:
        """Refusals by reason and the KV held now, for `/metrics`."""
        from assay.runtime.stage import Gauge

        refused = tuple(((reason,), float(n)) for reason, n in sorted(self.refused.items()))
        out = [
            Gauge(
                "assay_admission_refusals",
                "Runs refused at admission since start, by reason: capacity_<limit> (the "
                "residency invariant; a refused work run's task counts once) apart from "
                "replay_budget (the tenant's spend ceiling).",
                ("reason",),
                refused,
            )
        ]
        if self.ledger is not None:
            held = tuple(((m,), float(b)) for m, b in sorted(self.ledger.kv_in_flight().items()))
            out.append(
                Gauge(
                    "assay_capacity_kv_bytes_held",
                    "KV bytes the runs admitted and still executing may hold, per model.",
                    ("model",),
                    held,
                )
            )
        return out
