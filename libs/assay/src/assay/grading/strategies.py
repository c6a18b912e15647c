"""What a grading strategy needs, declared before it may run (§11.1, §14.2).

The strategies differ by more than an order of magnitude in judge calls and in
context length, so each one declares a `ResourceProfile` and a deployment that
cannot afford it is told when the strategy is loaded — when a stage starts, or
when a workflow that asks for it is registered — with the limit named, never by
an out-of-memory at three in the morning.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from assay.kernel.errors import AssayError
from assay.kernel.tenant_maps import tenant_keyed

if TYPE_CHECKING:
    from assay.grading.judges import Judge
    from assay.workflow.ir import GradingSpec, RubricItem


class StrategyRefused(AssayError):
    """A grading strategy's declared profile does not fit the declared capacity."""


class ResourceProfile(BaseModel):
    """What one strategy asks of the deployment, per episode graded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: str = Field(description="Strategy name.")
    models: tuple[str, ...] = Field(description="Models it calls (one: the judge).")
    max_context_tokens: int = Field(ge=0, description="Largest single-call context it asks for.")
    calls_per_episode: float = Field(ge=0, description="Judge calls per episode graded.")


class GradingCapacity(BaseModel):
    """What the deployment can afford for grading (read from `ASSAY_GRADING_*`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_models: int = Field(1, ge=0, description="Models grading may keep resident.")
    max_context_tokens: int = Field(
        131_072, ge=1, description="Largest single-call context a grading strategy may ask for."
    )
    max_calls_per_episode: float = Field(
        8.0,
        gt=0,
        allow_inf_nan=False,
        description="Judge calls per graded episode a strategy may declare.",
    )


def tournament_calls_per_episode(group_size: int) -> float:
    """Judge calls per episode of a Swiss tournament judged in both orderings.

    ⌈log₂ G⌉ rounds of ⌊G/2⌋ pairs, two calls a pair, spread over G episodes.
    """
    if group_size < 2:
        return 0.0
    rounds = math.ceil(math.log2(group_size))
    return 2 * rounds * (group_size // 2) / group_size


def profile(
    spec: GradingSpec,
    judge: Judge,
    rubric: list[RubricItem] | None = None,
    *,
    order_check: float = 0.0,
) -> ResourceProfile:
    """The profile of `spec` graded with `judge`.

    `order_check` is the sampled fraction of pairwise comparisons asked again with
    the positions swapped. A rubric with a `Core` item adds one screening call per
    episode; without a rubric, screening is assumed.
    """
    screens = 1.0 if rubric is None or any(r.layer == "core" for r in rubric) else 0.0
    match spec.strategy:
        case "deterministic":
            return ResourceProfile(
                strategy=spec.strategy, models=(), max_context_tokens=0, calls_per_episode=0.0
            )
        case "pairwise_sequential":
            calls = 1.0 + order_check + screens
        case "tournament":
            calls = tournament_calls_per_episode(spec.group_quorum) + screens
    return ResourceProfile(
        strategy=spec.strategy,
        models=(judge.name,),
        max_context_tokens=judge.max_context_tokens,
        calls_per_episode=calls,
    )


def check_fits(profile: ResourceProfile, capacity: GradingCapacity) -> None:
    """Refuse a profile that does not fit, naming the limit it exceeds.

    Raises:
        StrategyRefused: too many models, too long a context, or too many calls.
    """
    if len(profile.models) > capacity.max_models:
        raise StrategyRefused(
            f"grading strategy {profile.strategy!r} calls {len(profile.models)} model(s) "
            f"({', '.join(profile.models)}); ASSAY_GRADING_MAX_MODELS is {capacity.max_models}"
        )
    if profile.max_context_tokens > capacity.max_context_tokens:
        raise StrategyRefused(
            f"grading strategy {profile.strategy!r} asks for {profile.max_context_tokens} "
            f"tokens of context per call; ASSAY_GRADING_MAX_CONTEXT_TOKENS is "
            f"{capacity.max_context_tokens}"
        )
    if profile.calls_per_episode > capacity.max_calls_per_episode:
        raise StrategyRefused(
            f"grading strategy {profile.strategy!r} makes {profile.calls_per_episode:.2f} judge "
            f"calls per episode; ASSAY_GRADING_MAX_CALLS_PER_EPISODE is "
            f"{capacity.max_calls_per_episode:g}"
        )


class GradingPolicy(GradingCapacity):
    """Capacity, spend ceilings and health sampling of grading (`ASSAY_GRADING_*`).

    The policy is the capacity it declares (`check_fits` takes it as one). `ceilings`
    is a per-tenant map of judge calls per day, written `<tenant-uuid>=<calls>,...`;
    a tenant not in it has `calls_per_day`. A tenant whose judge calls today (UTC, by
    the time the graded fact occurred) reached its ceiling gets
    `Ungraded{BudgetExhausted}` until the day turns; a grading that starts under the
    ceiling finishes, so one grading may overshoot it by its own calls. `order_check`
    is the fraction of pairwise comparisons asked again with the positions swapped,
    to measure order consistency.
    """

    calls_per_day: int = Field(100_000, ge=0, description="Judge calls per tenant per UTC day.")
    ceilings: dict[str, int] = Field(
        default_factory=dict, description="Per-tenant ceilings: `<tenant-uuid>=<calls>,...`."
    )
    order_check: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Fraction of pairwise comparisons asked again with positions swapped.",
    )

    @field_validator("ceilings", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_keyed(value, "calls")

    def ceiling_for(self, tenant: str) -> int:
        """The tenant's judge calls per day."""
        return self.ceilings.get(str(tenant), self.calls_per_day)
