"""The spend and judge health page's answer: calls, tokens and dollars by purpose over
time against the ceilings the stages enforce, and the judge's calibration rounds
(agreement with the verifier, order inconsistency).

Ceilings come from the console's own settings, which must be the stages' (compose and
Kubernetes give every component the same ones). `CEILINGS` lists each one: adding a
ceiling (a dollar one, say) is adding a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field

from assay.kernel.ids import TenantId
from assay.record.events import LogRecord
from assay.runtime.settings import AssaySettings
from assay_console.spend import MICRO, CalibrationSeen

MAX_DAYS = 90
Unit = Literal["calls", "tokens", "usd"]


class SpendBucket(BaseModel):
    """What one purpose spent in one bucket (an hour or a UTC day)."""

    start: datetime = Field(description="Start of the bucket (UTC).")
    purpose: str = Field(description="work, shadow (replay), grading or calibration.")
    calls: int = Field(description="Model calls.")
    failed: int = Field(description="Of those, calls billed whose answer was unusable.")
    prompt_tokens: int = Field(description="Prompt tokens.")
    completion_tokens: int = Field(description="Completion tokens.")
    cost_usd: float = Field(description="Dollars at the configured per-token prices.")


class CeilingView(BaseModel):
    """One ceiling a stage enforces on a purpose's spend per UTC day, and today's use."""

    purpose: str = Field(description="The purpose it bounds.")
    unit: Unit = Field(description="What it counts: model calls, tokens or US dollars.")
    limit: float | None = Field(description="The ceiling (None: unlimited).")
    used_today: float = Field(description="Today's (UTC) use, as recorded on `assay.usage`.")
    setting: str = Field(description="The settings that set it.")
    note: str = Field("", description="How the stage counts it, where that differs.")


class CalibrationPoint(BaseModel):
    """One calibration round of the tenant's judge."""

    at: datetime = Field(description="When the round was published.")
    judge: str = Field(description="The judge model.")
    pairs: int = Field(description="Pairs judged.")
    judged: int = Field(description="Orderings that got a verdict.")
    agreement: float | None = Field(description="Judge agreed with the verifier, of judged.")
    order_inconsistency_rate: float | None = Field(
        description="Pairs whose two orderings disagree, of those checked both ways."
    )
    cost_usd: float = Field(description="What the round cost.")
    skipped: str | None = Field(description="Why it judged nothing, if so.")


class JudgeHealth(BaseModel):
    """The judge against the verifier, round by round."""

    min_agreement: float | None = Field(description="Agreement below which promotion holds.")
    rounds: list[CalibrationPoint] = Field(description="Calibration rounds, oldest first.")


class SpendReport(BaseModel):
    """A tenant's spend by purpose over time, its ceilings, and its judge's health."""

    tenant: TenantId = Field(description="The tenant.")
    bucket: Literal["hour", "day"] = Field(description="Bucket size of `buckets`.")
    since: datetime = Field(description="Start of the first bucket shown.")
    buckets: list[SpendBucket] = Field(description="By bucket then purpose, oldest first.")
    ceilings: list[CeilingView] = Field(description="The ceilings on the tenant's spend.")
    judge: JudgeHealth = Field(description="Judge calibration rounds.")
    notes: list[str] = Field(description="What is not shown, and why.")


@dataclass(frozen=True)
class Ceiling:
    """How to read one ceiling from the settings."""

    purpose: str
    unit: Unit
    setting: str
    limit: Callable[[AssaySettings, TenantId], float | None]
    note: str = ""


CEILINGS: tuple[Ceiling, ...] = (
    Ceiling(
        "grading",
        "calls",
        "ASSAY_GRADING_CALLS_PER_DAY, ASSAY_GRADING_CEILINGS",
        lambda s, t: s.grading.ceiling_for(str(t)),
        "tournament counts a grading's judge calls by the day its graded fact occurred",
    ),
    Ceiling(
        "shadow",
        "calls",
        "ASSAY_REPLAY_CALLS_PER_DAY, ASSAY_REPLAY_CEILINGS",
        lambda s, t: s.replay.ceiling_for(str(t)),
        "ingest reserves each shadow run's whole model-call budget at admission; "
        "shown beside the calls made",
    ),
    Ceiling(
        "shadow",
        "tokens",
        "ASSAY_REPLAY_TOKENS_PER_DAY, ASSAY_REPLAY_TOKEN_CEILINGS",
        lambda s, t: s.replay.limit_for(str(t)).tokens,
        "ingest reserves each shadow run's worst case (every call its largest context) at "
        "admission; shown beside the tokens spent",
    ),
    Ceiling(
        "shadow",
        "usd",
        "ASSAY_REPLAY_USD_PER_DAY, ASSAY_REPLAY_USD_CEILINGS",
        lambda s, t: s.replay.limit_for(str(t)).usd,
        "ingest reserves each shadow run's worst case at the agent model's higher price at "
        "admission; shown beside the dollars spent",
    ),
    Ceiling(
        "calibration",
        "calls",
        "ASSAY_CALIBRATION_CALLS_PER_DAY, ASSAY_CALIBRATION_BUDGETS",
        lambda s, t: s.calibration.budget_for(str(t)),
    ),
)
NOTES = (
    "work runs have no spend ceiling (their workflow's budget bounds each run)",
    "the proposer's calls are not on assay.usage: the slow loop meters them itself",
)


