"""Wald's sequential probability ratio test on challenger wins (§11.3).

H0: the challenger's win probability is p0 (no better); H1: it is p1.
Draws carry no evidence and are excluded from the ratio, but a draw rate
above the ceiling ends the test with a reject: the challenger is not
meaningfully different, and sampling toward a boundary it will never reach
is waste.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from assay.kernel.scores import WinRecord


class SprtDecision(enum.Enum):
    """Where the test stands."""

    ACCEPT = "accept"
    REJECT = "reject"
    CONTINUE = "continue"


class SprtPolicy(BaseModel):
    """The test's parameters. All policy, none physics (§18)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    p0: float = Field(0.5, gt=0, lt=1, description="Win rate under H0 (no improvement).")
    p1: float = Field(0.7, gt=0, lt=1, description="Win rate under H1 worth acting on.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="False-accept rate.")
    beta: float = Field(0.10, gt=0, lt=0.5, description="False-reject rate.")
    draw_ceiling: float = Field(0.5, gt=0, le=1, description="Reject above this draw rate.")
    min_for_draws: int = Field(20, ge=1, description="Comparisons before the ceiling applies.")

    @model_validator(mode="after")
    def _ordered(self) -> SprtPolicy:
        if self.p1 <= self.p0:
            raise ValueError("p1 must exceed p0")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SprtPolicy:
        """The policy with any `ASSAY_SPRT_<FIELD>` variables applied (e.g. ASSAY_SPRT_P1).

        Raises:
            ValueError: a variable does not parse or the policy is inconsistent.
        """
        fields = {
            name: environ[f"ASSAY_SPRT_{name.upper()}"]
            for name in cls.model_fields
            if f"ASSAY_SPRT_{name.upper()}" in environ
        }
        return cls.model_validate(fields)

    @property
    def upper(self) -> float:
        """Accept boundary: log((1 - beta) / alpha)."""
        return math.log((1 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        """Reject boundary: log(beta / (1 - alpha))."""
        return math.log(self.beta / (1 - self.alpha))


@dataclass(frozen=True)
class SprtState:
    """The test on a record: decision, log-likelihood ratio, and why."""

    decision: SprtDecision
    llr: float
    reason: str


def llr(wins: int, losses: int, policy: SprtPolicy) -> float:
    """Log-likelihood ratio of H1 over H0 after `wins` and `losses`."""
    return wins * math.log(policy.p1 / policy.p0) + losses * math.log(
        (1 - policy.p1) / (1 - policy.p0)
    )


def evaluate(record: WinRecord, policy: SprtPolicy) -> SprtState:
    """Accept, reject or continue on a win record (verifier-decided pairs count)."""
    value = llr(record.wins, record.losses, policy)
    n = record.comparisons
    if n >= policy.min_for_draws and record.draws / n > policy.draw_ceiling:
        return SprtState(
            SprtDecision.REJECT,
            value,
            f"draw rate {record.draws}/{n} exceeds the ceiling {policy.draw_ceiling}",
        )
    if value >= policy.upper:
        return SprtState(
            SprtDecision.ACCEPT,
            value,
            f"log-likelihood ratio {value:.3f} crossed the accept boundary {policy.upper:.3f}",
        )
    if value <= policy.lower:
        return SprtState(
            SprtDecision.REJECT,
            value,
            f"log-likelihood ratio {value:.3f} crossed the reject boundary {policy.lower:.3f}",
        )
    return SprtState(SprtDecision.CONTINUE, value, "within the boundaries")
