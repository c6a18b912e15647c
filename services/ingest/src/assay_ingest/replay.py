"""Replay's spend ceiling at admission (§12.4, §14.1; `assay.grading.replay`).

Every shadow run a task's route plans reserves its worst case against the tenant's
replay meter for the UTC day the task arrived: its workflow's model-call budget,
each call its largest context, priced at the agent model's higher per-token price
(`worst_run`). One that does not fit under every unit of the tenant's ceiling
(calls, tokens, dollars) is cut: never spawned, recorded in
`TaskAccepted.cut` with its reason, and announced as `Cancelled` on
`assay.run-status`, so it is never a silent gap and never evidence either way. A
challenger run whose reference run was cut is spawned not expecting one.

The tenant's meter is one stream, compare-and-swapped in the commit that spawns
the runs: two tasks of a tenant handled at once on different partitions never
reserve the same calls, and a redelivered task (the same message, or the same
idempotency key) never reserves again.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from assay.bus.topics import RUN_STATUS
from assay.engine.models import Prices
from assay.grading.replay import METER_STREAM, ReplayPolicy, admit, meter_of, reserved_today
from assay.kernel import Lsn, RunId, RunState, WorkflowVersion
from assay.kernel.spend import MICRO, Spend, SpendLimit, worst_case
from assay.messages import Purpose, Role, RunRef, RunStatusChanged
from assay.record import BranchKey, Event, LogRecord, ReadModel, StateDelta
from assay.runtime import Gauge, UnitOfWork
from assay.runtime.admission import Admission
from assay.store import EventLog
from assay.workflow import WorkflowDef
from assay_ingest.routing import PlannedRun, Route


class CutReason(enum.Enum):
    """Why a planned run was not spawned."""

    REPLAY_BUDGET_EXHAUSTED = "replay_budget_exhausted"
    """A shadow run whose budget did not fit under the tenant's replay ceiling that day."""
    CAPACITY = "capacity"
    """A run whose demand did not fit the declared GPU capacity beside those in flight
    (§14.2); a work run refused so takes its task's other runs with it."""


class CutRun(BaseModel):
    """A run planned for a task and not spawned (part of `TaskAccepted` v3)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    run_id: RunId = Field(description="The run id it would have had.")
    workflow_version: WorkflowVersion = Field(description="Version it would have run.")
    role: Role = Field(description="Current or challenger.")
    purpose: Purpose = Field(description="Shadow, or work when capacity refused the task.")
    reason: CutReason = Field(description="Why it was cut.")
    calls: int = Field(ge=0, description="Model calls it would have reserved (its budget).")
    detail: str = Field(
        "",
        description="Why, with the numbers (capacity refusals; replay cuts since tokens "
        "and dollars are reserved too).",
    )


class ReplayMetered(Event):
    """The tenant's replay meter after a task's shadow runs reserved (or were cut),
    recorded in the commit that spawns them."""

    type: ClassVar[str] = "ReplayMetered"
    version: ClassVar[int] = 1
    meter: dict[str, Any] = Field(
        description=(
            "`day` (UTC), what the runs admitted that day reserved (`calls_today`, "
            "`tokens_today`, `micro_usd_today`: their worst cases), `runs_today` (admitted), "
            "`cut_today`, and the same since the meter began (`*_total`). A meter recorded "
            "before tokens and dollars were reserved has none: they read as zero."
        )
    )


REPLAY_EVENTS = (ReplayMetered,)

METER_KEY = "replay"
"""The key of a tenant's one replay meter document."""


_METERED_LATER = ("tokens_today", "micro_usd_today", "tokens_total", "micro_usd_total")
"""The counts a meter has only since replay reserved tokens and dollars."""