def used_today(buckets: list[SpendBucket], purpose: str, unit: Unit, today: date) -> float:
    """A purpose's use on `today` (UTC) in `unit`."""
    todays = [b for b in buckets if b.purpose == purpose and b.start.date() == today]
    if unit == "usd":
        return round(sum(b.cost_usd for b in todays), 6)
    if unit == "tokens":
        return float(sum(b.prompt_tokens + b.completion_tokens for b in todays))
    return float(sum(b.calls for b in todays))


def ceilings(
    settings: AssaySettings | None, tenant: TenantId, buckets: list[SpendBucket], today: date
) -> tuple[list[CeilingView], list[str]]:
    """The tenant's ceilings and today's use of each; a note when the console has no
    settings to read them from."""
    if settings is None:
        return [], ["ceilings: this console was not given the stages' settings"]
    views = [
        CeilingView(
            purpose=c.purpose,
            unit=c.unit,
            limit=c.limit(settings, tenant),
            used_today=used_today(buckets, c.purpose, c.unit, today),
            setting=c.setting,
            note=c.note,
        )
        for c in CEILINGS
    ]
    return views, list(NOTES)


def bucket_rows(rows: list[tuple[int, str, int, int, int, int, int]]) -> list[SpendBucket]:
    """Buckets from `(start_ms, purpose, calls, failed, prompt, completion, micro_usd)`."""
    return [
        SpendBucket(
            start=datetime.fromtimestamp(start / 1000, UTC),
            purpose=purpose,
            calls=calls,
            failed=failed,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cost_usd=micro / MICRO,
        )
        for start, purpose, calls, failed, prompt, completion, micro in rows
    ]


def calibration_points(records: list[LogRecord]) -> list[CalibrationPoint]:
    """The rounds of a tenant's calibration stream, oldest first."""
    out = []
    for record in records:
        if isinstance(record.event, CalibrationSeen):
            r = record.event.round
            out.append(
                CalibrationPoint(
                    at=datetime.fromtimestamp(record.event.at_ms / 1000, UTC),
                    judge=r.judge,
                    pairs=r.pairs,
                    judged=r.judged,
                    agreement=r.agreement,
                    order_inconsistency_rate=r.order_inconsistency_rate,
                    cost_usd=r.cost_usd,
                    skipped=r.skipped,
                )
            )
    return out


PURPOSES = ("work", "shadow", "grading", "calibration")
METRICS: dict[str, Callable[[SpendBucket], float]] = {
    "calls": lambda b: b.calls,
    "tokens": lambda b: b.prompt_tokens + b.completion_tokens,
    "usd": lambda b: b.cost_usd,
}


def series(
    report: SpendReport, now: datetime
) -> tuple[list[str], dict[str, dict[str, list[float]]]]:
    """Bucket labels from `since` to `now`, and per metric each purpose's value in each
    bucket (zero where it spent nothing)."""
    width = timedelta(hours=1) if report.bucket == "hour" else timedelta(days=1)
    starts = []
    at = report.since
    while at <= now:
        starts.append(at)
        at += width
    index = {s: i for i, s in enumerate(starts)}
    seen = [p for p in PURPOSES if any(b.purpose == p for b in report.buckets)]
    out = {m: {p: [0.0] * len(starts) for p in seen} for m in METRICS}
    for b in report.buckets:
        i = index.get(b.start)
        if i is None or b.purpose not in seen:
            continue
        for metric, value in METRICS.items():
            out[metric][b.purpose][i] += value(b)
    fmt = "%m-%d %H:00" if report.bucket == "hour" else "%m-%d"
    return [s.strftime(fmt) for s in starts], out
