"""What every grading path shares: ending a run's grading, and metering the judge.

`Scoring` is one handler's grading: its unit of work and the tenant's meter;
`finish` ends a `Candidate`'s grading with a score. `Meter` is one handler's
view of the tenant's grading meter: judge calls the endpoint billed today (UTC,
by when the graded fact occurred) against the tenant's ceiling, calls that
answered and calls that failed by purpose, and the
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from assay.bus.topics import GRADED, RESULTS, RUN_STATUS, USAGE
from assay.grading.attempts import AttemptGrades, grade_attempts
from assay.grading.calibration import CalibrationPair
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.judges import Judge, JudgeUsage, UsageCallback
from assay.grading.strategies import GradingPolicy, GradingStrategy, builtin_strategies
from assay.kernel import RunId, RunState
from assay.kernel.scores import Score, Ungraded
from assay.kernel.spend import MICRO, micro_usd
from assay.messages import (
    Episode,
    EpisodeReduced,
    JudgePurpose,
    Purpose,
    ReducedEpisode,
    RunGraded,
    RunRef,
    RunResult,
    RunStatusChanged,
    RunVerified,
    UsageRecorded,
    VerifierResult,
)
from assay.record import BranchKey
from assay.runtime import UnitOfWork
from assay.store.inline_blobs import claimed_blob
from assay.workflow import GradingSpec, RubricItem
from assay_tournament.events import (
    METER_STREAM,
    EpisodeSummarised,
    GradingMetered,
    ReplaySpent,
    ResultIssued,
    RunScored,
)
from assay_tournament.purse import Purse, PursedJudge, attempt_calls, worst_call
from assay_tournament.state import (
    GradingMeter,
    KeptAttempts,
    KeptSpend,
    LiveResult,
    Parked,
    Reference,
    Summary,
)


@dataclass(frozen=True)
class Judging:
    """What the tournament stage's handlers use: the judge, the grading policy (its
    capacity, per-tenant ceilings and order-check sampling), scheduled calibration's
    policy and the calibration file's pairs (None: pairs from the tenants' runs)."""

    judge: Judge
    policy: GradingPolicy
    calibration: CalibrationPolicy = field(default_factory=CalibrationPolicy)
    calibration_set: tuple[CalibrationPair, ...] | None = None
    strategies: Mapping[str, GradingStrategy] = field(default_factory=builtin_strategies)
    """The registered grading strategies an episode's workflow may name."""


TournamentUnitOfWork = UnitOfWork[Judging]


async def load_episode(
    uow: TournamentUnitOfWork, ref: str, inline: dict[str, Any] | None = None
) -> Episode | None:
    """The episode blob of the tenant — its `inline` copy when its message carried one,
    or, once execute reduced it, its summary's episode (every transition, long texts
    elided) — or None when it is gone or unreadable.

    Raises:
        InlineCopyMismatch: `inline` is not the blob `ref` names.
    """
    raw = await claimed_blob(uow.blobs, uow.tenant, ref, inline)
    if raw is None:
        if (stand_in := await uow.get(Summary, ref)) is None:
            return None
        raw = await uow.blobs.get(uow.tenant, stand_in.summary)
        return None if raw is None else _decoded(raw, ReducedEpisode)
    return _decoded(raw, Episode)


def _decoded(raw: bytes, as_: type[Episode] | type[ReducedEpisode]) -> Episode | None:
    try:
        found = as_.model_validate_json(raw)
    except ValidationError:
        return None
    return found.episode if isinstance(found, ReducedEpisode) else found


async def on_episode_reduced(msg: EpisodeReduced, uow: TournamentUnitOfWork) -> None:
    """Execute deleted a run's episode for its summary. If the run is a reference on its
    task, note which blob stands for it (on the task's stream, so it is compacted with
    the reference), so a later comparison with the run reads the summary; any other
    run's episode is never read again here, and nothing is kept for it."""
    references = await uow.scan(Reference, f"{msg.task_id}/")
    if any(ref.episode == msg.original for _, ref in references):
        noted = EpisodeSummarised(original=msg.original, summary=msg.summary)
        uow.record(BranchKey.main(uow.tenant, f"task:{msg.task_id}"), noted)


def failed_checks(msg: RunVerified) -> list[VerifierResult]:
    """The verifiers the run failed: the evidence the slow loop's proposer may read."""
    return [v for v in msg.results if not v.passed]


