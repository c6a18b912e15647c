"""Spend and judge health, folded from the topics: each model call (`assay.usage`,
`UsageRecorded`) and each judge calibration round (`assay.aggregates`,
`JudgeCalibrated`).

Each call lands as a `CallSeen` on its tenant's `usage:<day>` stream and folds into one
`CallRow`, which the store keeps in the `console_usage` table (an hour bucket, the
purpose, tokens, micro-dollars), so the spend page is one indexed range of a tenant's
hours, summed by SQL. Each calibration round lands on its tenant's `calibration`
stream: they are a few a day.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import Field

from assay.kernel.ids import TenantId
from assay.messages import UsageRecorded
from assay.messages.calibration import JudgeCalibrated
from assay.record import (
    BranchKey,
    DocumentTable,
    Event,
    LogRecord,
    ReadModel,
    StateDelta,
    TableColumn,
)
from assay.runtime import UnitOfWork

HOUR_MS = 3_600_000
MICRO = 1_000_000
"""Dollars are kept as integer micro-dollars in the table (its columns are integers)."""


class CallSeen(Event):
    """One model call, attributed to a purpose, and what it cost."""

    type: ClassVar[str] = "console.CallSeen"
    version: ClassVar[int] = 1
    call: str = Field(description="The `UsageRecorded` message's id.")
    at_ms: int = Field(ge=0, description="When the call was recorded (ms since the epoch).")
    call_usage: UsageRecorded = Field(description="The call as metered.")


class CalibrationSeen(Event):
    """One judge calibration round of the tenant, as the tournament stage published it."""

    type: ClassVar[str] = "console.CalibrationSeen"
    version: ClassVar[int] = 1
    at_ms: int = Field(ge=0, description="When the round was published.")
    round: JudgeCalibrated = Field(description="What the round found.")


SPEND_EVENTS = (CallSeen, CalibrationSeen)


class CallRow(ReadModel):
    """One model call in the `console_usage` table."""

    kind: ClassVar[str] = "console_call"
    hour_ms: int
    purpose: str
    judge_purpose: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_micro_usd: int
    failed: bool


USAGE_TABLE = DocumentTable(
    kind=CallRow.kind,
    table="console_usage",
    columns=(
        TableColumn("hour_ms", "integer"),
        TableColumn("purpose", "text"),
        TableColumn("prompt_tokens", "integer"),
        TableColumn("completion_tokens", "integer"),
        TableColumn("cost_micro_usd", "integer"),
        TableColumn("failed", "boolean"),
    ),
    indexes=(("hour_ms",),),
)
"""Every model call of a tenant, by hour: the spend page sums one range of it."""


class LatestCalibration(ReadModel):
    """A tenant's latest calibration round (the history is its stream)."""

    kind: ClassVar[str] = "console_calibration"
    at_ms: int
    round: JudgeCalibrated


def usage_stream(tenant: TenantId, at_ms: int) -> BranchKey:
    """The console's stream of a tenant's calls of one UTC day."""
    day = datetime.fromtimestamp(at_ms / 1000, UTC).date().isoformat()
    return BranchKey.main(tenant, f"usage:{day}")


def calibration_stream(tenant: TenantId) -> BranchKey:
    """The console's stream of a tenant's calibration rounds."""
    return BranchKey.main(tenant, "calibration")


def fold_spend(record: LogRecord) -> list[StateDelta]:
    """One `CallRow` per call; a tenant's latest calibration round."""
    event = record.event
    tenant = record.key.tenant
    if isinstance(event, CalibrationSeen):
        latest = LatestCalibration(at_ms=event.at_ms, round=event.round)
        return [latest.put(tenant, "latest")]
    if not isinstance(event, CallSeen):
        return []
    u = event.call_usage
    row = CallRow(
        hour_ms=event.at_ms - event.at_ms % HOUR_MS,
        purpose=u.purpose.value,
        judge_purpose=u.judge_purpose.value if u.judge_purpose else None,
        model=u.model,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cost_micro_usd=round(u.cost_usd * MICRO),
        failed=u.failed,
    )
    return [row.put(tenant, event.call)]


def _ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


async def on_usage_recorded(msg: UsageRecorded, uow: UnitOfWork[Any]) -> None:
    """Record a model call for the spend page."""
    at_ms = _ms(uow.envelope.occurred_at)
    event = CallSeen(call=uow.envelope.id, at_ms=at_ms, call_usage=msg)
    uow.record(usage_stream(uow.tenant, at_ms), event)


async def on_judge_calibrated(msg: JudgeCalibrated, uow: UnitOfWork[Any]) -> None:
    """Record a calibration round: the judge's agreement and order inconsistency."""
    event = CalibrationSeen(at_ms=_ms(uow.envelope.occurred_at), round=msg)
    uow.record(calibration_stream(uow.tenant), event)


SPEND_HANDLERS = (on_usage_recorded, on_judge_calibrated)
