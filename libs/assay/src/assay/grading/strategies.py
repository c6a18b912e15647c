"""Grading strategies: what each produces and needs, declared before it may run (§11.1, §14.2).

A strategy is a `GradingStrategy` registered by name under the
`assay.grading_strategies` entry-point group (the three built-in ones register the
same way). It declares the `Score` variant it produces, whether its episodes gather
in groups (the Swiss tournament and the resourced ladder) or are each compared with
the current version's reference, whether the judge takes part, and its
`ResourceProfile`. The strategies differ by more than an order of magnitude in judge
calls and in context length, so a deployment that cannot afford one is told when the
strategy is loaded — when a stage starts, or when a workflow that asks for it is
registered — with the limit named, never by an out-of-memory at three in the morning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from assay.grading.spend_ceilings import DailySpendCeilings
from assay.kernel.errors import AssayError
from assay.kernel.scores import Ranked, Relative, Score, Ungraded, UngradedReason
from assay.kernel.spend import SpendLimit
from assay.kernel.tenant_maps import tenant_keyed

if TYPE_CHECKING:
    from assay.grading.judges import Judge, UsageCallback
    from assay.grading.tournament import Entrant, EntrantSink
    from assay.kernel.ids import RunId
    from assay.messages.episode import Episode
    from assay.workflow.ir import GradingSpec, RubricItem


class StrategyRefused(AssayError):
    """A grading strategy's declared profile does not fit the declared capacity."""


class StrategyUnknown(StrategyRefused):
    """A workflow names a grading strategy that no installed package registers."""


class StrategyParamsInvalid(StrategyRefused):
    """A workflow's `grading.params` do not validate against its strategy's own model."""


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


def screening_calls(rubric: list[RubricItem] | None) -> float:
    """Judge calls per episode of the `Core` screen: one with a `Core` item in the rubric
    (or without a rubric, where screening is assumed), else none."""
    return 1.0 if rubric is None or any(r.layer == "core" for r in rubric) else 0.0


@dataclass(frozen=True)
class Pair:
    """One challenger episode and the current version's reference on the same task: what
    a pairwise strategy compares. `on_usage` receives each model call it makes."""

    spec: GradingSpec
    rubric: list[RubricItem]
    challenger: Episode
    challenger_passed: bool
    reference: Episode
    reference_passed: bool
    reference_run: RunId
    order_index: int
    order_check: bool
    judge: Judge
    on_usage: UsageCallback


@dataclass(frozen=True)
class GroupToRank:
    """One closed group of a grouped strategy that ranks it itself (`RanksGroups`): its
    entrants (at least two, the current version's marked `control`), the workflow's
    grading spec and the strategy's validated `params` (None: it declares no
    `params_model`), the judge (each call reserved against the tenant's grading
    ceiling; `on_usage` receives it with the name of the entrant it is billed to), the
    rubric, and a seed for any draw."""

    spec: GradingSpec
    params: BaseModel | None
    entrants: Sequence[Entrant]
    judge: Judge
    rubric: list[RubricItem]
    seed: str
    on_usage: EntrantSink


@runtime_checkable
class RanksGroups(Protocol):
    """A grouped strategy that ranks its closed groups itself, instead of the Swiss
    tournament and Bradley-Terry fit."""

    async def rank(self, group: GroupToRank) -> Mapping[str, Score]:
        """A score per entrant name: the variant the strategy `produces`, or `Ungraded`
        (an entrant left out is `Ungraded{judge_failed}`).

        Raises:
            JudgeFailed: the judge could not be used (the group is left ungraded).
        """
        ...


@runtime_checkable
class GradingStrategy(Protocol):
    """A grading strategy, as a workflow's `grading.strategy` names it.

    `produces` is the `Score` variant it grades an episode to (`Relative` or `Ranked`).
    `grouped`: its episodes gather in `(task, outcome class, epoch)` groups ranked by the
    Swiss tournament, and its challengers climb the resourced ladder; otherwise each
    challenger episode is compared with the reference by `compare` and climbs the default
    ladder. `judged`: the judge takes part (episodes are screened for `Core` violations
    and its calls are metered). `profile` declares what grading one episode asks of the
    deployment (§14.2).
    """

    name: str
    produces: type[Relative] | type[Ranked]
    grouped: bool
    judged: bool

    def profile(
        self, spec: GradingSpec, judge: Judge, rubric: list[RubricItem] | None, order_check: float
    ) -> ResourceProfile:
        """What grading one episode under `spec` with `judge` asks for."""
        ...

    async def compare(self, pair: Pair) -> Score:
        """The challenger's score against the reference (pairwise strategies only).

        Raises:
            JudgeFailed: the judge gave no usable verdict.
        """
        ...


