"""Scores are a sum type, never a bare number (§11.1).

A capped episode and an ungraded one are not low scores; they are different
kinds of answer. Nothing here converts one into a number.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from assay.kernel.ids import RunId


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Verdict(enum.Enum):
    """A judge's answer to "which of A and B is better". Never a number."""

    A = "a"
    B = "b"
    DRAW = "draw"


class Outcome(enum.Enum):
    """A comparison from the graded run's side."""

    WIN = "win"
    LOSS = "loss"
    DRAW = "draw"


class DecidedBy(enum.Enum):
    """Who ordered a pair: a judge, or the verifier (a pass beats a fail, §11.8)."""

    JUDGE = "judge"
    VERIFIER = "verifier"


class UngradedReason(enum.Enum):
    """Why grading ended without a score (§11.6)."""

    NO_REFERENCE = "no_reference"
    """No episode of the current version on this task to compare with."""
    BASELINE = "baseline"
    """The run is the current version's episode, the one challengers are measured against."""
    INSUFFICIENT_GROUP = "insufficient_group"
    BUDGET_EXHAUSTED = "budget_exhausted"
    EPISODE_UNAVAILABLE = "episode_unavailable"
    """The episode blob could not be read; grading degrades, the run stands."""
    JUDGE_FAILED = "judge_failed"
    """The judge's answer could not be parsed, or it could not be reached: a recorded
    failure, never a guessed verdict."""
    NO_METRIC = "no_metric"
    """Deterministic grading: the episode does not hold the declared number."""


class CoreViolation(_Frozen):
    """A `Core` rubric criterion the episode violates (§11.7)."""

    criterion: str = Field(description="Rubric criterion id.")
    evidence: str = Field(description="What in the episode shows the violation.")


class Relative(_Frozen):
    """One comparison against the current version's reference episode (§11.3)."""

    kind: Literal["relative"] = Field("relative", description="Score variant.")
    against: RunId = Field(description="The reference run compared with.")
    verdict: Verdict = Field(description="The verdict as given, positions as shown.")
    position: Literal["a", "b"] = Field(description="Where the graded run was shown.")
    outcome: Outcome = Field(description="The verdict from the graded run's side.")
    decided_by: DecidedBy = Field(description="Judge, or verifier for pass-vs-fail.")
    order_consistent: bool | None = Field(
        None,
        description=(
            "Sampled order check: the judge was asked again with the positions swapped and "
            "gave the mirror verdict (True) or not (False); None: not sampled."
        ),
    )


_RANKED_OMITTED_WHEN_UNSET = ("comparisons", "comparisons_failed")
"""Fields a `Ranked` leaves out of its payload when unset, so a score of before they
existed (or of the deterministic grader, which compares nothing) is written as it was."""