@dataclass
class JudgeSpend:
    """The judge calls one run took, by purpose: those that answered and those that failed."""

    answered: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    micro_usd: int = 0
    """What every call billed for the run cost (answered or not), in micro-dollars."""

    def __add__(self, other: JudgeSpend) -> JudgeSpend:
        return JudgeSpend(
            self.answered + other.answered,
            self.failed + other.failed,
            self.micro_usd + other.micro_usd,
        )

    def kept(self) -> KeptSpend:
        """As kept beside a waiting run's payload."""
        return KeptSpend(
            answered=dict(self.answered),
            failed=dict(self.failed),
            micro_usd=self.micro_usd or None,
        )


@dataclass(frozen=True)
class OrderChecks:
    """A run's order checks from the tournament bouts it was in: bouts whose two orders
    both answered, and of those, the ones whose second verdict did not mirror the first."""

    checked: int = 0
    inconsistent: int = 0

    def add(self, *, consistent: bool) -> OrderChecks:
        """The checks with one more."""
        return OrderChecks(self.checked + 1, self.inconsistent + int(not consistent))


@dataclass(frozen=True)
class Candidate:
    """A run whose grading is under way, and what it carries into its score: its episode
    (None: unavailable), its attempt grades, the judge calls it spent in earlier
    handlers, and whether it had been parked waiting for its reference."""

    verified: RunVerified
    episode: Episode | None = None
    attempts: AttemptGrades | None = None
    carried: JudgeSpend = field(default_factory=JudgeSpend)
    was_parked: bool = False

    @property
    def run(self) -> RunRef:
        """The run."""
        return self.verified.run

    @classmethod
    def waiting(cls, kept: Parked, episode: Episode | None = None, *, parked: bool) -> Candidate:
        """A run kept waiting (for its reference, or in its group)."""
        return cls(
            kept.verified(),
            episode,
            kept.attempt_grades.grades() if kept.attempt_grades else None,
            JudgeSpend(kept.spent(), kept.failed(), kept.micro_usd()),
            was_parked=parked,
        )

    def kept(self, spent: JudgeSpend) -> dict[str, Any]:
        """The payload of the run waiting: its `RunVerified`, its attempt grades and what its
        grading spent so far."""
        return Parked.model_validate(
            {
                **self.verified.model_dump(),
                "judge_spent": spent.kept(),
                "attempt_grades": KeptAttempts.of(self.attempts) if self.attempts else None,
            }
        ).model_dump(mode="json")


@dataclass
class Meter:
    """The tenant's grading meter as one handler changes it."""

    policy: GradingPolicy
    day: str
    state: GradingMeter
    """This partition's meter."""
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
        kept: GradingMeter | None,
        *,
        shard: str = "",
        others_today: int = 0,
    ) -> Meter:
        """The meter for `day`; a new day starts today's count at zero."""
        state = kept.model_copy() if kept else GradingMeter(day=day)
        if state.day != day:
            state.day, state.calls_today = day, 0
        return cls(policy, day, state, shard=shard, others_today=others_today)

    def exhausted(self, tenant: object) -> bool:
        """The tenant's judge calls today, in every partition, reached its ceiling."""
        today = self.others_today + self.state.calls_today
        return today >= self.policy.ceiling_for(str(tenant))

    def sink(self, run: RunId, purpose: JudgePurpose) -> UsageCallback:
        """Where the judge reports each call the endpoint billed for `run`, for `purpose`:
        an answered call counts as one; a failed one is only spend (its failure is
        counted by `failed`)."""

        def record(usage: JudgeUsage) -> None:
            m = self.state
            self.pending.append((run, purpose, usage))
            m.calls_today += 1  # the ceiling bounds what was billed
            self.spent.setdefault(run, JudgeSpend()).micro_usd += micro_usd(usage.cost_usd)
            if usage.failed:
                m.failures_billed = (m.failures_billed or 0) + 1
            else:
                self.spent.setdefault(run, JudgeSpend()).answered[purpose.value] += 1
                m.calls_total += 1
                m.by_purpose = _plus_one(m.by_purpose, purpose.value)
            self.dirty = True

        return record

    def failed(self, run: RunId, purpose: JudgePurpose, reason: str) -> None:
        """One judge call for `run` that gave no usable answer (unusable, unreachable)."""
        m = self.state
        self.spent.setdefault(run, JudgeSpend()).failed[purpose.value] += 1
        m.judge_failures += 1
        m.failures_by_purpose = _plus_one(m.failures_by_purpose or {}, purpose.value)
        m.last_failure = reason[:500]
        self.dirty = True

    def take(self, run: RunId) -> JudgeSpend:
        """What `run`'s grading spent in this handler since it was last taken."""
        return self.spent.pop(run, JudgeSpend())

    def order_checked(self, *, consistent: bool) -> None:
        """One sampled order check, and whether the judge mirrored itself."""
        self.state.order_checked += 1
        self.state.order_inconsistent += int(not consistent)
        self.dirty = True

    def scored(self, score: Score) -> None:
        """One grading ended: counted by score kind, and `Ungraded` by reason (§11.6: a
        tenant whose loop never engages must see why)."""
        key = f"ungraded:{score.reason.value}" if isinstance(score, Ungraded) else score.kind
        self.state.scores = _plus_one(self.state.scores, key)
        self.dirty = True


