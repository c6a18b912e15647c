"""What decide's handlers share, on their unit of work as `uow.deps`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from assay.engine import Tool
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.judges import Judge
from assay.grading.ladder import LadderPolicy
from assay.grading.proposers import ProposalPolicy, Proposer
from assay.grading.sprt import SprtPolicy
from assay.grading.strategies import GradingPolicy, GradingStrategy, builtin_strategies
from assay.runtime import StageDeps, UnitOfWork


@dataclass(frozen=True)
class Deciding:
    """What decide's handlers use: the tools and verifier kinds a version may name, what
    shadow's entry criteria check it against, the ladder's policies, the proposer, and
    the calibration policy whose agreement threshold holds promotion."""

    tools: Mapping[str, Tool]
    verifier_kinds: frozenset[str]
    judge: Judge
    grading: GradingPolicy
    shadow_rate: float
    ladder: LadderPolicy
    sprt: SprtPolicy
    proposer: Proposer
    proposals: ProposalPolicy
    calibration: CalibrationPolicy
    strategies: Mapping[str, GradingStrategy] = field(default_factory=builtin_strategies)
    """The registered grading strategies: a challenger's ladder follows its strategy's."""

    @classmethod
    def of(cls, deps: StageDeps) -> Deciding:
        """Decide's share of the stage's ports and policies."""
        return cls(
            tools=dict(deps.tools),
            verifier_kinds=deps.verifier_kinds,
            judge=deps.judge,
            grading=deps.grading,
            shadow_rate=deps.shadow_rate,
            ladder=deps.ladder,
            sprt=deps.sprt,
            proposer=deps.proposer,
            strategies=deps.strategies,
            proposals=deps.proposals,
            calibration=deps.calibration,
        )


DecideUnitOfWork = UnitOfWork[Deciding]
