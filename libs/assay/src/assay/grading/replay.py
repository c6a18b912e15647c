"""Replay's own spend ceiling (§12.4, §14.1): shadow runs are full agent runs.

Every shadow run (`Purpose.SHADOW`: the challenger's replay of a task, or the
current version's reference run of a task the challenger serves) reserves its
workflow's model-call budget against its tenant's replay ceiling for the UTC day
the task arrived, when ingest admits it. A shadow run whose reservation would
take the tenant past its ceiling is not spawned: it is cut, recorded as such,
and is never evidence for or against the challenger. Work runs never reserve,
and are never cut.

Reserving the budget, not guessing the spend, is what makes the ceiling a bound
that ingest can keep: the model calls a run will make are unknown when it is
admitted, but a run never makes more than its budget allows. The ceiling is in
calls, tokens and US dollars (each optional): a run reserves its worst case in
all three — its model-call budget, each call its largest context, every token at
the higher of the model's two per-token prices (`assay.kernel.spend.worst_case`,
what a judge call reserves against grading's ceiling too).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from assay.grading.spend_ceilings import DailySpendCeilings
from assay.kernel.spend import Spend, SpendLimit
from assay.kernel.tenant_maps import tenant_keyed

METER_STREAM = "replay-meter"
"""The ingest stream a tenant's replay meter is recorded on (compare-and-swapped)."""


class ReplayPolicy(DailySpendCeilings):
    """Per-tenant ceilings on replay spend (`ASSAY_REPLAY_*`) per UTC day, in model calls,
    tokens and US dollars, reserved by shadow runs (each its worst case when ingest
    admits it: its workflow's `budget.max_model_calls` calls of its largest context) and
    by a candidate matrix's siblings (each its per-run maximum, all when the group is
    admitted). None: no ceiling in that unit. A tenant not in `ceilings` has
    `calls_per_day`, and likewise for tokens and dollars (`DailySpendCeilings`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    calls_per_day: int | None = Field(
        None,
        ge=0,
        description=(
            "Model calls shadow runs and replay candidates may reserve per tenant per UTC day "
            "(unset: no limit)."
        ),
    )
    ceilings: dict[str, int] = Field(
        default_factory=dict, description="Per-tenant ceilings: `<tenant-uuid>=<calls>,...`."
    )

    @field_validator("ceilings", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_keyed(value, "calls")

    def ceiling_for(self, tenant: str) -> int | None:
        """The tenant's replay model calls per day (None: unlimited)."""
        return self.ceilings.get(str(tenant), self.calls_per_day)

    def limit_for(self, tenant: str) -> SpendLimit:
        """The tenant's replay ceiling per UTC day in calls, tokens and dollars."""
        return self.spend_limit(tenant, self.ceiling_for(tenant))


COUNTS = ("calls", "tokens", "micro_usd", "runs", "cut")
"""What a replay meter counts, each `<count>_today` and `<count>_total`."""


def meter_of(day: str, doc: dict[str, Any] | None) -> dict[str, Any]:
    """A tenant's replay meter for `day`: a new day starts today's counts at zero.

    `calls_today`, `tokens_today` and `micro_usd_today` are what the runs admitted today
    reserved (their worst cases; dollars in whole micro-dollars), `runs_today` those
    runs, `cut_today` the runs cut by the ceiling; `*_total` since the meter began. A
    meter recorded before tokens and dollars were reserved reads them as zero.
    """
    base: dict[str, Any] = {"day": day}
    for count in COUNTS:
        base |= {f"{count}_today": 0, f"{count}_total": 0}
    current = {**base, **{k: v for k, v in (doc or {}).items() if k in base}}
    if current["day"] != day:
        current.update(day=day, **{f"{c}_today": 0 for c in COUNTS})
    return current


def reserved_today(meter: dict[str, Any]) -> Spend:
    """What `meter`'s runs reserved on its day."""
    return Spend(
        int(meter["calls_today"]), int(meter["tokens_today"]), int(meter["micro_usd_today"])
    )


def admit(meter: dict[str, Any], worst: Spend, limit: SpendLimit) -> bool:
    """Reserve `worst` for one run in `meter` if, with what its day already holds, it is
    within every unit of `limit`, else count the run as cut; True when it was admitted."""
    fits = limit.admits(reserved_today(meter) + worst)
    if fits:
        for count, amount in (
            ("calls", worst.calls),
            ("tokens", worst.tokens),
            ("micro_usd", worst.micro_usd),
            ("runs", 1),
        ):
            meter[f"{count}_today"] = int(meter[f"{count}_today"]) + amount
            meter[f"{count}_total"] = int(meter[f"{count}_total"]) + amount
    else:
        meter["cut_today"] = int(meter["cut_today"]) + 1
        meter["cut_total"] = int(meter["cut_total"]) + 1
    return fits
