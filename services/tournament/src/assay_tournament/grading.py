"""What every grading path shares: ending a run's grading, and metering the judge.

`Meter` is one handler's view of the tenant's grading meter: judge calls the
endpoint billed today (UTC, by when the graded fact occurred) against the
tenant's ceiling, calls that answered and calls that failed by purpose, and the
judge's health (order checks, failures). It is the one source of truth for judge
spend: every call it saw is emitted as `UsageRecorded` (purpose `grading`, its
`JudgePurpose`, `failed` when the endpoint billed an unusable answer) attributed
to the run it served, the same calls are added to that run's `JudgeSpend` —
which its `RunGraded` reports — and the meter is recorded, in the same commit as
the scores. A run waiting for its group or its reference keeps what it spent so
far beside its payload. A shadow run's own spend (its execution's model calls
and tokens) is recorded once, as `ReplaySpent`, when its grading ends (§12.4).
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
from assay.kernel.scores import AttemptRank, Score, StepCredit, Ungraded, UnrankedAttempts
from assay.messages import (
    Episode,
    JudgePurpose,
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
SPENT_KEY = "judge_spent"
"""Where a waiting run's judge calls so far are kept beside its RunVerified payload."""


async def load_episode(uow: UnitOfWork[Any], ref: str) -> Episode | None:
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
class JudgeSpend:
    """The judge calls one run took, by purpose: those that answered and those that failed."""

    answered: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)

    def __add__(self, other: JudgeSpend) -> JudgeSpend:
        return JudgeSpend(self.answered + other.answered, self.failed + other.failed)

    def doc(self) -> dict[str, Any]:
        """As kept beside a waiting run's payload."""
        return {"answered": dict(self.answered), "failed": dict(self.failed)}

    @classmethod
    def of(cls, doc: dict[str, Any]) -> JudgeSpend:
        """What a waiting run spent so far, from its document (none: nothing)."""
        kept = doc.get(SPENT_KEY)
        if kept is not None:
            return cls(Counter(kept["answered"]), Counter(kept["failed"]))
        legacy = doc.get(ATTEMPTS_KEY)  # kept before spend was: its attempt calls alone
        if legacy is not None and int(legacy.get("judge_calls", 0)):
            return cls(Counter({JudgePurpose.ATTEMPTS.value: int(legacy["judge_calls"])}))
        return cls()


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
    pending: list[tuple[RunId, JudgePurpose, JudgeUsage]] = field(default_factory=list)
    """Calls the endpoint billed, to emit as `UsageRecorded` at the next flush."""
    spent: dict[RunId, JudgeSpend] = field(default_factory=dict)
    """What each run's grading spent in this handler and has not yet reported."""
    emitted: Counter[str] = field(default_factory=Counter)
    """Usage messages emitted in this handler, by content: two calls that cost the same
    are two messages, told apart by their occurrence."""
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

    def _count(self, key: str, purpose: JudgePurpose) -> None:
        by = Counter(self.doc.get(key, {}))
        by[purpose.value] += 1
        self.doc[key] = dict(by)

    def _bump(self, key: str) -> None:
        self.doc[key] = int(self.doc.get(key, 0)) + 1

    def sink(self, run: RunId, purpose: JudgePurpose) -> UsageCallback:
        """Where the judge reports each call the endpoint billed for `run`, for `purpose`:
        an answered call counts as one; a failed one is only spend (its failure is
        counted by `failed`)."""

        def record(usage: JudgeUsage) -> None:
            self.pending.append((run, purpose, usage))
            self._bump("calls_today")  # the ceiling bounds what was billed
            if usage.failed:
                self._bump("failures_billed")
            else:
                self.spent.setdefault(run, JudgeSpend()).answered[purpose.value] += 1
                self._bump("calls_total")
                self._count("by_purpose", purpose)
            self.dirty = True

        return record

    def failed(self, run: RunId, purpose: JudgePurpose, reason: str) -> None:
        """One judge call for `run` that gave no usable answer (unusable, unreachable)."""
        self.spent.setdefault(run, JudgeSpend()).failed[purpose.value] += 1
        self._bump("judge_failures")
        self._count("failures_by_purpose", purpose)
        self.doc["last_failure"] = reason[:500]
        self.dirty = True

    def take(self, run: RunId) -> JudgeSpend:
        """What `run`'s grading spent in this handler since it was last taken."""
        return self.spent.pop(run, JudgeSpend())

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


@dataclass(frozen=True)
class Waiting:
    """A verified run waiting for its group or its reference, and what it carries."""

    verified: RunVerified
    attempts: AttemptGrades | None
    spent: JudgeSpend