@runtime_checkable
class RankingStrategy(GradingStrategy, RanksGroups, Protocol):
    """A grading strategy that ranks its closed groups itself (`RanksGroups`)."""


class PairwiseSequential:
    """The default (§11.3): a judge compares each challenger episode with the reference."""

    name: str = "pairwise_sequential"
    produces: type[Relative] | type[Ranked] = Relative
    grouped: bool = False
    judged: bool = True

    def profile(
        self, spec: GradingSpec, judge: Judge, rubric: list[RubricItem] | None, order_check: float
    ) -> ResourceProfile:
        """One comparison, the sampled order checks, and the screen."""
        return ResourceProfile(
            strategy=self.name,
            models=(judge.name,),
            max_context_tokens=judge.max_context_tokens,
            calls_per_episode=1.0 + order_check + screening_calls(rubric),
        )

    async def compare(self, pair: Pair) -> Score:
        """Pass against fail by the verifier, otherwise the judge (`compare_with_reference`)."""
        from assay.grading.pairwise import compare_with_reference

        relative, _ = await compare_with_reference(
            challenger=pair.challenger,
            challenger_passed=pair.challenger_passed,
            reference=pair.reference,
            reference_passed=pair.reference_passed,
            reference_run=pair.reference_run,
            order_index=pair.order_index,
            judge=pair.judge,
            rubric=pair.rubric,
            on_usage=pair.on_usage,
            order_check=pair.order_check,
        )
        return relative


class Tournament:
    """Opt-in (§11.4-§11.6): groups, Swiss pairing, Bradley-Terry-Davidson strengths."""

    name: str = "tournament"
    produces: type[Relative] | type[Ranked] = Ranked
    grouped: bool = True
    judged: bool = True

    def profile(
        self, spec: GradingSpec, judge: Judge, rubric: list[RubricItem] | None, order_check: float
    ) -> ResourceProfile:
        """The Swiss rounds at the group's quorum, both orderings, and the screen."""
        return ResourceProfile(
            strategy=self.name,
            models=(judge.name,),
            max_context_tokens=judge.max_context_tokens,
            calls_per_episode=tournament_calls_per_episode(spec.group_quorum)
            + screening_calls(rubric),
        )

    async def compare(self, pair: Pair) -> Score:
        """Never called: a grouped strategy's episodes are ranked in their group."""
        raise NotImplementedError("the tournament strategy ranks groups, not pairs")


class Deterministic:
    """A number the user already computes (§11.1): no judge, no model."""

    name: str = "deterministic"
    produces: type[Relative] | type[Ranked] = Ranked
    grouped: bool = False
    judged: bool = False

    def profile(
        self, spec: GradingSpec, judge: Judge, rubric: list[RubricItem] | None, order_check: float
    ) -> ResourceProfile:
        """Nothing: no model, no context, no calls."""
        return ResourceProfile(
            strategy=self.name, models=(), max_context_tokens=0, calls_per_episode=0.0
        )

    async def compare(self, pair: Pair) -> Score:
        """The challenger's metric as a delta from the reference's."""
        from assay.grading.deterministic import deterministic_rank, metric_value

        assert pair.spec.metric is not None  # the IR requires it for this strategy
        mine = metric_value(pair.challenger, pair.spec.metric)
        theirs = metric_value(pair.reference, pair.spec.metric)
        if mine is None or theirs is None:
            return Ungraded(reason=UngradedReason.NO_METRIC)
        return deterministic_rank(
            mine, theirs, higher_is_better=pair.spec.higher_is_better is not False
        )


def builtin_strategies() -> dict[str, GradingStrategy]:
    """The strategies Assay ships, by name (also registered as entry points)."""
    return {s.name: s for s in (PairwiseSequential(), Tournament(), Deterministic())}


