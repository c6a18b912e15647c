"""A judge served by an OpenAI-compatible chat-completions model (§11.1).

`ChatJudge` asks a model and reads its answer strictly: the prompt is built by
`JudgePrompts` (the rubric first, then the episodes' facts, within character
budgets) and the answer parsed by `judge_answers` (one JSON object, nothing
else). The model is any `JudgeModel` — in practice the engine's
`ChatCompletionsModel`, which the runtime builds and hands over, so the judge
reuses its retries, backoff and strict completion parsing. (The grading layer
does not import the engine; the port below is what it needs of it.)

Metering: every model call the endpoint answered is reported through the
caller's `on_usage` once its answer was read — marked `failed` when the answer
was unusable (a refusal, or output not in the strict format), so its tokens are
counted as spend and never as an answer. A call that never answered reports
nothing.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

from assay.grading.judge_answers import parse_verdict, parse_violations
from assay.grading.judge_prompts import (
    DEFAULT_EPISODE_CHARS,
    DEFAULT_RUBRIC_CHARS,
    MIN_EPISODE_CHARS,
    JudgePrompt,
    JudgePrompts,
    core_criteria,
)
from assay.grading.judges import JudgeFailed, JudgeUsage, UsageCallback
from assay.kernel.canonical import digest
from assay.kernel.errors import AssayError
from assay.kernel.scores import CoreViolation, Verdict
from assay.messages.episode import Episode
from assay.workflow.ir import RubricItem

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 3
"""The context estimate's characters per token. English prose averages about four
under BPE tokenizers; three leaves headroom for code, JSON and other languages,
because `max_context_tokens` is declared as a ceiling (§14.2), not an average."""
TEMPLATE_TOKENS = 64
"""Tokens allowed for the chat template's role markers around the two messages."""


class JudgeCompletion(Protocol):
    """What a `JudgeModel` call returns (the engine's `Completion` fits)."""

    @property
    def text(self) -> str:
        """The model's answer."""
        ...

    @property
    def model(self) -> str:
        """The model that served the call."""
        ...

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens consumed."""
        ...

    @property
    def completion_tokens(self) -> int:
        """Completion tokens produced."""
        ...

    @property
    def cost_usd(self) -> float:
        """The call's price."""
        ...


class JudgeModel(Protocol):
    """The chat model a `ChatJudge` asks (the engine's `ChatCompletionsModel` fits).

    `complete` sends `system` as a system message and `prompt` as the user
    message, at temperature 0, and raises an `AssayError` when the call fails:
    the endpoint stays unavailable, refuses the request, or answers with a body
    that is not a completion. When that body still reported its usage (a model's
    refusal), the error's `billed` attribute holds it as a `JudgeCompletion`.
    """

    name: str

    async def complete(
        self, prompt: str, *, max_tokens: int, seed: str, system: str | None = None
    ) -> JudgeCompletion:
        """The model's completion of `prompt` after `system`."""
        ...

    async def aclose(self) -> None:
        """Release the model's connections."""
        ...