def _plus_one(counts: dict[str, int], key: str) -> dict[str, int]:
    return {**counts, key: counts.get(key, 0) + 1}


class Scoring:
    """One handler's grading: its unit of work and the tenant's meter as it changes it.
    Ending a run's grading emits its score, status, result and usage, and records the
    meter, in the handler's commit."""

    def __init__(self, uow: TournamentUnitOfWork, meter: Meter) -> None:
        self.uow = uow
        self.meter = meter
        judge, policy = uow.deps.judge, uow.deps.policy
        self.purse = Purse(
            uow.log, uow.tenant, meter.day, policy.limit_for(str(uow.tenant)), worst_call(judge)
        )
        """The tenant's grading ledger row for the day: every judge call reserves from it."""
        self._judge = PursedJudge(judge, self.purse)
        self._live: dict[RunId, LiveResult] = {}
        """Results issued in this handler, by run (not yet committed, so not readable)."""

    @classmethod
    async def open(cls, uow: TournamentUnitOfWork) -> Scoring:
        """Grading with the tenant's meter in this message's partition, for the day the
        handled fact occurred, beside today's calls in the other partitions."""
        day = uow.envelope.occurred_at.date().isoformat()
        shard = f"@{uow.partition}"
        mine: GradingMeter | None = None
        others = 0
        for key, meter in await uow.scan(GradingMeter, "grading"):
            if key == f"grading{shard}":
                mine = meter
            elif meter.day == day:
                others += meter.calls_today
        policy = uow.deps.policy
        return cls(uow, Meter.of(policy, day, mine, shard=shard, others_today=others))

    @property
    def judge(self) -> Judge:
        """The stage's judge, each call reserved against the tenant's grading ceiling."""
        return self._judge

    async def rank_attempts(
        self, episode: Episode, spec: GradingSpec, rubric: list[RubricItem]
    ) -> AttemptGrades | None:
        """Attempt tournaments on the episode's retries, when on and affordable."""
        meter = self.meter
        if not spec.attempts_ranked or meter.exhausted(episode.run.tenant):
            return None
        run = episode.run.run_id
        async with self.purse.block(attempt_calls(episode)) as affordable:
            if not affordable:  # ranked whole or not at all, as when the budget is spent
                return None
            grades = await grade_attempts(
                episode,
                self.judge,
                rubric,
                prior_precision=spec.precision,
                on_usage=meter.sink(run, JudgePurpose.ATTEMPTS),
            )
        for failure in grades.failures:
            meter.failed(run, JudgePurpose.ATTEMPTS, failure)
        return grades

    def waiting(self, msg: RunVerified, why: str) -> None:
        """The run rests in `Grading` until its comparison can happen."""
        self.uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=RunState.GRADING, detail=why))

    def flush(self) -> None:
        """Emit the calls the meter saw and record the meter, once per change."""
        uow, meter = self.uow, self.meter
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
                GradingMetered(meter=meter.state.model_dump(mode="json")),
            )
            meter.dirty = False

    async def finish(
        self,
        c: Candidate,
        score: Score,
        *,
        order_index: int | None = None,
        order_checks: OrderChecks | None = None,
    ) -> None:
        """End the branch's grading with `score`: record it, emit graded, status and result.

        The run's judge calls are what it carried from earlier handlers (while it
        waited) and what the meter saw for it in this one; `order_checks` are those of
        the tournament bouts it was in (none for any other grading).
        """
        spent = c.carried + self.meter.take(c.run.run_id)
        self._scored(
            c.verified,
            score,
            spent,
            order_index=order_index,
            was_parked=c.was_parked,
            replay=c.run.purpose is Purpose.SHADOW,
        )
        graded = self._graded(c.verified, score, spent, c.attempts, order_checks)
        if c.run.purpose is Purpose.WORK:
            await self.issue(_result(c, score, graded=graded))

    async def issue(self, result: RunResult) -> None:
        """Emit a branch's result. The task's result follows the live branch (§8.5): the
        highest-numbered one graded. A result a higher branch's replaces goes out again
        with `superseded_by` naming it (before the new one, so the last result of a run
        is its live branch's); a lower branch's, graded late, goes out superseded."""
        run = result.run_id
        live = self._live.get(run) or await self.uow.get(LiveResult, run)
        if live is not None and live.branch > result.branch:
            self.uow.emit(RESULTS, result.model_copy(update={"superseded_by": live.branch}))
            return
        if live is not None and live.branch < result.branch:
            replaced = RunResult.model_validate(live.result)
            self.uow.emit(RESULTS, replaced.model_copy(update={"superseded_by": result.branch}))
        issued = ResultIssued(
            run_id=run, branch=result.branch, result=result.model_dump(mode="json")
        )
        self.uow.record(BranchKey.main(self.uow.tenant, f"task:{result.task_id}"), issued)
        self._live[run] = LiveResult(branch=issued.branch, result=issued.result)
        self.uow.emit(RESULTS, result)

    def finish_sibling(self, msg: RunVerified, score: Score) -> None:
        """End a rollout sibling's grading with its score within the group: its group's
        `RolloutResult` is the task's one result, so the sibling gets none of its own."""
        spent = self.meter.take(msg.run.run_id)
        self._scored(msg, score, spent)
        self._graded(msg, score, spent)

    def _scored(
        self,
        msg: RunVerified,
        score: Score,
        spent: JudgeSpend,
        *,
        order_index: int | None = None,
        was_parked: bool = False,
        replay: bool = False,
    ) -> None:
        """Record the score (and for a shadow run, with `replay`, what it spent: §12.4)."""
        self.meter.scored(score)
        self.flush()
        r = msg.run
        stream = BranchKey.main(self.uow.tenant, f"task:{r.task_id}")
        if replay:
            usage = msg.usage
            self.uow.record(
                stream,
                ReplaySpent(
                    run_id=r.run_id,
                    day=self.meter.day,
                    model_calls=usage.model_calls,
                    tokens=usage.prompt_tokens + usage.completion_tokens,
                ),
            )
        self.uow.record(
            stream,
            RunScored(
                run_id=r.run_id,
                branch=r.branch_id,
                task_id=r.task_id,
                workflow_version=r.workflow_version,
                score=score,
                judge_calls=spent.answered.total(),
                order_index=order_index,
                was_parked=was_parked,
            ),
        )

    def _graded(
        self,
        msg: RunVerified,
        score: Score,
        spent: JudgeSpend,
        attempts: AttemptGrades | None = None,
        order_checks: OrderChecks | None = None,
    ) -> bool:
        """Emit the run's `RunGraded` and its `Graded`/`Ungraded` status; whether it was
        graded (any score but `Ungraded`)."""
        checks = order_checks or OrderChecks()
        self.uow.emit(
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
                judge_cost_usd=spent.micro_usd / MICRO,
                order_checked=checks.checked,
                order_inconsistent=checks.inconsistent,
            ),
        )
        graded = not isinstance(score, Ungraded)
        self.uow.emit(
            RUN_STATUS,
            RunStatusChanged(
                run=msg.run,
                state=RunState.GRADED if graded else RunState.UNGRADED,
                detail=score.reason.value if isinstance(score, Ungraded) else score.kind,
            ),
        )
        return graded


def _result(c: Candidate, score: Score, *, graded: bool) -> RunResult:
    """The task's result: what the consumer downstream reads."""
    r, msg = c.run, c.verified
    return RunResult(
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
        output=c.episode.output if c.episode else None,
        step_credit=list(c.attempts.credit) if c.attempts else [],
        held_out=r.held_out,
        branch=r.branch_id,
        parent_branch=None if r.branch is None else r.branch.parent,
    )