class Grading:
    """Ending a run's grading: its score, status, result, usage and the meter."""

    def __init__(self, deps: StageDeps) -> None:
        self.deps = deps

    async def meter(self, uow: UnitOfWork[Any]) -> Meter:
        """The tenant's meter in this message's partition, for the day the handled fact
        occurred, beside today's calls in the other partitions."""
        day = uow.envelope.occurred_at.date().isoformat()
        shard = f"@{uow.partition}"
        mine: dict[str, Any] | None = None
        others = 0
        for key, doc in await uow.scan_documents("meter", "grading"):
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
        run = episode.run.run_id
        grades = await grade_attempts(
            episode,
            self.deps.judge,
            rubric,
            prior_precision=spec.precision,
            on_usage=meter.sink(run, JudgePurpose.ATTEMPTS),
        )
        for failure in grades.failures:
            meter.failed(run, JudgePurpose.ATTEMPTS, failure)
        return grades

    @staticmethod
    def waiting_doc(
        msg: RunVerified, grades: AttemptGrades | None, spent: JudgeSpend
    ) -> dict[str, Any]:
        """A waiting run's document: its RunVerified payload, its attempt grades and what
        its grading spent so far."""
        doc: dict[str, Any] = {**msg.model_dump(mode="json"), SPENT_KEY: spent.doc()}
        if grades is not None:
            doc[ATTEMPTS_KEY] = {
                "ranks": [r.model_dump(mode="json") for r in grades.ranks],
                "credit": [c.model_dump(mode="json") for c in grades.credit],
                "unranked": [u.model_dump(mode="json") for u in grades.unranked],
                "asked": grades.asked,
                "answered": grades.answered,
            }
        return doc

    @staticmethod
    def waiting_from(doc: dict[str, Any]) -> Waiting:
        """The waiting run a document keeps."""
        verified = RunVerified.model_validate(
            {k: v for k, v in doc.items() if k not in (ATTEMPTS_KEY, SPENT_KEY)}
        )
        kept = doc.get(ATTEMPTS_KEY)
        grades = None
        if kept is not None:
            grades = AttemptGrades(
                ranks=tuple(AttemptRank.model_validate(r) for r in kept["ranks"]),
                credit=tuple(StepCredit.model_validate(c) for c in kept["credit"]),
                asked=int(kept.get("asked", kept.get("judge_calls", 0))),
                answered=int(kept.get("answered", kept.get("judge_calls", 0))),
                failures=(),
                unranked=tuple(
                    UnrankedAttempts.model_validate(u) for u in kept.get("unranked", [])
                ),
            )
        return Waiting(verified, grades, JudgeSpend.of(doc))

    def waiting(self, uow: UnitOfWork[Any], msg: RunVerified, why: str) -> None:
        """The run rests in `Grading` until its comparison can happen."""
        uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.GRADING, detail=why))

    def flush(self, uow: UnitOfWork[Any], meter: Meter) -> None:
        """Emit the calls the meter saw and record the meter, once per change."""
        for run, purpose, usage in meter.pending:
            recorded = UsageRecorded(
                tenant=uow.tenant,
                run_id=run,
                purpose=Purpose.GRADING,
                model=usage.model,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cost_usd=usage.cost_usd,
                judge_purpose=purpose,
                failed=usage.failed,
            )
            content = recorded.model_dump_json()
            uow.emit(USAGE, recorded, occurrence=meter.emitted[content])
            meter.emitted[content] += 1
        meter.pending.clear()
        if meter.dirty:
            uow.record(
                BranchKey.main(uow.tenant, f"{METER_STREAM}{meter.shard}"),
                GradingMetered(meter=dict(meter.doc)),
            )
            meter.dirty = False

    @staticmethod
    def graded(
        uow: UnitOfWork[Any],
        msg: RunVerified,
        score: Score,
        spent: JudgeSpend,
        attempts: AttemptGrades | None = None,
    ) -> bool:
        """Emit the run's `RunGraded` and its `Graded`/`Ungraded` status; whether it was
        graded (any score but `Ungraded`)."""
        uow.emit(
            GRADED,
            RunGraded(
                run=msg.run,
                passed=msg.passed,
                score=score,
                judge_calls=spent.answered.total(),
                judge_failures=spent.failed.total(),
                judge_calls_by_purpose={JudgePurpose(k): n for k, n in spent.answered.items()},
                judge_failures_by_purpose={JudgePurpose(k): n for k, n in spent.failed.items()},
                attempt_ranks=list(attempts.ranks) if attempts else [],
                step_credit=list(attempts.credit) if attempts else [],
                unranked_attempts=list(attempts.unranked) if attempts else [],
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
        self, uow: UnitOfWork[Any], msg: RunVerified, score: Score, *, meter: Meter
    ) -> None:
        """End a rollout sibling's grading with its score within the group: its group's
        `RolloutResult` is the task's one result, so the sibling gets none of its own."""
        r = msg.run
        spent = meter.take(r.run_id)
        meter.scored(score)
        self.flush(uow, meter)
        uow.record(
            BranchKey.main(uow.tenant, f"task:{r.task_id}"),
            RunScored(
                run_id=r.run_id,
                task_id=r.task_id,
                workflow_version=r.workflow_version,
                score=score,
                judge_calls=spent.answered.total(),
            ),
        )
        self.graded(uow, msg, score, spent)

    def finish(
        self,
        uow: UnitOfWork[Any],
        msg: RunVerified,
        episode: Episode | None,
        score: Score,
        *,
        meter: Meter,
        order_index: int | None = None,
        was_parked: bool = False,
        attempts: AttemptGrades | None = None,
        carried: JudgeSpend | None = None,
    ) -> None:
        """End the run's grading with `score`: record it, emit graded, status and result.

        The run's judge calls are what it `carried` from earlier handlers (while it
        waited) and what the meter saw for it in this one.
        """
        r = msg.run
        spent = (carried or JudgeSpend()) + meter.take(r.run_id)
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
                judge_calls=spent.answered.total(),
                order_index=order_index,
                was_parked=was_parked,
            ),
        )
        credit = list(attempts.credit) if attempts else []
        graded = self.graded(uow, msg, score, spent, attempts)
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
