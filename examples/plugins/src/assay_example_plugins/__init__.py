"""One Assay plugin of each kind, registered by this package's entry points.

- `adder` (`assay.models`): a deterministic model that answers with the sum of the
  integers in its prompt, and counts a prompt token per word.
- `fewer_prompt_tokens` (`assay.judges`): prefers the episode whose run spent fewer
  prompt tokens; screens nothing.
- `nothing_to_propose` (`assay.proposers`): never drafts a new version.
- `scratch` (`assay.sandboxes`): Assay's local sandbox, its workspaces under
  `<data dir>/scratch`.
- `single_look` (`assay.grading_strategies`): a pairwise strategy that asks the judge
  once per challenger episode, the challenger always shown first, and grades to
  `Relative`.
- `fewest_tokens` (`assay.grading_strategies`): a grouped strategy that ranks each
  closed group itself, without the judge: an entrant's strength is the prompt tokens
  it saved against control, times `grading.params.per_token` (its own parameter
  block, validated by `FewestTokensParams`).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from assay.engine.models import Completion, Model
from assay.engine.priority import PriorityLimiter
from assay.grading.judges import Judge, UsageCallback
from assay.grading.proposers import Proposal, ProposalInput, Proposer
from assay.grading.strategies import GroupToRank, Pair, ResourceProfile
from assay.kernel.scores import CoreViolation, DecidedBy, Outcome, Ranked, Relative, Score, Verdict
from assay.messages import Episode
from assay.runtime.endpoints import JudgeSettings, ModelSettings, ProposerSettings
from assay.runtime.registry import JudgePlugin, ModelPlugin, ProposerPlugin, SandboxPlugin
from assay.runtime.sections import SandboxSettings
from assay.sandbox.port import SandboxProvider
from assay.store.ports import BlobStore
from assay.workflow import GradingSpec, RubricItem


class Adder:
    """Answers with the sum of the integers in the prompt."""

    name = "adder-1"

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        total = sum(int(n) for n in re.findall(r"-?\d+", prompt))
        return Completion(
            text=str(total),
            model=self.name,
            prompt_tokens=len(prompt.split()),
            completion_tokens=1,
        )

    async def aclose(self) -> None:
        return None


class FewerPromptTokens:
    """Prefers the episode whose run spent fewer prompt tokens; a tie is a draw."""

    name = "fewer-prompt-tokens-1"
    max_context_tokens = 0

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        if a.usage.prompt_tokens == b.usage.prompt_tokens:
            return Verdict.DRAW
        return Verdict.A if a.usage.prompt_tokens < b.usage.prompt_tokens else Verdict.B

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        return []

    async def aclose(self) -> None:
        return None


class NothingToPropose:
    """Never drafts a new version: the slow loop stays quiet."""

    name = "nothing-to-propose"

    async def propose(self, request: ProposalInput) -> Proposal | None:
        return None

    async def aclose(self) -> None:
        return None


class SingleLook:
    """Ask the judge once, the challenger shown as A; no screen, no order check."""

    name = "single_look"
    produces: type[Relative] | type[Ranked] = Relative
    grouped = False
    judged = True

    def profile(
        self, spec: GradingSpec, judge: Judge, rubric: list[RubricItem] | None, order_check: float
    ) -> ResourceProfile:
        return ResourceProfile(
            strategy=self.name,
            models=(judge.name,),
            max_context_tokens=judge.max_context_tokens,
            calls_per_episode=1.0,
        )

    async def compare(self, pair: Pair) -> Score:
        verdict = await pair.judge.compare(
            pair.challenger, pair.reference, pair.rubric, on_usage=pair.on_usage
        )
        outcome = {Verdict.A: Outcome.WIN, Verdict.B: Outcome.LOSS, Verdict.DRAW: Outcome.DRAW}
        return Relative(
            against=pair.reference_run,
            verdict=verdict,
            position="a",
            outcome=outcome[verdict],
            decided_by=DecidedBy.JUDGE,
        )


class FewestTokensParams(BaseModel):
    """`fewest_tokens`'s parameters (`grading.params`)."""

    model_config = ConfigDict(extra="forbid")
    per_token: float = Field(1.0, gt=0, description="Strength per prompt token saved.")


class FewestTokens:
    """Rank a group by prompt tokens, fewer first: strength is the tokens saved against
    control, times `per_token`. No judge, no model."""

    name = "fewest_tokens"
    produces: type[Relative] | type[Ranked] = Ranked
    grouped = True
    judged = False
    params_model = FewestTokensParams

    def profile(
        self, spec: GradingSpec, judge: Judge, rubric: list[RubricItem] | None, order_check: float
    ) -> ResourceProfile:
        return ResourceProfile(
            strategy=self.name, models=(), max_context_tokens=0, calls_per_episode=0.0
        )

    async def compare(self, pair: Pair) -> Score:
        raise NotImplementedError("fewest_tokens ranks groups, not pairs")

    async def rank(self, group: GroupToRank) -> dict[str, Score]:
        params = group.params
        assert isinstance(params, FewestTokensParams)  # validated at registration
        controls = [e for e in group.entrants if e.control]
        base = (
            controls[0].episode.usage.prompt_tokens
            if controls
            else sum(e.episode.usage.prompt_tokens for e in group.entrants) / len(group.entrants)
        )
        scores: dict[str, Score] = {}
        for e in group.entrants:
            strength = (base - e.episode.usage.prompt_tokens) * params.per_token
            scores[e.name] = Ranked(
                strength=strength,
                interval=(strength, strength),
                group_size=len(group.entrants),
                anchored=bool(controls),
            )
        return scores


def _adder(settings: ModelSettings, limiter: PriorityLimiter | None) -> Model:
    return Adder()


def _judge(
    settings: JudgeSettings, episode_chars: int | None, limiter: PriorityLimiter | None
) -> Judge:
    return FewerPromptTokens()


def _proposer(settings: ProposerSettings, limiter: PriorityLimiter | None) -> Proposer:
    return NothingToPropose()


def _scratch(settings: SandboxSettings, blobs: BlobStore, data_dir: Path) -> SandboxProvider:
    return settings.model_copy(update={"root": str(data_dir / "scratch")}).provider(blobs, data_dir)


ADDER = ModelPlugin("adder", _adder)
FEWER_PROMPT_TOKENS = JudgePlugin("fewer_prompt_tokens", _judge)
NOTHING_TO_PROPOSE = ProposerPlugin("nothing_to_propose", _proposer)
SCRATCH = SandboxPlugin("scratch", _scratch)
