"""Judge calibration against the verifier (§11 health metrics, §11.8).

A calibration set holds tasks each with a verified-pass episode and a
verified-fail episode. A pass beats a fail by definition, so a judge shown such
a pair should prefer the pass; how often it does is its **agreement** with the
verifier. Each pair is judged in both orderings (pass as A, then fail as A), so
position bias shows as **order inconsistency**: a pair whose two verdicts are
not mirror images (A then B, B then A, or draw twice).

Grading itself never shows a pass-versus-fail pair to a judge (§11.8); this is
the one place that does, on purpose, to measure the judge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from assay.grading.judges import Judge, JudgeFailed, JudgeUsage, UsageCallback
from assay.kernel.scores import Verdict
from assay.messages.episode import Episode
from assay.workflow.ir import RubricItem, WorkflowDef

Order = Literal["pass_first", "fail_first"]

_MIRROR = {Verdict.A: Verdict.B, Verdict.B: Verdict.A, Verdict.DRAW: Verdict.DRAW}


@dataclass(frozen=True)
class CalibrationPair:
    """One task with a verified-pass and a verified-fail episode.

    Attributes:
        task: names the task in the report.
        passed: an episode the verifiers passed.
        failed: an episode of the same task the verifiers failed.
        rubric: the rubric to judge by; None: `calibrate`'s.
    """

    task: str
    passed: Episode
    failed: Episode
    rubric: list[RubricItem] | None = None


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CalibrationFailure(_Frozen):
    """One ordering the judge failed to judge."""

    task: str = Field(description="The pair's task.")
    order: Order = Field(description="pass_first: the pass shown as A; fail_first: as B.")
    reason: str = Field(description="Why the judge failed, with an excerpt of its output.")


class PairCalibration(_Frozen):
    """How the judge did on one pair."""

    task: str = Field(description="The pair's task.")
    pass_first: Verdict | None = Field(
        description="Verdict with the pass shown as A (None: the judge failed)."
    )
    fail_first: Verdict | None = Field(
        description="Verdict with the fail shown as A (None: the judge failed)."
    )
    agreed: int = Field(ge=0, le=2, description="Orderings in which the judge preferred the pass.")
    consistent: bool | None = Field(
        description="The two verdicts mirror each other (None: an ordering failed)."
    )


class CalibrationReport(_Frozen):
    """Judge-versus-verifier agreement and order consistency on a calibration set."""

    pairs: int = Field(ge=0, description="Pairs in the set.")
    judge_calls: int = Field(ge=0, description="Comparisons asked of the judge (two a pair).")
    judged: int = Field(ge=0, description="Orderings that got a verdict (failures excluded).")
    agreement: float | None = Field(
        description=(
            "Share of judged orderings in which the judge preferred the verified pass; draws "
            "count as disagreement (None: nothing judged)."
        )
    )
    draws: int = Field(ge=0, description="Judged orderings that were draws.")
    order_inconsistency_rate: float | None = Field(
        description=(
            "Share of pairs judged in both orderings whose verdicts are not mirror images "
            "(None: no pair was)."
        )
    )
    failures: int = Field(ge=0, description="Orderings the judge failed (JudgeFailed).")
    failure_reasons: list[CalibrationFailure] = Field(description="Each failure, in order.")
    model_calls: int = Field(ge=0, description="Model calls the judge reported.")
    prompt_tokens: int = Field(ge=0, description="Prompt tokens of those calls.")
    completion_tokens: int = Field(ge=0, description="Completion tokens of those calls.")
    cost_usd: float = Field(ge=0, description="What those calls cost.")
    details: list[PairCalibration] = Field(description="Each pair, in set order.")


async def calibrate(
    judge: Judge,
    pairs: Sequence[CalibrationPair],
    rubric: Sequence[RubricItem] | None,
    *,
    on_usage: UsageCallback | None = None,
) -> CalibrationReport:
    """Judge every pair in both orderings; report agreement and order consistency.

    Pairs are judged one at a time, in order, pass first then fail first. A
    `JudgeFailed` is recorded with its reason and excluded from both rates;
    any other error propagates.

    Args:
        judge: the judge to calibrate.
        pairs: the calibration set.
        rubric: the rubric of pairs that carry none; None: the rubric of the
            workflow definition the passed episode pins.
        on_usage: also told of each model call the judge reports (to meter it).

    Raises:
        pydantic.ValidationError: a pair judged by its definition's rubric whose
            definition is not a valid workflow.
    """
    usage: list[JudgeUsage] = []

    def seen(call: JudgeUsage) -> None:
        usage.append(call)
        if on_usage is not None:
            on_usage(call)

    details: list[PairCalibration] = []
    failures: list[CalibrationFailure] = []
    for pair in pairs:
        items = _rubric_of(pair, rubric)
        verdicts: dict[Order, Verdict | None] = {}
        orderings: list[tuple[Order, Episode, Episode]] = [
            ("pass_first", pair.passed, pair.failed),
            ("fail_first", pair.failed, pair.passed),
        ]
        for order, a, b in orderings:
            try:
                verdicts[order] = await judge.compare(a, b, items, on_usage=seen)
            except JudgeFailed as exc:
                verdicts[order] = None
                failures.append(CalibrationFailure(task=pair.task, order=order, reason=str(exc)))
        first, second = verdicts["pass_first"], verdicts["fail_first"]
        details.append(
            PairCalibration(
                task=pair.task,
                pass_first=first,
                fail_first=second,
                agreed=(first is Verdict.A) + (second is Verdict.B),
                consistent=None if first is None or second is None else second is _MIRROR[first],
            )
        )
    judged = [v for d in details for v in (d.pass_first, d.fail_first) if v is not None]
    both = [d for d in details if d.consistent is not None]
    return CalibrationReport(
        pairs=len(pairs),
        judge_calls=2 * len(pairs),
        judged=len(judged),
        agreement=sum(d.agreed for d in details) / len(judged) if judged else None,
        draws=sum(v is Verdict.DRAW for v in judged),
        order_inconsistency_rate=(
            sum(not d.consistent for d in both) / len(both) if both else None
        ),
        failures=len(failures),
        failure_reasons=failures,
        model_calls=len(usage),
        prompt_tokens=sum(u.prompt_tokens for u in usage),
        completion_tokens=sum(u.completion_tokens for u in usage),
        cost_usd=sum(u.cost_usd for u in usage),
        details=details,
    )


def _rubric_of(pair: CalibrationPair, rubric: Sequence[RubricItem] | None) -> list[RubricItem]:
    if pair.rubric is not None:
        return list(pair.rubric)
    if rubric is not None:
        return list(rubric)
    return list(WorkflowDef.model_validate(pair.passed.definition).rubric)
