"""The tournament stage's derived state, typed, and the fold that keeps it.

Kinds (per tenant): `reference` per (task, version); `summary` per episode execute
reduced (its summary's ref); `parked` challengers waiting
for their reference run; `scored` runs; `comparisons` counter per version (order
alternation); `group` per (task, outcome class) — the open tournament group's
epoch and clock; `member` per (task, outcome, run) — its members; `meter` — judge
calls today, by purpose, and the judge's health; `sibling` per (rollout group,
run) — a verified sibling waiting for its group; `rollout` per group — its
selection, once; `replay` per shadow run — what its execution spent, by the day its
grading ended (one document per run, so runs of a tenant graded at once on
different partitions never overwrite each other's spend); `verdict` per rollout
comparison or screen — the judge's answer, kept so a redelivery asks it again of
no one.

A document that is a payload an event carries as it was recorded (a waiting run,
a sibling, a selection, the meter) is stored as recorded, whichever version wrote
it; its read model reads every one of them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from assay.grading.attempts import AttemptGrades
from assay.kernel import RunId
from assay.kernel.scores import (
    AttemptRank,
    CoreViolation,
    Score,
    StepCredit,
    UnrankedAttempts,
    Verdict,
)
from assay.messages import JudgePurpose, RolloutResult, RunVerified
from assay.record import Delete, LogRecord, Put, ReadModel, StateDelta
from assay.runtime import Gauge
from assay.store import EventLog
from assay_tournament.calibration_state import CALIBRATION_STATE, fold_calibration
from assay_tournament.events import (
    METER_STREAM,
    ChallengerParked,
    EpisodeSummarised,
    GradingMetered,
    GradingStopped,
    GroupClosed,
    GroupJoined,
    JudgeAnswered,
    ReferenceSet,
    ReplaySpent,
    ResultIssued,
    RolloutSelected,
    RunScored,
    SiblingWaiting,
    graded_key,
    outcome_class,
)


def _without_absent(doc: dict[str, Any], optional: frozenset[str]) -> dict[str, Any]:
    """`doc` without the optional keys that are None: absent in the stored document."""
    return {k: v for k, v in doc.items() if k not in optional or v is not None}


class Reference(ReadModel):
    """A version's first episode on a task: its reference there."""

    kind: ClassVar[str] = "reference"
    run_id: RunId
    episode: str
    passed: bool


class Summary(ReadModel):
    """The summary standing for an episode execute reduced (`summary`, keyed by the
    original's ref): what `load_episode` reads once the original is gone."""

    kind: ClassVar[str] = "summary"
    summary: str


class Stopped(ReadModel):
    """A branch whose grading was cancelled. Keyed like its score."""

    kind: ClassVar[str] = "stopped"
    reason: str


class LiveResult(ReadModel):
    """The result that went out as the task's result of a run: its live branch's, so far.
    Keyed by run id."""

    kind: ClassVar[str] = "live-result"
    branch: int
    result: dict[str, Any]


class Scored(ReadModel):
    """A run whose grading ended, with its score. Keyed by run id, with `@<branch>` after
    it for a fork."""

    kind: ClassVar[str] = "scored"
    score: Score
    judge_calls: int


class Comparisons(ReadModel):
    """A version's next comparison index (the challenger's position alternates by it)."""

    kind: ClassVar[str] = "comparisons"
    next: int


