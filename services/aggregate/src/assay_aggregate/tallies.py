"""Aggregate's derived state, typed: a version's tallies and its latest failures.

`Tally` (kind `version`) is what every graded run of a version adds up to; a
challenger's runs also build its `WinRecord` and anchored `Ranked` sums against
its baseline, on selection tasks and apart on held-out ones (§12.5). `Failures`
(kind `failures`) are its latest selection-set failures, the proposer's evidence.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from assay.kernel import WorkflowId, WorkflowVersion
from assay.kernel.scores import (
    Capped,
    DecidedBy,
    Outcome,
    Ranked,
    Relative,
    Score,
    Ungraded,
    UngradedReason,
    WinRecord,
)
from assay.kernel.spend import micro_usd
from assay.messages import HeldOutTally, Purpose, Role, RunGraded, StrengthSummary
from assay.messages.proposals import FailureEvidence
from assay.record import ReadModel

SCREENED_CLEAN = frozenset(
    {
        UngradedReason.NO_REFERENCE,
        UngradedReason.BASELINE,
        UngradedReason.INSUFFICIENT_GROUP,
        UngradedReason.NO_METRIC,
    }
)
"""`Ungraded` reasons that come after the `Core` screen passed (or had nothing to screen);
a judge failure, a spent budget or a missing episode may not have been screened at all."""

Count = int | float
"""A count as stored: the selection sums pass through `VersionTallied.ranked` (floats),
held-out sums are kept as counted (ints); both read back as they were written."""


class RankedSums(BaseModel):
    """Running sums of a challenger's anchored `Ranked` deltas from control."""

    model_config = ConfigDict(frozen=True)
    n: Count = 0
    sum: float = 0.0
    sumsq: float = 0.0
    unanchored: Count = 0

    def add(self, delta: float, *, anchored: bool) -> RankedSums:
        """The sums with one more delta (an unanchored one is only counted)."""
        if not anchored:
            return self.model_copy(update={"unanchored": self.unanchored + 1})
        return RankedSums(
            n=self.n + 1,
            sum=self.sum + delta,
            sumsq=self.sumsq + delta * delta,
            unanchored=self.unanchored,
        )

    def summary(self) -> StrengthSummary:
        """The mean anchored delta with a 95% t interval (a point below two episodes)."""
        n = int(self.n)
        mean = self.sum / n if n else 0.0
        if n < 2:
            interval = (mean, mean)
        else:
            var = max(self.sumsq - n * mean * mean, 0.0) / (n - 1)
            # Imported here: scipy.special costs a stage ~30 MB resident, and only tournament
            # or deterministic grading (Ranked deltas) ever needs the t quantile.
            from scipy.special import stdtrit

            half = float(stdtrit(n - 1, 0.975)) * math.sqrt(var / n)
            interval = (mean - half, mean + half)
        return StrengthSummary(
            episodes=n, mean=mean, interval=interval, unanchored=int(self.unanchored)
        )


def counted(
    record: WinRecord | None, ranked: RankedSums | None, score: Score
) -> tuple[WinRecord, RankedSums | None]:
    """A challenger's record and sums after one more score (`Ungraded` compares nothing);
    an anchored delta also counts in the record by its sign."""
    record = record or WinRecord()
    match score:
        case Relative(outcome=outcome, decided_by=by):
            return record.add(outcome, by), ranked
        case Capped():
            return record.model_copy(update={"capped": record.capped + 1}), ranked
        case Ranked(strength=delta, anchored=anchored):
            if anchored:
                sign = Outcome.WIN if delta > 0 else Outcome.LOSS if delta < 0 else Outcome.DRAW
                record = record.add(sign, DecidedBy.JUDGE)
            return record, (ranked or RankedSums()).add(delta, anchored=anchored)
        case Ungraded():
            return record, ranked


class HeldOutTallies(BaseModel):
    """A version's tallies on held-out tasks: runs, passes, and a challenger's evidence."""

    model_config = ConfigDict(frozen=True)
    runs: int = 0
    passes: int = 0
    record: WinRecord | None = None
    ranked: RankedSums | None = None


_COUNTED_LATER = frozenset({"judge_calls", "judge_micro_usd"})
"""Tally fields a document kept before they were counted does not have."""


