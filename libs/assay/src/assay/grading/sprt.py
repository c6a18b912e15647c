"""Calibrated pairwise sequential testing: the SPRT on challenger wins (§11.3).

H0: the challenger's win probability is p0 (no better); H1: it is p1.
Draws carry no evidence and are excluded from the ratio, but a draw rate
above the ceiling ends the test with a reject: the challenger is not
meaningfully different, and sampling toward a boundary it will never reach
is waste.

The boundaries are calibrated on the wins/losses lattice by default (see
`sprt_calibration`): Wald's are conservative there, and §11.3's point is that
a decision costs only the comparisons it needs. `operating_characteristics`
gives a policy's exact error rates and sample sizes, `simulate` checks them by
Monte Carlo with draws, and `fixed_n` is the fixed-sample design both are
measured against.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from assay.grading.sprt_calibration import (
    HORIZON,
    QUANTILES,
    Steps,
    calibrate,
    fixed_n,
    lattice_oc,
)
from assay.kernel.scores import WinRecord

__all__ = [
    "Oc",
    "SprtDecision",
    "SprtPolicy",
    "SprtState",
    "evaluate",
    "fixed_n",
    "llr",
    "operating_characteristics",
    "simulate",
]


class SprtDecision(enum.Enum):
    """Where the test stands."""

    ACCEPT = "accept"
    REJECT = "reject"
    CONTINUE = "continue"


class SprtPolicy(BaseModel):
    """The test's parameters (`ASSAY_SPRT_<FIELD>`). All policy, none physics (§18)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    p0: float = Field(0.5, gt=0, lt=1, description="Win rate under H0 (no improvement).")
    p1: float = Field(0.7, gt=0, lt=1, description="Win rate under H1 worth acting on.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="False-accept rate.")
    beta: float = Field(0.05, gt=0, lt=0.5, description="False-reject rate.")
    draw_ceiling: float = Field(0.5, gt=0, le=1, description="Reject above this draw rate.")
    min_for_draws: int = Field(20, ge=1, description="Comparisons before the ceiling applies.")
    calibrated: bool = Field(
        True, description="Boundaries calibrated on the wins/losses lattice; false: Wald's."
    )

    @model_validator(mode="after")
    def _ordered(self) -> SprtPolicy:
        if self.p1 <= self.p0:
            raise ValueError("p1 must exceed p0")
        return self

    @property
    def wald_upper(self) -> float:
        """Wald's accept boundary: log((1 - beta) / alpha)."""
        return math.log((1 - self.beta) / self.alpha)

    @property
    def wald_lower(self) -> float:
        """Wald's reject boundary: log(beta / (1 - alpha))."""
        return math.log(self.beta / (1 - self.alpha))

    @property
    def upper(self) -> float:
        """Accept boundary: calibrated (at most Wald's), or Wald's when not `calibrated`.

        Calibrated, `(upper, lower)` is the pair that keeps the exact false-accept
        rate at p0 within alpha and the exact false-reject rate at p1 within beta at
        the least worst-case expected sample size (`sprt_calibration.calibrate`).
        Computed once per (p0, p1, alpha, beta) and process.
        """
        if not self.calibrated:
            return self.wald_upper
        return calibrate(self.p0, self.p1, self.alpha, self.beta)[0]

    @property
    def lower(self) -> float:
        """Reject boundary: calibrated (at least Wald's), or Wald's when not `calibrated`."""
        if not self.calibrated:
            return self.wald_lower
        return calibrate(self.p0, self.p1, self.alpha, self.beta)[1]


@dataclass(frozen=True)
class SprtState:
    """The test on a record: decision, log-likelihood ratio, and why."""

    decision: SprtDecision
    llr: float
    reason: str


def llr(wins: int, losses: int, policy: SprtPolicy) -> float:
    """Log-likelihood ratio of H1 over H0 after `wins` and `losses`."""
    steps = Steps.of(policy.p0, policy.p1)
    return wins * steps.win + losses * steps.loss


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


@dataclass(frozen=True)
class Oc:
    """Operating characteristics of a policy at one true win rate.

    Attributes:
        mean_n: mean comparisons to a decision, draws included.
        quantiles: comparisons by which 50, 90 and 99% of tests have decided,
            keyed "p50", "p90", "p99" (an undecided test counts at the cut-off).
        accept_rate: share of tests that accept the challenger.
        reject_rate: share that reject it (boundary or draw ceiling).
        undecided_rate: share still continuing at the cut-off.
    """

    mean_n: float
    quantiles: dict[str, int]
    accept_rate: float
    reject_rate: float
    undecided_rate: float


def _quantile_names() -> list[str]:
    return [f"p{round(q * 100)}" for q in QUANTILES]


def operating_characteristics(policy: SprtPolicy, p: float, *, horizon: int = HORIZON) -> Oc:
    """Exact operating characteristics at win rate `p`, without draws.

    Dynamic programming over (wins, losses) with the policy's boundaries, cut off
    once less than 1e-12 of tests continue or at `horizon` comparisons.

    Raises:
        ValueError: `p` is outside [0, 1] or `horizon` is below 1.
    """
    import numpy as np  # here: a process that only reads a policy does not load numpy

    if not 0 <= p <= 1:
        raise ValueError(f"the win rate {p} is outside [0, 1]")
    oc = lattice_oc(
        Steps.of(policy.p0, policy.p1),
        np.array([policy.upper]),
        np.array([policy.lower]),
        np.array([p]),
        horizon=horizon,
    )
    return Oc(
        mean_n=float(oc.mean_n[0, 0]),
        quantiles=dict(zip(_quantile_names(), oc.quantiles[:, 0, 0].tolist(), strict=True)),
        accept_rate=float(oc.accept[0, 0]),
        reject_rate=float(oc.reject[0, 0]),
        undecided_rate=float(oc.undecided[0, 0]),
    )


def simulate(
    policy: SprtPolicy,
    p: float,
    reps: int,
    seed: int,
    p_draw: float = 0.0,
    *,
    horizon: int = HORIZON,
) -> Oc:
    """Operating characteristics at win rate `p` by Monte Carlo, `reps` tests.

    Each comparison is a draw with probability `p_draw`, otherwise a win with
    probability `p`: `p` is the win rate among decisive comparisons, the one the
    policy's p0 and p1 speak of. Every test applies `evaluate`'s rule after each
    comparison, draw ceiling included; draws count as comparisons. Reproducible
    from `seed`.

    Raises:
        ValueError: a rate is outside [0, 1], `reps` or `horizon` is below 1.
    """
    if not (0 <= p <= 1 and 0 <= p_draw <= 1):
        raise ValueError("the win and draw rates must lie in [0, 1]")
    if reps < 1 or horizon < 1:
        raise ValueError("reps and horizon must be at least 1")
    import numpy as np

    rng = np.random.default_rng(seed)
    steps = Steps.of(policy.p0, policy.p1)
    upper, lower = policy.upper, policy.lower
    live = np.arange(reps)
    wins, losses, draws = (np.zeros(reps, dtype=np.int64) for _ in range(3))
    stop_n = np.full(reps, horizon, dtype=np.int64)
    accepted = np.zeros(reps, dtype=bool)
    rejected = np.zeros(reps, dtype=bool)
    for n in range(1, horizon + 1):
        u = rng.random(len(live))
        drew = u < p_draw
        won = ~drew & (u < p_draw + (1 - p_draw) * p)
        draws[live] += drew
        wins[live] += won
        losses[live] += ~drew & ~won
        ratio = steps.llr(wins[live], losses[live])
        ceiling = (n >= policy.min_for_draws) & (draws[live] / n > policy.draw_ceiling)
        accept = ~ceiling & (ratio >= upper)
        reject = ceiling | (~accept & (ratio <= lower))
        done = accept | reject
        accepted[live[accept]] = True
        rejected[live[reject]] = True
        stop_n[live[done]] = n
        live = live[~done]
        if len(live) == 0:
            break
    quantiles = np.quantile(stop_n, QUANTILES, method="inverted_cdf")
    return Oc(
        mean_n=float(stop_n.mean()),
        quantiles=dict(zip(_quantile_names(), [int(q) for q in quantiles], strict=True)),
        accept_rate=float(accepted.mean()),
        reject_rate=float(rejected.mean()),
        undecided_rate=len(live) / reps,
    )