class Ranked(_Frozen):
    """A strength as a delta from control (§11.2, §11.4), with its interval and group size.

    From a tournament it is a Bradley-Terry-Davidson strength fitted to the judge's
    answered comparisons only; `comparisons` says how many of the entrant's own it rests
    on (at least one: an entrant the judge answered nothing about is
    `Ungraded{judge_failed}`, never a strength from the prior alone) and
    `comparisons_failed` how many were asked and left unanswered. From the deterministic
    grader it is the episode's number minus control's (a point interval, no
    comparisons). `anchored` is False when the fit had no control episode: the strength
    is then relative to the group's mean, is still worth reading, and is never
    aggregated (§11.2).
    """

    kind: Literal["ranked"] = Field("ranked", description="Score variant.")
    strength: float = Field(description="Strength minus control's.")
    interval: tuple[float, float] = Field(description="Interval on the strength.")
    group_size: int = Field(ge=1, description="Episodes in the group that produced it.")
    anchored: bool = Field(
        True, description="The group held control, so the delta is comparable across groups."
    )
    comparisons: int | None = Field(
        None,
        ge=1,
        description=(
            "Answered judge comparisons of this entrant the strength rests on, each ordering "
            "counted; None: not from a judged tournament (the deterministic grader), or "
            "recorded before the count was kept."
        ),
    )
    comparisons_failed: int | None = Field(
        None,
        ge=0,
        description=(
            "Comparisons of this entrant the judge was asked and did not answer (left out "
            "of the fit, so the interval is as wide as the answered ones leave it); None "
            "as for `comparisons`."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in _RANKED_OMITTED_WHEN_UNSET:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class Capped(_Frozen):
    """A `Core` violation caps the episode. No number, nothing to average."""

    kind: Literal["capped"] = Field("capped", description="Score variant.")
    violations: list[CoreViolation] = Field(min_length=1, description="The violations.")


class Ungraded(_Frozen):
    """No comparison was possible, with the reason."""

    kind: Literal["ungraded"] = Field("ungraded", description="Score variant.")
    reason: UngradedReason = Field(description="Why grading ended without a score.")


Score = Annotated[Relative | Ranked | Capped | Ungraded, Field(discriminator="kind")]


class WinRecord(_Frozen):
    """A challenger's running record against the current version (§11.3).

    Judge verdicts and verifier-decided pairs are kept apart; draws are
    recorded and excluded from the likelihood ratio.
    """

    judge_wins: int = Field(0, ge=0, description="Judge preferred the challenger.")
    judge_losses: int = Field(0, ge=0, description="Judge preferred the current version.")
    draws: int = Field(0, ge=0, description="Judge draws (excluded from the test).")
    verifier_wins: int = Field(0, ge=0, description="Challenger passed, reference failed.")
    verifier_losses: int = Field(0, ge=0, description="Challenger failed, reference passed.")
    capped: int = Field(0, ge=0, description="Challenger episodes capped by a Core violation.")

    @property
    def wins(self) -> int:
        """All wins, judge and verifier."""
        return self.judge_wins + self.verifier_wins

    @property
    def losses(self) -> int:
        """All losses, judge and verifier."""
        return self.judge_losses + self.verifier_losses

    @property
    def comparisons(self) -> int:
        """Every comparison recorded, draws included."""
        return self.wins + self.losses + self.draws

    def add(self, outcome: Outcome, decided_by: DecidedBy) -> WinRecord:
        """The record with one more comparison."""
        judge = decided_by is DecidedBy.JUDGE
        match outcome:
            case Outcome.WIN:
                field = "judge_wins" if judge else "verifier_wins"
            case Outcome.LOSS:
                field = "judge_losses" if judge else "verifier_losses"
            case Outcome.DRAW:
                field = "draws"
        return self.model_copy(update={field: getattr(self, field) + 1})


class StepCredit(_Frozen):
    """A failed attempt and the retry of the same step that passed (§11.5, §11.8).

    Never shown to a judge — the verifier already ordered the pair. It is credit:
    what differed between the two attempts is attributed to the step as the change
    that turned a fail into a pass. `changed` empty means nothing in the attempt's
    input differed (the pass was a retry of identical input).
    """

    step: str = Field(description="The step.")
    iteration: int = Field(ge=0, description="How many times the step had run before.")
    failed_attempt: int = Field(ge=1, description="The attempt that failed.")
    passed_attempt: int = Field(ge=1, description="The later attempt that succeeded.")
    failure: str = Field(description="Why the failed attempt failed.")
    changed: list[str] = Field(description="What differed between the attempts' inputs.")


class AttemptRank(_Frozen):
    """One attempt's strength among the same-outcome attempts of its step (§11.5).

    The step's earliest attempt in the group is the anchor (strength 0), so a
    positive strength says the judge preferred this attempt to the step's first try.
    """

    step: str = Field(description="The step.")
    iteration: int = Field(ge=0, description="How many times the step had run before.")
    attempt: int = Field(ge=1, description="The attempt.")
    succeeded: bool = Field(description="Its outcome class: succeeded, or failed.")
    rank: Ranked = Field(description="Its strength as a delta from the group's first attempt.")


class UnrankedAttempts(_Frozen):
    """Same-outcome attempts of a step left without a rank (§11.5), and why.

    The judge answered none of the comparisons of these attempts: a rank fitted from
    no comparison would be a guessed verdict, so none is given (§11.1).
    """

    step: str = Field(description="The step.")
    iteration: int = Field(ge=0, description="How many times the step had run before.")
    succeeded: bool = Field(description="Their outcome class: succeeded, or failed.")
    attempts: list[int] = Field(min_length=1, description="The attempts left unranked.")
    reason: UngradedReason = Field(description="Why they have no rank.")
