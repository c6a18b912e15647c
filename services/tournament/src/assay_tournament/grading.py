"""What every grading path shares: ending a run's grading, and metering the judge.

`Meter` is one handler's view of the tenant's grading meter: judge calls today
(UTC, by when the graded fact occurred) against the tenant's ceiling, calls by
purpose, and the judge's health (order checks, failures). The calls it saw are
emitted as `UsageRecorded` (purpose `grading`) attributed to the run they
served, and the meter is recorded, in the same commit as the scores. A shadow
run's own spend (its execution's model calls and tokens) is recorded once, as
`ReplaySpent`, when its grading ends (§12.4).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from assay.bus.topics import GRADED, RESULTS, RUN_STATUS, USAGE
from assay.grading.attempts import AttemptGrades, grade_attempts
from assay.grading.judges import JudgeUsage, UsageCallback
from assay.grading.strategies import GradingPolicy
from assay.kernel import RunId, RunState
from assay.kernel.scores import AttemptRank, Score, StepCredit, Ungraded
from assay.messages import (
    Episode,
    Purpose,
    RunGraded,
    RunResult,
    RunStatusChanged,
    RunVerified,
    UsageRecorded,
    VerifierResult,
)
from assay.record import BranchKey
from assay.runtime import StageDeps, UnitOfWork
from assay.workflow import GradingSpec, RubricItem
from assay_tournament.events import METER_STREAM, GradingMetered, ReplaySpent, RunScored

ATTEMPTS_KEY = "attempt_grades"
"""Where a waiting run's attempt grades are kept beside its RunVerified payload."""


async def load_episode(uow: UnitOfWork, ref: str) -> Episode | None:
    """The episode blob of the tenant, or None when it is gone or unreadable."""
    raw = await uow.blobs.get(uow.tenant, ref)
    if raw is None:
        return None
    try:
        return Episode.model_validate_json(raw)
    except ValidationError:
        return None


def failed_checks(msg: RunVerified) -> list[VerifierResult]:
    """The verifiers the run failed: the evidence the slow loop's proposer may read."""
    return [v for v in msg.results if not v.passed]


@dataclass
class Meter:
    """The tenant's grading meter as one handler changes it."""

    policy: GradingPolicy
    day: str
    doc: dict[str, Any]
    """This partition's document."""
    shard: str = ""
    """Which partition's document (`@<n>`; empty for the one document of before)."""
    others_today: int = 0
    """Today's judge calls of the tenant in the other partitions' documents."""
    pending: list[tuple[RunId, JudgeUsage]] = field(default_factory=list)
    billed: Counter[RunId] = field(default_factory=Counter)
    """Every call this handler saw, by run (emitted or not)."""
    dirty: bool = False

    @classmethod
    def of(
        cls,
        policy: GradingPolicy,
        day: str,
        doc: dict[str, Any] | None,
        *,
        shard: str = "",
        others_today: int = 0,
    ) -> Meter:
        """The meter for `day`; a new day starts today's count at zero."""
        base: dict[str, Any] = {
            "day": day,
            "calls_today": 0,
            "calls_total": 0,
            "by_purpose": {},
            "order_checked": 0,
            "order_inconsistent": 0,
            "judge_failures": 0,
            "last_failure": None,
            "scores": {},
        }
        current = {**base, **(doc or {})}
        if current["day"] != day:
            current.update(day=day, calls_today=0)
        return cls(policy, day, current, shard=shard, others_today=others_today)

    def exhausted(self, tenant: object) -> bool:
        """The tenant's judge calls today, in every partition, reached its ceiling."""
        today = self.others_today + int(self.doc["calls_today"])
        return today >= self.policy.ceiling_for(str(tenant))

    def sink(self, run: RunId, purpose: str) -> UsageCallback:
        """Where the judge reports each call it makes for `run`, for `purpose`."""

        def record(usage: JudgeUsage) -> None:
            self.pending.append((run, usage))
            self.billed[run] += 1
            by = Counter(self.doc["by_purpose"])
            by[purpose] += 1
            self.doc.update(
                calls_today=int(self.doc["calls_today"]) + 1,
                calls_total=int(self.doc["calls_total"]) + 1,
                by_purpose=dict(by),
            )
            self.dirty = True

        return record

    def order_checked(self, *, consistent: bool) -> None:
        """One sampled order check, and whether the judge mirrored itself."""
        self.doc["order_checked"] = int(self.doc["order_checked"]) + 1
        self.doc["order_inconsistent"] = int(self.doc["order_inconsistent"]) + int(not consistent)
        self.dirty = True

    def scored(self, score: Score) -> None:
        """One grading ended: counted by score kind, and `Ungraded` by reason (§11.6: a
        tenant whose loop never engages must see why)."""
        key = f"ungraded:{score.reason.value}" if isinstance(score, Ungraded) else score.kind
        scores = Counter(self.doc["scores"])
        scores[key] += 1
        self.doc["scores"] = dict(scores)
        self.dirty = True

    def failed(self, reason: str) -> None:
        """One judge failure (an unusable answer, an unreachable judge)."""
        self.doc["judge_failures"] = int(self.doc["judge_failures"]) + 1
        self.doc["last_failure"] = reason[:500]
        self.dirty = True

    def calls_for(self, run: RunId) -> int:
        """Judge calls pending for `run`."""
        return sum(1 for r, _ in self.pending if r == run)


