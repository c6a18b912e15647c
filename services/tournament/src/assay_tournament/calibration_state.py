"""Scheduled calibration's derived state (§11, §16), typed, its fold and its gauges.

Kinds (per tenant): `calibration_pair` per (workflow, task) — the first verified
pass and fail kept as the task's calibration pair; `calibration_tenant` — a marker
that the tenant has a whole pair, so its rounds are scheduled; `calibration_round`
— the tenant's calibration calls today and when its next round falls due;
`judge_agreement` per judge model — what its last round found.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from assay.grading.calibration_policy import CalibrationPolicy
from assay.kernel import RunId
from assay.kernel.ids import TenantId
from assay.messages import JudgeCalibrated
from assay.record import LogRecord, Patch, ReadModel, StateDelta
from assay.runtime import Gauge
from assay.store import EventLog
from assay_tournament.events import CalibrationEpisodeKept, CalibrationRan

ROUND = "round"
"""The key of a tenant's one `CalibrationRound` (and its `CalibrationTenant` marker)."""


class KeptEpisode(BaseModel):
    """One side of a calibration pair: the run and its episode."""

    model_config = ConfigDict(frozen=True)
    run_id: RunId
    episode: str


class CalibrationPairKept(ReadModel):
    """A task's calibration pair under one workflow: its first pass and its first fail."""

    kind: ClassVar[str] = "calibration_pair"
    passed: KeptEpisode | None = None
    failed: KeptEpisode | None = None

    @model_serializer(mode="wrap")
    def _sides_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored as patched: a side not yet kept is absent."""
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def whole(self) -> bool:
        """Both sides are kept."""
        return self.passed is not None and self.failed is not None


class CalibrationTenant(ReadModel):
    """The tenant has a whole calibration pair: its rounds are scheduled."""

    kind: ClassVar[str] = "calibration_tenant"


class CalibrationRound(ReadModel):
    """A tenant's calibration schedule and spend."""

    kind: ClassVar[str] = "calibration_round"
    day: str
    calls_today: int
    next_due_ms: int


class JudgeAgreement(ReadModel, JudgeCalibrated):
    """What a judge model's last round that judged anything found, for a tenant."""

    kind: ClassVar[str] = "judge_agreement"


CALIBRATION_STATE: tuple[type[ReadModel], ...] = (
    CalibrationPairKept,
    CalibrationTenant,
    CalibrationRound,
    JudgeAgreement,
)


def fold_calibration(record: LogRecord) -> list[StateDelta]:
    """Calibration pairs, the schedule, and each judge's last agreement."""
    t = record.key.tenant
    match record.event:
        case CalibrationEpisodeKept() as e:
            side = "passed" if e.passed else "failed"
            kept = {side: {"run_id": e.run_id, "episode": e.episode}}
            out: list[StateDelta] = [
                Patch(CalibrationPairKept.at(t, f"{e.workflow_id}/{e.task_id}"), kept)
            ]
            if e.completes:
                out.append(CalibrationTenant().put(t, ROUND))
            return out
        case CalibrationRan() as e:
            found = JudgeAgreement.model_validate(e.found)
            schedule = CalibrationRound(
                day=e.day, calls_today=e.calls_today, next_due_ms=e.next_due_ms
            )
            out = [schedule.put(t, ROUND)]
            if found.judged:
                out.append(found.put(t, found.judge))
            return out
    return []


async def due_rounds(
    log: EventLog, tenants: frozenset[TenantId], now_ms: float
) -> list[tuple[TenantId, int]]:
    """Each tenant whose round is due at `now_ms`, with when it fell due: a tenant with a
    whole pair, or one of `tenants` (a calibration file's), is due at once the first time."""
    scheduled = {who for who, _, _ in await log.scan_kind(CalibrationTenant.kind)} | tenants
    rounds = {
        who: CalibrationRound.model_validate(doc)
        for who, _, doc in await log.scan_kind(CalibrationRound.kind)
    }
    due = []
    for who in sorted(scheduled, key=str):
        at = rounds[who].next_due_ms if who in rounds else 0
        if at <= now_ms:
            due.append((who, at))
    return due


async def calibration_gauges(log: EventLog, policy: CalibrationPolicy) -> list[Gauge]:
    """Judge health from the last calibration of each tenant and judge model (§15), and
    the thresholds below which decide holds promotion (the same settings decide reads),
    so that an alert compares the two instead of repeating the settings' values."""
    found = [
        (str(who), JudgeAgreement.model_validate(doc))
        for who, _, doc in await log.scan_kind(JudgeAgreement.kind)
    ]
    labels = ("tenant", "judge")

    def gauge(name: str, help_: str, value: dict[tuple[str, str], float | None]) -> Gauge:
        samples = tuple((k, v) for k, v in sorted(value.items()) if v is not None)
        return Gauge(name, help_, labels, samples)

    return [
        gauge(
            "assay_judge_verifier_agreement",
            "Share of calibration orderings in which the judge preferred the verified pass, "
            "on its last scheduled calibration (draws disagree).",
            {(t, a.judge): a.agreement for t, a in found},
        ),
        gauge(
            "assay_judge_calibration_order_inconsistency",
            "Share of calibration pairs whose two orderings' verdicts do not mirror, on the "
            "judge's last scheduled calibration.",
            {(t, a.judge): a.order_inconsistency_rate for t, a in found},
        ),
        gauge(
            "assay_judge_calibration_orderings",
            "Orderings the judge's last scheduled calibration judged (its agreement's sample).",
            {(t, a.judge): float(a.judged) for t, a in found},
        ),
        Gauge(
            "assay_judge_calibration_min_agreement",
            "Agreement below which promotion is held (ASSAY_CALIBRATION_MIN_AGREEMENT).",
            (),
            (((), policy.min_agreement),),
        ),
        Gauge(
            "assay_judge_calibration_min_judged",
            "Orderings a calibration needs before its agreement can hold promotion "
            "(ASSAY_CALIBRATION_MIN_JUDGED).",
            (),
            (((), float(policy.min_judged)),),
        ),
    ]
