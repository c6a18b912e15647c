"""The promotion ladder (§12.3): where a challenger stands, and what its evidence moves.

Two ladders, chosen by the challenger's grading strategy:

- **Default** (pairwise, deterministic): shadow (0%) -> trial (`trial_share`) ->
  current (100%). Trial needs `min_shadow_runs` clean selection episodes (no
  `Core` violation); current needs the sequential test's accept boundary, at least
  `min_trial_runs` clean episodes that served live tasks on trial, and a clean
  drift check. The swap at the last rung takes all traffic at once.
- **Resourced** (tournament): shadow -> canary (`trial_share`) -> ramp
  (`ramp_shares`, in turn) -> current. Canary needs the Bradley-Terry strength's
  interval (the mean anchored delta from control, over at least
  `min_strength_episodes` selection episodes) to exclude zero from above; ramp
  needs the sequential test at alpha and `min_trial_runs` clean served episodes
  on canary; each ramp step must sustain the interval over `ramp_episodes` more
  anchored episodes; the last leads to current, drift check clean.

Several challengers (the resourced mode, §12.1): a workflow's `grading.challengers`
lets that many climb at once, each on its own standing (`check_challengers` says
who may ask; `split_shares` splits live traffic between them and the current
version under `challengers_ceiling`; `stronger` orders qualified ones for the one
promotion at a time).

Rollback is automatic and unconditional, from any rung: any `Capped` episode of
the challenger on a selection task, or its verifier pass rate below the current
version's by more than `pass_rate_margin` (both measured over at least
`min_pass_rate_runs` selection runs). Nothing here reads held-out tasks: the
evidence it is given counts selection tasks only (§12.5).

The drift check: the judge's order-inconsistency rate on the challenger's sampled
order checks is within `max_order_inconsistency` (an inconsistent judge holds the
swap, it does not promote). Its pass-rate half is the rollback rule above. The
judge's scheduled calibration holds the swap the same way while its agreement with
the verifier is low (`assay.grading.calibration_policy`).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from assay.grading.sprt import SprtDecision, SprtPolicy, evaluate
from assay.grading.strategies import GradingStrategy, builtin_strategies
from assay.kernel.ids import WorkflowVersion
from assay.messages.rungs import Ladder, Rung

if TYPE_CHECKING:
    from assay.messages.loop import VariantAggregate
    from assay.workflow.ir import GradingSpec

MIN_ORDER_CHECKS = 5
"""Order checks before the drift check reads their inconsistency rate."""


class LadderPolicy(BaseModel):
    """The ladder's parameters: all policy (each read from `ASSAY_LADDER_<FIELD>`, and
    the held-out fraction from `ASSAY_HELD_OUT_FRACTION`). `ramp_shares` is written
    comma separated in the environment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial_share: float = Field(
        0.05, gt=0, lt=1, description="Share of live tasks a challenger serves on trial or canary."
    )
    ramp_shares: tuple[float, ...] = Field(
        (0.2, 0.5),
        description="Resourced ladder: the ramp's shares, in order (`0.2,0.5`; empty: no ramp).",
    )
    min_shadow_runs: int = Field(
        5, ge=1, description="Clean selection episodes in shadow before trial (default ladder)."
    )
    min_trial_runs: int = Field(
        5,
        ge=1,
        description="Clean episodes serving live tasks on trial or canary before moving up.",
    )
    min_strength_episodes: int = Field(
        5, ge=2, description="Anchored selection episodes before the strength interval is read."
    )
    ramp_episodes: int = Field(
        5, ge=1, description="Anchored episodes each ramp step must sustain the interval over."
    )
    pass_rate_margin: float = Field(
        0.1, ge=0, lt=1, description="Roll back when the pass rate is this far below current's."
    )
    min_pass_rate_runs: int = Field(
        20, ge=1, description="Selection runs of each version before pass rates are compared."
    )
    max_order_inconsistency: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Drift check: the largest order-inconsistency rate that promotes.",
    )
    held_out_fraction: float = Field(
        0.2, ge=0, lt=1, description="Share of tasks (by TaskId) in the held-out set."
    )
    max_challengers: int = Field(
        4,
        ge=1,
        le=64,
        description="The most live challengers a workflow's `grading.challengers` may allow.",
    )

    @field_validator("ramp_shares", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(float(v) for v in value.split(",") if v.strip())
        return value

    @model_validator(mode="after")
    def _ordered(self) -> LadderPolicy:
        shares = (self.trial_share, *self.ramp_shares)
        if any(b <= a for a, b in itertools.pairwise(shares)) or shares[-1] >= 1:
            raise ValueError(
                "ramp_shares must rise from above trial_share and stay below 1 "
                f"(trial {self.trial_share}, ramp {list(self.ramp_shares)})"
            )
        return self

    @property
    def challengers_ceiling(self) -> float:
        """The most of live traffic the challengers of a workflow serve together: the
        ladder's largest share, so the current version always keeps the rest."""
        return max((self.trial_share, *self.ramp_shares))

    def over(self, defaults: Mapping[str, Any]) -> LadderPolicy:
        """This policy's explicitly set fields (those the environment gave) over
        `defaults`, over the built-in defaults.

        Raises:
            ValidationError: the result is inconsistent (a default and a set share clash).
        """
        return LadderPolicy.model_validate(
            {**defaults, **self.model_dump(include=set(self.model_fields_set))}
        )


class ChallengersRefused(Exception):
    """A workflow asks for more live challengers than it may have."""


def check_challengers(
    spec: GradingSpec, strategies: Mapping[str, GradingStrategy], policy: LadderPolicy
) -> None:
    """A workflow's `grading.challengers` is within the deployment's ceiling, and more
    than one is asked for only under a grouped (tournament) strategy (§12.1).

    Raises:
        ChallengersRefused: it is not, naming the problem.
    """
    n = spec.live_challengers
    if n > policy.max_challengers:
        raise ChallengersRefused(
            f"grading.challengers is {n}, above this deployment's ceiling of "
            f"{policy.max_challengers} (ASSAY_LADDER_MAX_CHALLENGERS)"
        )
    strategy = strategies.get(spec.strategy)
    if n > 1 and (strategy is None or not strategy.grouped):
        raise ChallengersRefused(
            f"grading.challengers is {n}: several live challengers need a grouped strategy "
            f"such as tournament, not {spec.strategy!r}"
        )


def split_shares(
    current: WorkflowVersion, requested: Sequence[tuple[WorkflowVersion, float]], ceiling: float
) -> dict[str, float]:
    """Every live version's share of live tasks: each challenger's rung share, scaled
    down together when they would serve more than `ceiling` between them, and the current
    version the rest. The shares sum to 1."""
    total = math.fsum(share for _, share in requested)
    scale = ceiling / total if total > ceiling else 1.0
    shares: dict[str, float] = {version: share * scale for version, share in requested}
    shares[current] = max(0.0, 1.0 - math.fsum(shares.values()))
    return shares


class Standing(BaseModel):
    """Where one challenger stands: its ladder and rung, and what it had when it got there."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ladder: Ladder = Field(description="The ladder it climbs.")
    rung: Rung = Field(description="Its rung.")
    share: float = Field(ge=0, le=1, description="Its share of live tasks.")
    entered_served: int = Field(0, ge=0, description="Its served episodes when it took the rung.")
    entered_episodes: int = Field(
        0, ge=0, description="Its anchored strength episodes when it took the rung."
    )
    accepted: bool = Field(
        False, description="The sequential test crossed its accept boundary (read once, latched)."
    )
    held: str | None = Field(None, description="Why the swap to current waits, when it does.")
    held_strength: float | None = Field(
        None,
        description=(
            "Its strength when everything but the hold said promote (several challengers: "
            "the strongest such one is promoted first)."
        ),
    )


def stronger(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """Whether a challenger `(strength, admission order)` outranks another for promotion:
    the higher strength, and on a tie the one admitted first (deterministic)."""
    return (a[0], -a[1]) > (b[0], -b[1])


class MoveKind(enum.Enum):
    """What the evidence does to a challenger."""

    STAY = "stay"
    ADVANCE = "advance"
    PROMOTE = "promote"
    REJECT = "reject"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True)
class Move:
    """The outcome of one look at the evidence.

    `accepted_now` says the sequential test crossed its accept boundary on this
    look (latch it); `llr` and `test` are the test's log-likelihood ratio and where
    it stands; `held` is set when everything but the drift check says promote.
    """

    kind: MoveKind
    reason: str
    llr: float
    test: str = ""
    rung: Rung | None = None
    share: float = 0.0
    trigger: Literal["capped", "pass_rate"] | None = None
    accepted_now: bool = False
    held: str | None = None


def ladder_for(
    definition: Mapping[str, Any], strategies: Mapping[str, GradingStrategy] | None = None
) -> Ladder:
    """The ladder a challenger climbs: resourced when its workflow's registered strategy
    ranks episodes in groups (the built-in `tournament`), else the default one (also for
    a strategy not registered here, which registration refuses before any ladder).

    `strategies` are the registered ones (default: the built-in ones)."""
    grading = definition.get("grading") or {}
    registered = builtin_strategies() if strategies is None else strategies
    strategy = registered.get(str(grading.get("strategy", "pairwise_sequential")))
    return Ladder.RESOURCED if strategy is not None and strategy.grouped else Ladder.DEFAULT


def pass_rate_regressed(agg: VariantAggregate, policy: LadderPolicy) -> str | None:
    """Why the challenger's selection pass rate counts as a regression, or None."""
    if min(agg.runs, agg.baseline_runs) < policy.min_pass_rate_runs:
        return None
    mine, theirs = agg.passes / agg.runs, agg.baseline_passes / agg.baseline_runs
    if mine >= theirs - policy.pass_rate_margin:
        return None
    return (
        f"pass rate {mine:.1%} ({agg.passes}/{agg.runs}) is below the current version's "
        f"{theirs:.1%} ({agg.baseline_passes}/{agg.baseline_runs}) by more than "
        f"{policy.pass_rate_margin:.0%}"
    )


def drift(agg: VariantAggregate, policy: LadderPolicy) -> str | None:
    """Why the drift check is not clean, or None."""
    checked = agg.order_checked
    if (
        checked < MIN_ORDER_CHECKS
        or agg.order_inconsistent / checked <= policy.max_order_inconsistency
    ):
        return None
    return (
        f"the judge contradicted itself on {agg.order_inconsistent}/{checked} order checks, "
        f"above {policy.max_order_inconsistency:.0%}"
    )


def step(
    standing: Standing,
    agg: VariantAggregate,
    policy: LadderPolicy,
    sprt: SprtPolicy,
    *,
    judge_hold: str | None = None,
) -> Move:
    """What the challenger's (selection) evidence does, from where it stands.

    `judge_hold` says why the tenant's judge is not trusted to promote (its calibrated
    agreement with the verifier is low): a promotion then waits, like one the drift
    check holds.
    """
    test = evaluate(agg.record, sprt)
    if agg.record.capped:
        return Move(
            MoveKind.ROLL_BACK,
            f"{agg.record.capped} Core violation(s) on its selection episodes",
            test.llr,
            test=test.reason,
            trigger="capped",
        )
    regressed = pass_rate_regressed(agg, policy)
    if regressed is not None:
        return Move(MoveKind.ROLL_BACK, regressed, test.llr, test=test.reason, trigger="pass_rate")
    if test.decision is SprtDecision.REJECT:
        return Move(MoveKind.REJECT, test.reason, test.llr, test=test.reason)
    accepted_now = test.decision is SprtDecision.ACCEPT and not standing.accepted
    accepted = standing.accepted or accepted_now
    if standing.ladder is Ladder.DEFAULT:
        move = _default(standing, agg, policy, accepted, test.reason)
    else:
        move = _resourced(standing, agg, policy, accepted, test.reason)
    if move.kind is MoveKind.PROMOTE and (why := drift(agg, policy) or judge_hold) is not None:
        move = Move(MoveKind.STAY, why, test.llr, held=why)
    return Move(
        move.kind,
        move.reason,
        test.llr,
        test=test.reason,
        rung=move.rung,
        share=move.share,
        accepted_now=accepted_now,
        held=move.held,
    )


def _default(
    standing: Standing, agg: VariantAggregate, policy: LadderPolicy, accepted: bool, test: str
) -> Move:
    match standing.rung:
        case Rung.SHADOW:
            if agg.screened >= policy.min_shadow_runs:
                return Move(
                    MoveKind.ADVANCE,
                    f"{agg.screened} selection episodes in shadow, no Core violation",
                    0.0,
                    rung=Rung.TRIAL,
                    share=policy.trial_share,
                )
        case Rung.TRIAL:
            served = agg.served - standing.entered_served
            if accepted and served >= policy.min_trial_runs:
                return Move(
                    MoveKind.PROMOTE,
                    f"{test}; {served} trial episodes, no Core violation",
                    0.0,
                )
        case Rung.CANARY | Rung.RAMP:  # a resourced rung on the default ladder: never made
            pass
    return Move(MoveKind.STAY, "within the rung", 0.0)


def _resourced(
    standing: Standing, agg: VariantAggregate, policy: LadderPolicy, accepted: bool, test: str
) -> Move:
    s = agg.strength
    if s is None or s.episodes < policy.min_strength_episodes:
        return Move(MoveKind.STAY, "too few anchored episodes to read a strength", 0.0)
    low, high = s.interval
    shown = f"strength {s.mean:+.3f} [{low:+.3f}, {high:+.3f}] over {s.episodes} episodes"
    if high < 0:
        return Move(MoveKind.REJECT, f"{shown}: worse than the current version", 0.0)
    match standing.rung:
        case Rung.SHADOW:
            if low > 0:
                return Move(
                    MoveKind.ADVANCE,
                    f"{shown} on selection replay excludes zero",
                    0.0,
                    rung=Rung.CANARY,
                    share=policy.trial_share,
                )
        case Rung.CANARY:
            served = agg.served - standing.entered_served
            if accepted and served >= policy.min_trial_runs and low > 0:
                if not policy.ramp_shares:
                    return Move(MoveKind.PROMOTE, f"{test}; {shown}", 0.0)
                return Move(
                    MoveKind.ADVANCE,
                    f"{test}; {served} canary episodes, no Core violation",
                    0.0,
                    rung=Rung.RAMP,
                    share=policy.ramp_shares[0],
                )
        case Rung.RAMP:
            sustained = s.episodes - standing.entered_episodes
            if sustained >= policy.ramp_episodes and low > 0:
                later = [x for x in policy.ramp_shares if x > standing.share]
                if later:
                    return Move(
                        MoveKind.ADVANCE,
                        f"{shown}, sustained over {sustained} more episodes",
                        0.0,
                        rung=Rung.RAMP,
                        share=later[0],
                    )
                return Move(
                    MoveKind.PROMOTE, f"{shown}, sustained over {sustained} more episodes", 0.0
                )
        case Rung.TRIAL:  # a default rung on the resourced ladder: never made
            pass
    return Move(MoveKind.STAY, "within the rung", 0.0)
