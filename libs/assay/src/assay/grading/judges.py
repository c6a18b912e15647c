"""The judge port (§11.1): relative comparisons only, never a number.

A judge answers two questions about frozen episodes and nothing else:
`compare` (which of two episodes of one outcome class is better, or a draw) and
`screen` (which `Core` criteria one episode violates, §11.7). Every model call a
judge makes is reported through the caller's `on_usage` callback, so the stage
that asked can meter it per run and purpose (§14.1). A judge that cannot answer
raises `JudgeFailed`; it never guesses a verdict.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from assay.kernel.errors import AssayError
from assay.kernel.scores import CoreViolation, Verdict

if TYPE_CHECKING:
    from assay.messages.episode import Episode
    from assay.workflow.ir import RubricItem

_tracer = trace.get_tracer("assay.grading")

EXCERPT_CHARS = 200
"""Characters of a judge's raw output that `JudgeFailed` keeps."""


@dataclass(frozen=True)
class JudgeUsage:
    """One model call a judge made, and what it cost.

    Attributes:
        model: the model that served the call (the judge's name for the stub).
        prompt_tokens: prompt tokens the call consumed.
        completion_tokens: completion tokens it produced.
        cost_usd: its price at the judge's configured rates (0.0 without prices).
        failed: the endpoint answered (and billed) but the answer was unusable — a
            refusal, or output not in the judge's format; the judge raises
            `JudgeFailed` for it. Spend, never an answer.
    """

    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    failed: bool = False


UsageCallback = Callable[[JudgeUsage], None]
"""Called once per model call a judge makes that the endpoint answered, once the answer
was read: `failed` marks one that gave no usable answer. A call that never answered (a
stopped endpoint, a timeout) reports nothing."""


class JudgeFailed(AssayError):
    """The judge gave no usable answer; no verdict or violation list was guessed.

    Raised for output that does not parse in the judge's strict format, an
    endpoint that stays unavailable through its retries, or a request the
    endpoint refuses.

    Attributes:
        reason: what went wrong, in one line.
        excerpt: the start of the raw output, whitespace collapsed (empty when
            the model gave none).
    """

    def __init__(self, reason: str, raw: str = "") -> None:
        self.reason = reason
        self.excerpt = excerpt(raw)
        shown = f"; output: {self.excerpt!r}" if self.excerpt else ""
        super().__init__(f"judge failed: {reason}{shown}")


def excerpt(raw: str) -> str:
    """At most `EXCERPT_CHARS` of `raw`, whitespace collapsed, `…` marking a cut."""
    flat = re.sub(r"\s+", " ", raw).strip()
    return flat if len(flat) <= EXCERPT_CHARS else flat[:EXCERPT_CHARS] + "…"


class Judge(Protocol):
    """Compares two episodes of one outcome class; screens one for `Core` violations."""

    name: str
    """The judge's model id, as metering and resource profiles name it."""
    max_context_tokens: int
    """Largest single-call context a comparison asks for (0: no model behind it)."""

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        """Which of A and B is better, or a draw. Position bias is the caller's concern.

        Raises:
            JudgeFailed: the judge gave no usable verdict.
        """
        ...

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        """`Core` violations of one episode, judged on its own terms.

        Raises:
            JudgeFailed: the judge gave no usable answer.
        """
        ...


class TracedJudge:
    """A judge whose every call is a span (§14): which judge, for what, and how it ended."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self.name = judge.name
        self.max_context_tokens = judge.max_context_tokens

    def __getattr__(self, attr: str) -> object:  # anything else the judge offers
        return getattr(self.judge, attr)

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        with _tracer.start_as_current_span(
            "judge compare", kind=SpanKind.CLIENT, attributes={"assay.judge": self.name}
        ):
            return await self.judge.compare(a, b, rubric, on_usage=on_usage)

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        with _tracer.start_as_current_span(
            "judge screen", kind=SpanKind.CLIENT, attributes={"assay.judge": self.name}
        ):
            return await self.judge.screen(episode, rubric, on_usage=on_usage)


def traced(judge: Judge) -> Judge:
    """`judge` with a span around each call (itself if it already has)."""
    return judge if isinstance(judge, TracedJudge) else TracedJudge(judge)


class StubJudge:
    """Deterministic judge for tests and the demo, grounded in the episodes only.

    `compare` prefers the episode that reached its output in fewer attempts,
    then the one that wrote fewer characters across its attempts (the demo
    rubric's "concise" criterion); equal on both is a draw. It reports one
    zero-token call per comparison. `screen` flags a `Core` criterion whose text
    says an output "must not contain" a quoted string that an attempt's output
    does contain; it calls no model, so it reports no usage.
    """

    name = "stub-judge-1"
    max_context_tokens = 0

    async def aclose(self) -> None:
        """Nothing to release; present so a runtime can close any judge it built."""

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        if on_usage is not None:
            on_usage(JudgeUsage(self.name, 0, 0, 0.0))

        def cost(e: Episode) -> tuple[int, int]:
            return (len(e.attempts), sum(len(v.output or "") for v in e.attempts))

        ca, cb = cost(a), cost(b)
        if ca == cb:
            return Verdict.DRAW
        return Verdict.A if ca < cb else Verdict.B

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        found = []
        for item in rubric:
            if item.layer != "core" or "must not contain" not in item.text:
                continue
            quoted = item.text.split("must not contain", 1)[1].strip().strip(".").strip("'\"")
            for view in episode.attempts:
                if quoted and view.output and quoted in view.output:
                    found.append(
                        CoreViolation(
                            criterion=item.id,
                            evidence=f"step {view.step} attempt {view.attempt} output contains "
                            f"{quoted!r}",
                        )
                    )
                    break
        return found
