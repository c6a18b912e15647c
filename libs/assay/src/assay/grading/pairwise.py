"""One PairwiseSequential comparison (§11.3, §11.8)."""

from __future__ import annotations

from typing import Literal

from assay.grading.judges import Judge, UsageCallback
from assay.kernel.ids import RunId
from assay.kernel.scores import DecidedBy, Outcome, Relative, Verdict
from assay.messages.episode import Episode
from assay.workflow.ir import RubricItem

Position = Literal["a", "b"]


def challenger_position(order_index: int) -> Position:
    """The challenger is shown as A on even comparisons and as B on odd ones."""
    return "a" if order_index % 2 == 0 else "b"


def _outcome(verdict: Verdict, position: Position) -> Outcome:
    if verdict is Verdict.DRAW:
        return Outcome.DRAW
    mine = Verdict.A if position == "a" else Verdict.B
    return Outcome.WIN if verdict is mine else Outcome.LOSS


async def compare_with_reference(
    *,
    challenger: Episode,
    challenger_passed: bool,
    reference: Episode,
    reference_passed: bool,
    reference_run: RunId,
    order_index: int,
    judge: Judge,
    rubric: list[RubricItem],
    on_usage: UsageCallback | None = None,
    order_check: bool = False,
) -> tuple[Relative, int]:
    """Score a challenger episode against the reference; return the score and judge calls.

    A verified pass against a verified fail is decided by the verifier and never
    shown to the judge. Otherwise the judge sees the pair in alternating order;
    with `order_check` it is asked again with the positions swapped, and whether it
    mirrored itself is recorded (the score keeps the first verdict). `on_usage`
    receives each model call the judge makes.

    Raises:
        JudgeFailed: the judge gave no usable verdict.
    """
    position = challenger_position(order_index)
    if challenger_passed != reference_passed:
        outcome = Outcome.WIN if challenger_passed else Outcome.LOSS
        mine = Verdict.A if position == "a" else Verdict.B
        theirs = Verdict.B if mine is Verdict.A else Verdict.A
        verdict = mine if outcome is Outcome.WIN else theirs
        return Relative(
            against=reference_run,
            verdict=verdict,
            position=position,
            outcome=outcome,
            decided_by=DecidedBy.VERIFIER,
        ), 0
    a, b = (challenger, reference) if position == "a" else (reference, challenger)
    verdict = await judge.compare(a, b, rubric, on_usage=on_usage)
    consistent: bool | None = None
    if order_check:
        swapped = await judge.compare(b, a, rubric, on_usage=on_usage)
        consistent = _outcome(swapped, "b" if position == "a" else "a") is _outcome(
            verdict, position
        )
    return Relative(
        against=reference_run,
        verdict=verdict,
        position=position,
        outcome=_outcome(verdict, position),
        decided_by=DecidedBy.JUDGE,
        order_consistent=consistent,
    ), 1 + int(order_check)