class Grading:
    """Ending a run's grading: its score, status, result, usage and the meter."""

    def __init__(self, deps: StageDeps) -> None:
        self.deps = deps

    async def meter(self, uow: UnitOfWork) -> Meter:
        """The tenant's meter in this message's partition, for the day the handled fact
        occurred, beside today's calls in the other partitions."""
        day = uow.envelope.occurred_at.date().isoformat()
        shard = f"@{uow.partition}"
        mine: dict[str, Any] | None = None
        others = 0
        for key, doc in await uow.scan("meter", "grading"):
            if key == f"grading{shard}":
                mine = doc
            elif doc.get("day") == day:
                others += int(doc.get("calls_today", 0))
        return Meter.of(self.deps.grading, day, mine, shard=shard, others_today=others)

    async def rank_attempts(
        self, episode: Episode, spec: GradingSpec, rubric: list[RubricItem], meter: Meter
    ) -> AttemptGrades | None:
        """Attempt tournaments on the episode's retries, when on and affordable."""
        if not spec.attempts_ranked or meter.exhausted(episode.run.tenant):
            return None
        grades = await grade_attempts(
            episode,
            self.deps.judge,
            rubric,
            prior_precision=spec.precision,
            on_usage=meter.sink(episode.run.run_id, "attempts"),
        )
        for failure in grades.failures:
            meter.failed(failure)
        return grades

    @staticmethod
    def attempts_doc(grades: AttemptGrades | None) -> dict[str, Any]:
        """A run's attempt grades as kept while it waits."""
        if grades is None:
            return {}
        return {
            ATTEMPTS_KEY: {
                "ranks": [r.model_dump(mode="json") for r in grades.ranks],
                "credit": [c.model_dump(mode="json") for c in grades.credit],
                "judge_calls": grades.judge_calls,
            }
        }

    @staticmethod
    def attempts_from(doc: dict[str, Any]) -> AttemptGrades | None:
        """The attempt grades kept beside a waiting run's payload."""
        kept = doc.get(ATTEMPTS_KEY)
        if kept is None:
            return None
        return AttemptGrades(
            ranks=tuple(AttemptRank.model_validate(r) for r in kept["ranks"]),
            credit=tuple(StepCredit.model_validate(c) for c in kept["credit"]),
            judge_calls=int(kept["judge_calls"]),
            failures=(),
        )

    @staticmethod
    def verified_of(doc: dict[str, Any]) -> RunVerified:
        """The RunVerified payload of a waiting run's document."""
        return RunVerified.model_validate({k: v for k, v in doc.items() if k != ATTEMPTS_KEY})

    def waiting(self, uow: UnitOfWork, msg: RunVerified, why: str) -> None:
        """The run rests in `Grading` until its comparison can happen."""
        uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.GRADING, detail=why))

    def flush(self, uow: UnitOfWork, meter: Meter) -> None:
        """Emit the calls the meter saw and record the meter, once per change."""
        for run, usage in meter.pending:
            uow.emit(
                USAGE,
                UsageRecorded(
                    tenant=uow.tenant,
                    run_id=run,
                    purpose=Purpose.GRADING,
                    model=usage.model,
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    cost_usd=usage.cost_usd,
                ),
            )
        meter.pending.clear()
        if meter.dirty:
            uow.record(
                BranchKey.main(uow.tenant, f"{METER_STREAM}{meter.shard}"),
                GradingMetered(meter=dict(meter.doc)),
            )
            meter.dirty = False

    @staticmethod
    def graded(
        uow: UnitOfWork,
        msg: RunVerified,
        score: Score,
        calls: int,
        ranks: list[AttemptRank] | None = None,
        credit: list[StepCredit] | None = None,
    ) -> bool:
        """Emit the run's `RunGraded` and its `Graded`/`Ungraded` status; whether it was
        graded (any score but `Ungraded`)."""
        uow.emit(
            GRADED,
            RunGraded(
                run=msg.run,
                passed=msg.passed,
                score=score,
                judge_calls=calls,
                attempt_ranks=ranks or [],
                step_credit=credit or [],
                failed_checks=failed_checks(msg),
            ),
        )
        graded = not isinstance(score, Ungraded)
        uow.emit(
            RUN_STATUS,
            RunStatusChanged(
                run=msg.run,
                state=RunState.GRADED if graded else RunState.UNGRADED,
                detail=score.reason.value if isinstance(score, Ungraded) else score.kind,
            ),
        )
        return graded

    def finish_sibling(
        self, uow: UnitOfWork, msg: RunVerified, score: Score, *, meter: Meter
    ) -> None:
        """End a rollout sibling's grading with its score within the group: its group's
        `RolloutResult` is the task's one result, so the sibling gets none of its own."""
        r = msg.run
        calls = meter.billed[r.run_id]
        meter.scored(score)
        self.flush(uow, meter)
        uow.record(
            BranchKey.main(uow.tenant, f"task:{r.task_id}"),
            RunScored(
                run_id=r.run_id,
                task_id=r.task_id,
                workflow_version=r.workflow_version,
                score=score,
                judge_calls=calls,
            ),
        )
        self.graded(uow, msg, score, calls)

    def finish(
        self,
        uow: UnitOfWork,
        msg: RunVerified,
        episode: Episode | None,
        score: Score,
        *,
        meter: Meter,
        judge_calls: int | None = None,
        order_index: int | None = None,
        was_parked: bool = False,
        attempts: AttemptGrades | None = None,
    ) -> None:
        """End the run's grading with `score`: record it, emit graded, status and result.

        `judge_calls` defaults to the calls the meter saw for the run in this handler;
        the attempt tournaments' calls (metered when they ran) are added to it.
        """
        r = msg.run
        if judge_calls is None:
            judge_calls = meter.calls_for(r.run_id)
        calls = judge_calls + (attempts.judge_calls if attempts is not None else 0)
        meter.scored(score)
        self.flush(uow, meter)
        if r.purpose is Purpose.SHADOW:
            uow.record(
                BranchKey.main(uow.tenant, f"task:{r.task_id}"),
                ReplaySpent(
                    run_id=r.run_id,
                    day=meter.day,
                    model_calls=msg.usage.model_calls,
                    tokens=msg.usage.prompt_tokens + msg.usage.completion_tokens,
                ),
            )
        uow.record(
            BranchKey.main(uow.tenant, f"task:{r.task_id}"),
            RunScored(
                run_id=r.run_id,
                task_id=r.task_id,
                workflow_version=r.workflow_version,
                score=score,
                judge_calls=calls,
                order_index=order_index,
                was_parked=was_parked,
            ),
        )
        ranks = list(attempts.ranks) if attempts else []
        credit = list(attempts.credit) if attempts else []
        graded = self.graded(uow, msg, score, calls, ranks, credit)
        if r.purpose is Purpose.WORK:
            uow.emit(
                RESULTS,
                RunResult(
                    tenant=r.tenant,
                    run_id=r.run_id,
                    task_id=r.task_id,
                    idempotency_key=r.idempotency_key,
                    workflow_id=r.workflow_id,
                    workflow_version=r.workflow_version,
                    status="graded" if graded else "ungraded",
                    passed=msg.passed,
                    verification=msg.results,
                    score=score,
                    usage=msg.usage,
                    termination="succeeded" if msg.executed else "failed",
                    output=episode.output if episode else None,
                    step_credit=credit,
                    held_out=r.held_out,
                ),
            )