class ChatJudge:
    """A `Judge` that asks a chat model, reads its answer strictly, reports usage.

    The judge owns `model`: `aclose()` closes it.

    Args:
        model: the chat model to ask.
        episode_chars: characters one rendered episode may take; longer texts are
            cut with a marker.
        rubric_chars: characters the criteria of one prompt may take; a longer
            rubric fails the call (`JudgeFailed`) before any model call.
        max_answer_tokens: completion tokens one answer may take.
        cache_size: rendered episodes kept for reuse.

    Attributes:
        name: the judge's name, which is the model id.
        model_id: the model id every call names (§11.1 `ResourceProfile.models`).
        max_context_tokens: the most tokens one call can need — prompt and answer —
            estimated from the character budgets at `CHARS_PER_TOKEN` characters a
            token, plus `TEMPLATE_TOKENS` for the chat template
            (`ResourceProfile.max_context_tokens`).
        prompts: the prompt builder (its `hits`/`misses` count cache use).

    Raises:
        ValueError: a budget or size out of range.
    """

    def __init__(
        self,
        model: JudgeModel,
        *,
        episode_chars: int = DEFAULT_EPISODE_CHARS,
        rubric_chars: int = DEFAULT_RUBRIC_CHARS,
        max_answer_tokens: int = 512,
        cache_size: int = 64,
    ) -> None:
        if max_answer_tokens < 1:
            raise ValueError(f"max_answer_tokens must be >= 1: {max_answer_tokens}")
        self._model = model
        self.prompts = JudgePrompts(
            episode_chars=episode_chars, rubric_chars=rubric_chars, cache_size=cache_size
        )
        self.max_answer_tokens = max_answer_tokens
        self.name = model.name
        self.model_id = model.name
        self.prices: object = getattr(model, "prices", None)
        """The model's per-token prices, when it declares them (what a call's worst case
        costs before it is made: the tournament reserves it against the tenant's ceiling)."""
        self.max_context_tokens = (
            math.ceil(self.prompts.max_prompt_chars / CHARS_PER_TOKEN)
            + TEMPLATE_TOKENS
            + max_answer_tokens
        )

    async def __aenter__(self) -> ChatJudge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the model. The judge is unusable after."""
        await self._model.aclose()

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        """Which of A and B is better by the rubric's prescriptive and contextual
        criteria, or a draw. One model call.

        Raises:
            JudgeFailed: the rubric is over budget, the call failed, or the answer
                is not exactly a verdict object.
        """
        done = await self._ask(self.prompts.compare(a, b, rubric), on_usage)
        try:
            verdict, reason = parse_verdict(done.text)
        except JudgeFailed:
            _report(on_usage, done, failed=True)
            raise
        _report(on_usage, done, failed=False)
        log.debug("judge %s: %s (%s)", self.name, verdict.value, reason)
        return verdict

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        """The core criteria `episode` violates. One model call, none when the
        rubric has no core criteria.

        Raises:
            JudgeFailed: the rubric is over budget, the call failed, or the answer
                is not exactly a violation list of the rubric's core criteria.
        """
        core = core_criteria(rubric)
        if not core:
            return []
        done = await self._ask(self.prompts.screen(episode, core), on_usage)
        try:
            violations = parse_violations(done.text, core)
        except JudgeFailed:
            _report(on_usage, done, failed=True)
            raise
        _report(on_usage, done, failed=False)
        return violations

    async def _ask(self, prompt: JudgePrompt, on_usage: UsageCallback | None) -> JudgeCompletion:
        """The model's completion of `prompt`; a failed call that was billed is reported
        (as failed) before `JudgeFailed` is raised."""
        # Same prompt, same seed: a server that honours seeds answers a repeat the same way.
        seed = "judge:" + digest(f"{prompt.system}\x1f{prompt.user}".encode())
        try:
            return await self._model.complete(
                prompt.user,
                max_tokens=self.max_answer_tokens,
                seed=seed,
                system=prompt.system,
            )
        except AssayError as exc:
            billed: JudgeCompletion | None = getattr(exc, "billed", None)
            if billed is not None:
                _report(on_usage, billed, failed=True)
            raise JudgeFailed(f"the model call failed ({type(exc).__name__}: {exc})") from exc


def _report(on_usage: UsageCallback | None, done: JudgeCompletion, *, failed: bool) -> None:
    if on_usage is not None:
        on_usage(
            JudgeUsage(
                done.model, done.prompt_tokens, done.completion_tokens, done.cost_usd, failed
            )
        )


def episode_chars_within(
    context_tokens: int, *, rubric_chars: int = DEFAULT_RUBRIC_CHARS, max_answer_tokens: int = 512
) -> int:
    """The most characters one episode may take so that a judge call — two episodes,
    the criteria and the answer — needs at most `context_tokens` (§14.2: the judge's
    prompt budget follows from the derived context ceiling).

    Raises:
        ValueError: not even `MIN_EPISODE_CHARS` fit.
    """

    def need(episode_chars: int) -> int:
        prompts = JudgePrompts(episode_chars=episode_chars, rubric_chars=rubric_chars)
        chars = prompts.max_prompt_chars
        return math.ceil(chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS + max_answer_tokens

    low, high = MIN_EPISODE_CHARS, max(MIN_EPISODE_CHARS, context_tokens * CHARS_PER_TOKEN)
    if need(low) > context_tokens:
        raise ValueError(
            f"a judge call needs {need(low)} tokens of context at the smallest episode budget "
            f"({MIN_EPISODE_CHARS} characters); the ceiling is {context_tokens}"
        )
    while low < high:  # the largest budget whose need fits
        mid = (low + high + 1) // 2
        if need(mid) <= context_tokens:
            low = mid
        else:
            high = mid - 1
    return low