class ReplayMeter(ReadModel):
    """A tenant's replay meter (`assay.grading.replay.meter_of`) as its last reservation
    left it, and where its stream ends. Keyed `replay`."""

    kind: ClassVar[str] = "meter"
    day: str
    """The UTC day the `*_today` counts are of."""
    calls_today: int
    tokens_today: int | None = None
    micro_usd_today: int | None = None
    runs_today: int
    cut_today: int
    calls_total: int
    tokens_total: int | None = None
    micro_usd_total: int | None = None
    runs_total: int
    cut_total: int
    next: Lsn
    """What the next reservation's compare-and-swap expects the stream to end at."""

    @model_serializer(mode="wrap")
    def _omit_unmetered(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A meter recorded before tokens and dollars were reserved has no such counts,
        and its document stays as it was folded then (`rebuild --check` compares)."""
        doc: dict[str, Any] = handler(self)
        return {k: v for k, v in doc.items() if k not in _METERED_LATER or v is not None}

    def counts(self) -> dict[str, Any]:
        """The meter's counts, as `meter_of` and `admit` take them (none metered: 0)."""
        doc = self.model_dump(exclude={"next"})
        return {**doc, **{k: doc.get(k) or 0 for k in _METERED_LATER}}

    def on(self, day: str) -> ReplayMeter:
        """This meter as of `day` (UTC): a new day starts today's counts at zero."""
        return self.model_copy(update=meter_of(day, self.counts()))


def fold_replay(record: LogRecord) -> list[StateDelta]:
    """The tenant's replay meter, with where its stream ends."""
    match record.event:
        case ReplayMetered(meter=m):
            meter = ReplayMeter.model_validate({**m, "next": record.lsn + 1})
            return [meter.put(record.key.tenant, METER_KEY)]
    return []


@dataclasses.dataclass(frozen=True)
class Metered:
    """A route after the replay ceiling: the runs to spawn, those cut, and the calls the
    spawned shadow runs reserved."""

    plan: Route
    cut: tuple[CutRun, ...]
    reserved: int


def worst_run(definition: WorkflowDef, calls: int, admission: Admission, prices: Prices) -> Spend:
    """What one run of `definition` may spend at most, making `calls` model calls: each
    of its largest context (`resources.max_context_tokens`, else the deployment's
    default), every token at the higher of `prices`' two (`assay.kernel.spend.worst_case`,
    as a judge call is reserved). A step calling another model is priced as the agent's.
    """
    return worst_case(calls, admission.context_tokens(definition), prices.worst_per_mtok)


def no_room(worst: Spend, meter: dict[str, Any], limit: SpendLimit, *, whose: str = "its") -> str:
    """Why a run's worst case (or `whose`: several runs' together) does not fit under the
    tenant's replay ceiling, in numbers."""
    return (
        f"{whose} worst case ({_amount(worst)}) does not fit under the tenant's replay ceiling "
        f"of {limit.describe()} a day ({_amount(reserved_today(meter))} reserved today)"
    )


def _amount(spend: Spend) -> str:
    return f"{spend.calls} calls, {spend.tokens} tokens, ${spend.micro_usd / MICRO:.6f}"


async def metered(
    uow: UnitOfWork[Any],
    policy: ReplayPolicy,
    plan: Route,
    definitions: dict[str, Any],
    run_id_of: Callable[[PlannedRun], RunId],
    admission: Admission,
    prices: Prices,
) -> Metered:
    """Reserve each planned shadow run's worst case, cutting those that do not fit.

    A plan without shadow runs leaves the meter alone: work runs are never metered.
    """
    if not any(p.purpose is Purpose.SHADOW for p in plan.runs):
        return Metered(plan, (), 0)
    doc = await uow.get(ReplayMeter, METER_KEY)
    head = Lsn(0) if doc is None else doc.next
    today = uow.envelope.occurred_at.date().isoformat()
    meter = meter_of(today, None if doc is None else doc.counts())
    limit = policy.limit_for(str(uow.tenant))
    kept: list[PlannedRun] = []
    cut: list[CutRun] = []
    reserved = 0
    for planned in plan.runs:
        if planned.purpose is not Purpose.SHADOW:
            kept.append(planned)
            continue
        definition = WorkflowDef.model_validate(definitions[planned.version])
        calls = definition.budget.max_model_calls
        worst = worst_run(definition, calls, admission, prices)
        why = no_room(worst, meter, limit)  # as it stands before this run reserves
        if admit(meter, worst, limit):
            kept.append(planned)
            reserved += calls
            continue
        cut.append(
            CutRun(
                run_id=run_id_of(planned),
                workflow_version=planned.version,
                role=planned.role,
                purpose=planned.purpose,
                reason=CutReason.REPLAY_BUDGET_EXHAUSTED,
                calls=calls,
                detail=why,
            )
        )
    key = BranchKey.main(uow.tenant, METER_STREAM)
    uow.expect(key, head)  # another task of the tenant reserved first: read it again
    uow.record(key, ReplayMetered(meter=meter))
    return Metered(dataclasses.replace(plan, runs=tuple(kept)), tuple(cut), reserved)


def announce_cut(uow: UnitOfWork[Any], gone: CutRun, like: RunRef) -> None:
    """Tell observers a cut run ended before it began (`like`: the task's run reference,
    whose identity the cut run would have shared)."""
    ref = like.model_copy(
        update={
            "run_id": gone.run_id,
            "workflow_version": gone.workflow_version,
            "role": gone.role,
            "purpose": gone.purpose,
            "baseline_version": like.baseline_version if gone.role is Role.CHALLENGER else None,
            "reference_expected": False,
        }
    )
    detail = f"{gone.reason.value}: not run; {gone.detail}"
    uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.CANCELLED, detail=detail))