class Group(ReadModel):
    """The open tournament group of a task and outcome class: its epoch and members, and
    (while open) when it opened, its quorum and its timeout. A closed one keeps only the
    next epoch, with no members."""

    kind: ClassVar[str] = "group"
    epoch: int
    members: int
    opened_ms: int | None = None
    quorum: int | None = None
    timeout_s: float | None = None

    @model_serializer(mode="wrap")
    def _closed_keeps_epoch(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_absent(handler(self), frozenset({"opened_ms", "quorum", "timeout_s"}))


class KeptAttempts(BaseModel):
    """A waiting run's attempt grades. Kept before `asked`/`answered` were: `judge_calls`."""

    model_config = ConfigDict(frozen=True)
    ranks: list[AttemptRank]
    credit: list[StepCredit]
    unranked: list[UnrankedAttempts] | None = None
    asked: int | None = None
    answered: int | None = None
    judge_calls: int | None = None

    @model_serializer(mode="wrap")
    def _as_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_absent(
            handler(self), frozenset({"unranked", "asked", "answered", "judge_calls"})
        )

    @classmethod
    def of(cls, grades: AttemptGrades) -> KeptAttempts:
        """The grades as a waiting run keeps them."""
        return cls(
            ranks=list(grades.ranks),
            credit=list(grades.credit),
            unranked=list(grades.unranked),
            asked=grades.asked,
            answered=grades.answered,
        )

    def grades(self) -> AttemptGrades:
        """The grades (their failures were counted when they were kept)."""
        legacy = self.judge_calls or 0
        return AttemptGrades(
            ranks=tuple(self.ranks),
            credit=tuple(self.credit),
            asked=legacy if self.asked is None else self.asked,
            answered=legacy if self.answered is None else self.answered,
            failures=(),
            unranked=tuple(self.unranked or ()),
        )


class KeptSpend(BaseModel):
    """A waiting run's judge calls so far, by purpose: answered and failed; and what
    every call it was billed cost, in micro-dollars (absent when kept before it was)."""

    model_config = ConfigDict(frozen=True)
    answered: dict[str, int]
    failed: dict[str, int]
    micro_usd: int | None = None

    @model_serializer(mode="wrap")
    def _as_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_absent(handler(self), frozenset({"micro_usd"}))


class Parked(ReadModel, RunVerified):
    """A verified run waiting for its reference run (`parked`): its `RunVerified` payload,
    what its grading spent so far, and its attempt grades."""

    kind: ClassVar[str] = "parked"
    judge_spent: KeptSpend | None = None
    """Absent when kept before spend was: its attempt grades' calls were all it spent."""
    attempt_grades: KeptAttempts | None = None

    @model_serializer(mode="wrap")
    def _as_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        kept = frozenset({"judge_spent", "attempt_grades", "episode_inline"})
        return _without_absent(handler(self), kept)

    def verified(self) -> RunVerified:
        """The run's `RunVerified`."""
        return RunVerified.model_validate(
            self.model_dump(exclude={"judge_spent", "attempt_grades"})
        )

    def spent(self) -> Counter[str]:
        """Its judge calls so far that answered, by purpose."""
        if self.judge_spent is not None:
            return Counter(self.judge_spent.answered)
        legacy = self.attempt_grades.judge_calls if self.attempt_grades else None
        return Counter({JudgePurpose.ATTEMPTS.value: legacy} if legacy else {})

    def failed(self) -> Counter[str]:
        """Its judge calls so far that failed, by purpose."""
        return Counter(self.judge_spent.failed if self.judge_spent else {})

    def micro_usd(self) -> int:
        """What its judge calls so far cost, in micro-dollars."""
        return (self.judge_spent.micro_usd or 0) if self.judge_spent else 0


class Member(Parked):
    """A member of an open tournament group, kept as a parked run is."""

    kind: ClassVar[str] = "member"


class Sibling(ReadModel, RunVerified):
    """A verified rollout sibling waiting for its group to close."""

    kind: ClassVar[str] = "sibling"


class Rollout(ReadModel, RolloutResult):
    """A rollout group's selection, once: the result it published."""

    kind: ClassVar[str] = "rollout"


class GradingMeter(ReadModel):
    """A tenant's grading meter in one partition: judge calls the endpoint billed today,
    those that answered by purpose, failures, order checks and scores by kind.

    The `failures_*` counts are absent until a failure is billed or counted.
    """

    model_config = ConfigDict(frozen=False)
    kind: ClassVar[str] = "meter"
    day: str = ""
    calls_today: int = 0
    calls_total: int = 0
    by_purpose: dict[str, int] = Field(default_factory=dict)
    order_checked: int = 0
    order_inconsistent: int = 0
    judge_failures: int = 0
    last_failure: str | None = None
    scores: dict[str, int] = Field(default_factory=dict)
    failures_billed: int | None = None
    failures_by_purpose: dict[str, int] | None = None

    @model_serializer(mode="wrap")
    def _as_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_absent(handler(self), frozenset({"failures_billed", "failures_by_purpose"}))


class ReplaySpend(ReadModel):
    """What a shadow run's execution spent, by the day its grading ended (§12.4)."""

    kind: ClassVar[str] = "replay"
    day: str
    model_calls: int
    tokens: int


class JudgeAnswer(ReadModel):
    """One judge answer given during a rollout selection: a verdict or violations."""

    kind: ClassVar[str] = "verdict"
    verdict: Verdict | None
    violations: list[CoreViolation]


TOURNAMENT_STATE: tuple[type[ReadModel], ...] = (
    Reference,
    Scored,
    Comparisons,
    Group,
    Parked,
    Member,
    Sibling,
    Rollout,
    GradingMeter,
    ReplaySpend,
    JudgeAnswer,
    LiveResult,
    Stopped,
    *CALIBRATION_STATE,
)
"""Every kind of document the tournament stage keeps, by its read model."""


def fold_tournament(record: LogRecord) -> list[StateDelta]:
    """References, parked challengers, scores, counters, open groups and the meter."""
    t = record.key.tenant
    match record.event:
        case ReferenceSet() as e:
            ref = Reference(run_id=e.run_id, episode=e.episode, passed=e.passed)
            return [ref.put(t, f"{e.task_id}/{e.workflow_version}")]
        case EpisodeSummarised() as e:
            return [Summary(summary=e.summary).put(t, e.original)]
        case ChallengerParked(verified=v):
            return [Put(Parked.at(t, f"{v['run']['task_id']}/{graded_key(v['run'])}"), v)]
        case RunScored() as e:
            out: list[StateDelta] = [
                Scored(score=e.score, judge_calls=e.judge_calls).put(t, e.graded_as)
            ]
            if e.order_index is not None:
                out.append(Comparisons(next=e.order_index + 1).put(t, e.workflow_version))
            if e.was_parked:
                out.append(Delete(Parked.at(t, f"{e.task_id}/{e.graded_as}")))
            return out
        case GroupJoined() as e:
            group = f"{e.task_id}/{outcome_class(e.passed)}"
            opened = Group(
                epoch=e.epoch,
                members=e.members,
                opened_ms=e.opened_ms,
                quorum=e.quorum,
                timeout_s=e.timeout_s,
            )
            run = graded_key(e.member["run"])
            return [opened.put(t, group), Put(Member.at(t, f"{group}/{run}"), e.member)]
        case GroupClosed() as e:
            group = f"{e.task_id}/{outcome_class(e.passed)}"
            return [
                Group(epoch=e.epoch + 1, members=0).put(t, group),
                *(Delete(Member.at(t, f"{group}/{run}")) for run in e.runs),
            ]
        case GradingMetered(meter=m):
            # one document per stream: `grading-meter@<partition>` -> `grading@<partition>`
            # (the single `grading-meter` stream of before keeps its `grading` document)
            stream = record.key.stream
            shard = stream.removeprefix(METER_STREAM) if stream.startswith(METER_STREAM) else ""
            return [Put(GradingMeter.at(t, f"grading{shard}"), m)]
        case SiblingWaiting() as e:
            run = e.verified["run"]["run_id"]
            return [Put(Sibling.at(t, f"{e.group}/{run}"), e.verified)]
        case RolloutSelected() as e:
            return [Put(Rollout.at(t, e.group), e.result)]
        case ReplaySpent() as e:
            spent = ReplaySpend(day=e.day, model_calls=e.model_calls, tokens=e.tokens)
            return [spent.put(t, e.run_id)]
        case GradingStopped() as e:
            key = e.graded_as
            return [
                Stopped(reason=e.reason).put(t, key),
                Delete(Parked.at(t, f"{e.task_id}/{key}")),
                *(
                    Delete(Member.at(t, f"{e.task_id}/{outcome_class(p)}/{key}"))
                    for p in (True, False)
                ),
            ]
        case ResultIssued() as e:
            return [LiveResult(branch=e.branch, result=e.result).put(t, e.run_id)]
        case JudgeAnswered() as e:
            answer = JudgeAnswer.model_validate(
                {"verdict": e.verdict, "violations": e.violations or []}
            )
            return [answer.put(t, e.key)]
    return fold_calibration(record)


async def backlog_gauges(log: EventLog) -> list[Gauge]:
    """§15's grading backlog, per tenant: open tournament groups and the runs waiting in
    them, and runs parked until their task's reference run is graded."""
    groups: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    for tenant, _, doc in await log.scan_kind(Group.kind):
        group = Group.model_validate(doc)
        if group.members:
            groups[str(tenant)] += 1
            waiting[str(tenant)] += group.members
    parked = Counter(str(tenant) for tenant, _, _ in await log.scan_kind(Parked.kind))
    tenants = sorted(set(groups) | set(parked))
    return [
        Gauge(
            "assay_tournament_groups_open",
            "Tournament groups open (waiting for their quorum or their timeout), per tenant.",
            ("tenant",),
            tuple(((t,), float(groups[t])) for t in tenants),
        ),
        Gauge(
            "assay_tournament_runs_waiting",
            "Verified runs waiting in an open tournament group, per tenant.",
            ("tenant",),
            tuple(((t,), float(waiting[t])) for t in tenants),
        ),
        Gauge(
            "assay_tournament_runs_parked",
            "Verified runs parked until their task's reference run is graded, per tenant.",
            ("tenant",),
            tuple(((t,), float(parked[t])) for t in tenants),
        ),
    ]
