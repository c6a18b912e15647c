"""Scheduled calibration's policy, and the promotion hold it implies (§11, §14, §16).

On a schedule, the tournament stage replays each tenant's calibration set — pairs
of a verified-pass and a verified-fail episode of one task — through the judge in
both orderings (`assay.grading.calibration.calibrate`). The judge's agreement with
the verifier is its health: a tenant whose last calibration found it below
`min_agreement` has promotion held by decide until a later calibration finds it
recovered. A calibration that judged fewer than `min_judged` orderings says too
little to hold anything.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from assay.kernel.tenant_maps import tenant_keyed


class CalibrationPolicy(BaseModel):
    """When and how much each tenant's judge is calibrated (`ASSAY_CALIBRATION_*`).

    `budgets` is a per-tenant map of judge calls per UTC day, written
    `<tenant-uuid>=<calls>,...`; a tenant not in it has `calls_per_day`. A round
    judges at most `pairs` pairs, two calls each, and never more than what is left
    of the tenant's day.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    interval_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds between a tenant's calibration rounds (judge-versus-verifier agreement); "
            "unset: no scheduled calibration."
        ),
    )
    pairs: int = Field(
        10, ge=1, le=1000, description="Calibration pairs a round judges (two calls each)."
    )
    calls_per_day: int = Field(
        200, ge=0, description="Judge calls a tenant's calibration may make per UTC day."
    )
    budgets: dict[str, int] = Field(
        default_factory=dict,
        description="Per-tenant calibration budgets: `<tenant-uuid>=<calls>,...`.",
    )
    min_agreement: float = Field(
        0.7,
        ge=0,
        le=1,
        description=(
            "Promotion is held while the tenant's last calibration found the judge agreeing "
            "with the verifier less often than this."
        ),
    )
    min_judged: int = Field(
        4,
        ge=1,
        description="Judged orderings a calibration needs before its agreement can hold promotion.",
    )
    file: Path | None = Field(
        None,
        description=(
            "A calibration set (JSON lines, as `assay grade calibrate` reads) to judge instead "
            "of pairs chosen from each tenant's verified runs; each tenant gets its own lines."
        ),
    )

    @field_validator("budgets", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_keyed(value, "calls")

    @property
    def scheduled(self) -> bool:
        """Calibration runs on a schedule."""
        return self.interval_s is not None

    def budget_for(self, tenant: str) -> int:
        """The tenant's calibration calls per UTC day."""
        return self.budgets.get(str(tenant), self.calls_per_day)

    def hold(self, agreement: float | None, judged: int) -> str | None:
        """Why promotion waits on this calibration's agreement, or None."""
        if agreement is None or judged < self.min_judged or agreement >= self.min_agreement:
            return None
        return (
            f"judge-versus-verifier agreement {agreement:.0%} over {judged} calibration "
            f"orderings is below {self.min_agreement:.0%}"
        )
