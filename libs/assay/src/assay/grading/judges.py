"""The judge port (§11.1): relative comparisons only, never a number."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from assay.kernel.errors import AssayError
from assay.kernel.scores import CoreViolation, Verdict
from assay.messages.episode import Episode
from assay.workflow.ir import RubricItem


class JudgeFailed(AssayError):
    """The judge gave no usable answer: a recorded failure, never a guessed verdict."""


@dataclass(frozen=True)
class JudgeUsage:
    """One judge model call, for metering."""

    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float


UsageSink = Callable[[JudgeUsage], None]


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
        on_usage: UsageSink | None = None,
    ) -> Verdict:
        """Which of A and B is better, or a draw. Position bias is the caller's concern."""
        ...

    async def screen(
        self, episode: Episode, rubric: list[RubricItem], *, on_usage: UsageSink | None = None
    ) -> list[CoreViolation]:
        """`Core` violations of one episode, judged on its own terms."""
        ...


class StubJudge:
    """Deterministic judge for tests and the demo, grounded in the episodes only.

    `compare` prefers the episode that reached its output in fewer attempts,
    then the one that wrote fewer characters across its attempts (the demo
    rubric's "concise" criterion); equal on both is a draw. `screen` flags a
    `Core` criterion whose text says an output "must not contain" a quoted
    string that an attempt's output does contain.
    """

    name = "stub-judge-1"
    max_context_tokens = 0

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageSink | None = None,
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
        self, episode: Episode, rubric: list[RubricItem], *, on_usage: UsageSink | None = None
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