def strategy_named(name: str, strategies: Mapping[str, GradingStrategy]) -> GradingStrategy:
    """The registered strategy `name`.

    Raises:
        StrategyUnknown: no installed package registers it (the message lists those that do).
    """
    found = strategies.get(name)
    if found is None:
        raise StrategyUnknown(
            f"grading strategy {name!r} is not registered (registered: "
            f"{', '.join(sorted(strategies))}); install the package that provides it"
        )
    return found


def params_of(strategy: GradingStrategy, spec: GradingSpec) -> BaseModel | None:
    """`spec.params` validated by the strategy's own `params_model` (its defaults when
    the block is left out); None for a strategy that declares no model.

    Raises:
        StrategyParamsInvalid: the strategy takes no parameters and `params` is set, or
            they do not validate (the message names the strategy and the field).
    """
    model: type[BaseModel] | None = getattr(strategy, "params_model", None)
    if model is None:
        if spec.params is not None:
            raise StrategyParamsInvalid(
                f"grading strategy {strategy.name!r} takes no grading.params (its parameters "
                "are the grading block's own fields)"
            )
        return None
    try:
        return model.model_validate(spec.params or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(the block)"
        raise StrategyParamsInvalid(
            f"grading strategy {strategy.name!r}: grading.params.{field}: {first['msg']}"
        ) from exc


GROUP_FIELDS = ("quorum", "group_timeout_s", "prior_precision")
"""`grading` fields that apply to a grouped strategy only."""


def check_strategy(spec: GradingSpec, strategies: Mapping[str, GradingStrategy]) -> GradingStrategy:
    """The registered strategy `spec` names, once its parameters validate and the group
    fields it sets apply to it.

    Raises:
        StrategyUnknown: no installed package registers it.
        StrategyParamsInvalid: its `params` do not validate.
        StrategyRefused: a group field is set for a strategy that is not grouped.
    """
    strategy = strategy_named(spec.strategy, strategies)
    params_of(strategy, spec)
    if not strategy.grouped:
        for name in GROUP_FIELDS:
            if getattr(spec, name) is not None:
                raise StrategyRefused(
                    f"grading.{name} applies to a grouped strategy; {spec.strategy!r} is not one"
                )
    return strategy


def profile(
    spec: GradingSpec,
    judge: Judge,
    rubric: list[RubricItem] | None = None,
    *,
    order_check: float = 0.0,
    strategies: Mapping[str, GradingStrategy] | None = None,
) -> ResourceProfile:
    """The profile of `spec` graded with `judge`, as its registered strategy declares it.

    `order_check` is the sampled fraction of pairwise comparisons asked again with
    the positions swapped. A rubric with a `Core` item adds one screening call per
    episode; without a rubric, screening is assumed. `strategies` are the registered
    ones (default: the built-in ones).

    Raises:
        StrategyUnknown: `spec` names a strategy that is not registered.
        StrategyParamsInvalid: its `grading.params` do not validate.
        StrategyRefused: the strategy's `profile` gave no `ResourceProfile`, or a group
            field is set for a strategy that is not grouped.
    """
    registered = builtin_strategies() if strategies is None else strategies
    needs = check_strategy(spec, registered).profile(spec, judge, rubric, order_check)
    if not isinstance(needs, ResourceProfile):
        raise StrategyRefused(
            f"grading strategy {spec.strategy!r} declared a {type(needs).__name__} as its "
            "profile, not a ResourceProfile: what it needs cannot be checked"
        )
    return needs


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


class GradingPolicy(GradingCapacity, DailySpendCeilings):
    """Capacity, spend ceilings and health sampling of grading (`ASSAY_GRADING_*`).

    The policy is the capacity it declares (`check_fits` takes it as one). `ceilings`
    is a per-tenant map of judge calls per day, written `<tenant-uuid>=<calls>,...`;
    a tenant not in it has `calls_per_day`; tokens and dollars per day have their own
    ceilings (`DailySpendCeilings`). Every judge call is reserved at its worst case
    against the tenant's ceilings for the UTC day the graded fact occurred, before it
    is made, in the tournament stage's spend ledger: a call that does not fit is not
    made, and the run is `Ungraded{BudgetExhausted}` (a tournament group is first
    played in fewer rounds). Handlers on every partition reserve from the same ledger
    row, so together they never pass the ceiling. `order_check`
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

    def limit_for(self, tenant: str) -> SpendLimit:
        """The tenant's grading ceiling per UTC day in calls, tokens and dollars."""
        return self.spend_limit(tenant, self.ceiling_for(tenant))
