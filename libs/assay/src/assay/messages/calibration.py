"""Scheduled judge calibration on the wire (§11, §16): its timer, and what it found."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned


class CalibrationDue(Versioned):
    """A tenant's calibration round fell due: replay its calibration set through the judge.

    The tournament stage sends it to itself on `assay.verified`, keyed by the tenant
    alone, so every round of a tenant is handled on one partition, one at a time. A
    round that already ran for this due time (its next one is later) ignores it.
    """

    type: ClassVar[str] = "CalibrationDue"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant whose judge is calibrated.")
    due_ms: int = Field(ge=0, description="When the round fell due (ms since the epoch).")


class JudgeCalibrated(Versioned):
    """What one calibration round found: the judge's agreement with the verifier and its
    order inconsistency on the tenant's calibration set.

    Published by the tournament stage on `assay.aggregates` for decide, which holds
    promotion while `agreement` is below its threshold (§11, §12.3).
    """

    type: ClassVar[str] = "JudgeCalibrated"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    judge: str = Field(description="The judge model calibrated (its name).")
    due_ms: int = Field(ge=0, description="When the round fell due (ms since the epoch).")
    source: Literal["verified_runs", "file"] = Field(
        description="Where the pairs came from: the tenant's verified runs, or a calibration file."
    )
    pairs: int = Field(ge=0, description="Pairs judged (each in both orderings).")
    judged: int = Field(ge=0, description="Orderings that got a verdict (failures excluded).")
    agreed: int = Field(ge=0, description="Judged orderings in which the judge preferred the pass.")
    draws: int = Field(ge=0, description="Judged orderings that were draws (disagreement).")
    failures: int = Field(ge=0, description="Orderings the judge gave no usable verdict for.")
    checked: int = Field(ge=0, description="Pairs judged in both orderings.")
    inconsistent: int = Field(ge=0, description="Of those, pairs whose verdicts do not mirror.")
    agreement: float | None = Field(
        ge=0, le=1, description="`agreed / judged` (None: nothing was judged)."
    )
    order_inconsistency_rate: float | None = Field(
        ge=0, le=1, description="`inconsistent / checked` (None: no pair was judged both ways)."
    )
    model_calls: int = Field(ge=0, description="Model calls the round made (metered).")
    cost_usd: float = Field(
        ge=0, allow_inf_nan=False, description="What those calls cost in US dollars."
    )
    skipped: str | None = Field(
        None, description="Why the round judged nothing (no pairs yet, budget spent), if so."
    )