class Tally(ReadModel):
    """A version's tallies after its latest graded run. `runs` and `passes` count every
    task; the challenger measures count selection tasks, held-out ones are apart."""

    kind: ClassVar[str] = "version"
    workflow_id: WorkflowId
    runs: int
    passes: int
    baseline: WorkflowVersion | None
    record: WinRecord | None
    ranked: RankedSums | None
    screened: int
    served: int
    order_checked: int
    order_inconsistent: int
    held_out: HeldOutTallies | None
    judge_calls: int | None = None
    """What grading its runs cost: judge calls billed (answered or failed); absent when
    tallied before it was counted."""
    judge_micro_usd: int | None = None
    """And their price, in micro-dollars (`RunGraded.judge_cost_usd`)."""

    @model_serializer(mode="wrap")
    def _as_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        doc: dict[str, Any] = handler(self)
        return {k: v for k, v in doc.items() if v is not None or k not in _COUNTED_LATER}

    @classmethod
    def empty(cls, workflow: WorkflowId) -> Tally:
        """A version no graded run reached yet."""
        return cls(
            workflow_id=workflow,
            runs=0,
            passes=0,
            baseline=None,
            record=None,
            ranked=None,
            screened=0,
            served=0,
            order_checked=0,
            order_inconsistent=0,
            held_out=None,
        )

    def selection(self) -> tuple[int, int]:
        """(runs, passes) on selection tasks."""
        held = self.held_out or HeldOutTallies()
        return self.runs - held.runs, self.passes - held.passes

    def with_run(self, msg: RunGraded) -> tuple[Tally, bool]:
        """The tallies after `msg`, and whether it counted as a challenger's run (one
        against the baseline the version was first compared with)."""
        r, passed = msg.run, int(msg.passed)
        tally = self.model_copy(
            update={
                "runs": self.runs + 1,
                "passes": self.passes + passed,
                "judge_calls": (self.judge_calls or 0) + msg.judge_calls + msg.judge_failures,
                "judge_micro_usd": (self.judge_micro_usd or 0) + micro_usd(msg.judge_cost_usd),
            }
        )
        if r.held_out:
            held = self.held_out or HeldOutTallies()
            held = held.model_copy(update={"runs": held.runs + 1, "passes": held.passes + passed})
            tally = tally.model_copy(update={"held_out": held})
        baseline = r.baseline_version
        if (
            r.role is not Role.CHALLENGER
            or baseline is None
            or self.baseline not in (None, baseline)
        ):
            return tally, False
        tally = tally.model_copy(update={"baseline": baseline})
        if r.held_out:
            held = tally.held_out or HeldOutTallies()
            record, ranked = counted(held.record, held.ranked, msg.score)
            held = held.model_copy(update={"record": record, "ranked": ranked})
            return tally.model_copy(update={"held_out": held}), True
        return tally._counted_on_selection(msg), True

    def _counted_on_selection(self, msg: RunGraded) -> Tally:
        record, ranked = counted(self.record, self.ranked, msg.score)
        update: dict[str, object] = {"record": record, "ranked": ranked}
        if _screened(msg.score):
            update["screened"] = self.screened + 1
            update["served"] = self.served + int(msg.run.purpose is Purpose.WORK)
        checked, inconsistent = _order_checks(msg)
        if checked:
            update["order_checked"] = self.order_checked + checked
            update["order_inconsistent"] = self.order_inconsistent + inconsistent
        return self.model_copy(update=update)

    def held_out_beside(self, base: Tally | None) -> HeldOutTally | None:
        """The challenger's held-out measures beside its baseline's, once it has any."""
        mine = self.held_out
        if mine is None:
            return None
        theirs = (base.held_out if base else None) or HeldOutTallies()
        return HeldOutTally(
            runs=mine.runs,
            passes=mine.passes,
            record=mine.record or WinRecord(),
            strength=mine.ranked.summary() if mine.ranked else None,
            baseline_runs=theirs.runs,
            baseline_passes=theirs.passes,
        )


def _order_checks(msg: RunGraded) -> tuple[int, int]:
    """The judge's order checks a grade carries, and how many it failed: a pairwise
    score's sampled one (`Relative.order_consistent`), and the tournament bouts the run
    was in (`RunGraded.order_checked`, 0 for any other grading, so nothing counts twice)."""
    checked, inconsistent = msg.order_checked, msg.order_inconsistent
    if isinstance(msg.score, Relative) and msg.score.order_consistent is not None:
        checked += 1
        inconsistent += int(not msg.score.order_consistent)
    return checked, inconsistent


def _screened(score: Score) -> bool:
    """The episode passed the Core screen (or had nothing to screen) and was graded."""
    if isinstance(score, Ungraded):
        return score.reason in SCREENED_CLEAN
    return not isinstance(score, Capped)


class Failures(ReadModel):
    """A version's latest selection-set failures, oldest first."""

    kind: ClassVar[str] = "failures"
    failures: list[FailureEvidence]


AGGREGATE_STATE: tuple[type[ReadModel], ...] = (Tally, Failures)
"""Every kind of document aggregate keeps, by its read model."""