async def replay_gauges(log: EventLog, policy: ReplayPolicy, today: str) -> list[Gauge]:
    """Each tenant's replay meter for `today` (UTC) — calls, tokens and dollars reserved,
    shadow runs admitted and cut — and its ceilings."""
    reserved: dict[str, list[tuple[tuple[str, ...], float]]] = {u: [] for u in _UNITS}
    ceilings: dict[str, list[tuple[tuple[str, ...], float]]] = {u: [] for u in _UNITS}
    runs: list[tuple[tuple[str, ...], float]] = []
    for tenant, key, doc in sorted(await log.scan_kind(ReplayMeter.kind), key=lambda r: r[:2]):
        if key != METER_KEY:
            continue
        who, meter = (str(tenant),), ReplayMeter.model_validate(doc).on(today)
        held = reserved_today(meter.counts())
        reserved["calls"].append((who, float(held.calls)))
        reserved["tokens"].append((who, float(held.tokens)))
        reserved["usd"].append((who, held.usd))
        runs += [((*who, "admitted"), meter.runs_today), ((*who, "cut"), meter.cut_today)]
        limit = policy.limit_for(str(tenant))
        for unit, cap in (("calls", limit.calls), ("tokens", limit.tokens), ("usd", limit.usd)):
            if cap is not None:
                ceilings[unit].append((who, float(cap)))
    return [
        *(
            Gauge(
                f"assay_replay_{unit}_reserved",
                f"{what} reserved today (UTC) by the tenant's shadow runs and replay "
                "candidates (their worst cases).",
                ("tenant",),
                tuple(reserved[unit]),
            )
            for unit, what in _UNITS.items()
        ),
        Gauge(
            "assay_replay_runs",
            "The tenant's shadow runs today (UTC): admitted, or cut by its replay ceiling.",
            ("tenant", "outcome"),
            tuple(runs),
        ),
        *(
            Gauge(
                f"assay_replay_{unit}_ceiling",
                f"The tenant's replay ceiling: {what.lower()} shadow runs may reserve per UTC day.",
                ("tenant",),
                tuple(ceilings[unit]),
            )
            for unit, what in _UNITS.items()
        ),
    ]


_UNITS = {"calls": "Model calls", "tokens": "Tokens", "usd": "US dollars"}
