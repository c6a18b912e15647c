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
admitted, but a run never makes more than its budget allows.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from assay.kernel.tenant_maps import tenant_keyed

METER_STREAM = "replay-meter"
"""The ingest stream a tenant's replay meter is recorded on (compare-and-swapped)."""


class ReplayPolicy(BaseModel):
    """Per-tenant ceilings on replay spend (`ASSAY_REPLAY_*`): model calls reserved by
    shadow runs per UTC day (each reserves its workflow's `budget.max_model_calls` when
    ingest admits it) and by a candidate matrix's siblings (each its per-run maximum, all
    when the group is admitted). None: no ceiling. A tenant not in `ceilings` has
    `calls_per_day`."""

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


def meter_of(day: str, doc: dict[str, Any] | None) -> dict[str, Any]:
    """A tenant's replay meter for `day`: a new day starts today's counts at zero.

    `calls_today` are model calls reserved by shadow runs admitted today, `runs_today`
    those runs, `cut_today` the shadow runs cut by the ceiling; `*_total` since the
    meter began.
    """
    base: dict[str, Any] = {
        "day": day,
        "calls_today": 0,
        "runs_today": 0,
        "cut_today": 0,
        "calls_total": 0,
        "runs_total": 0,
        "cut_total": 0,
    }
    current = {**base, **{k: v for k, v in (doc or {}).items() if k in base}}
    if current["day"] != day:
        current.update(day=day, calls_today=0, runs_today=0, cut_today=0)
    return current


def admit(meter: dict[str, Any], calls: int, ceiling: int | None) -> bool:
    """Reserve `calls` for one shadow run in `meter` if they fit under `ceiling`, else
    count the run as cut; True when it was admitted."""
    fits = ceiling is None or int(meter["calls_today"]) + calls <= ceiling
    if fits:
        meter["calls_today"] = int(meter["calls_today"]) + calls
        meter["calls_total"] = int(meter["calls_total"]) + calls
        meter["runs_today"] = int(meter["runs_today"]) + 1
        meter["runs_total"] = int(meter["runs_total"]) + 1
    else:
        meter["cut_today"] = int(meter["cut_today"]) + 1
        meter["cut_total"] = int(meter["cut_total"]) + 1
    return fits
