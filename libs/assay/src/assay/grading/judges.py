"""The judge port (§11.1): relative comparisons only, never a number."""

from __future__ import annotations

from typing import Protocol

from assay.kernel.scores import CoreViolation, Verdict
from assay.messages.episode import Episode
from assay.workflow.ir import RubricItem


class Judge(Protocol):
    """Compares two episodes of one outcome class; screens one for `Core` violations."""

    name: str

    async def compare(self, a: Episode, b: Episode, rubric: list[RubricItem]) -> Verdict:
        """Which of A and B is better, or a draw. Position bias is the caller's concern."""
        ...

    async def screen(self, episode: Episode, rubric: list[RubricItem]) -> list[CoreViolation]:
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

    async def compare(self, a: Episode, b: Episode, rubric: list[RubricItem]) -> Verdict:
        def cost(e: Episode) -> tuple[int, int]:
            return (len(e.attempts), sum(len(v.output or "") for v in e.attempts))

        ca, cb = cost(a), cost(b)
        if ca == cb:
            return Verdict.DRAW
        return Verdict.A if ca < cb else Verdict.B

    async def screen(self, episode: Episode, rubric: list[RubricItem]) -> list[CoreViolation]:
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
