"""Selection in a rollout group (DESIGN §13): explicit, recorded, never "who finished first".

Every sibling's verified episode lands here (they share the task's partition)
and waits; ingest's `RolloutClosed` says no more will come. The policy
`verifier_then_judge` then decides: a sibling every verifier passed beats one
that failed (§11.8 — never shown to a judge), a `Core` violation keeps a
sibling from winning, and among the siblings of the best outcome class a
Bradley-Terry tournament (Swiss pairing, both orderings) ranks them; equal
strengths fall to the lowest index. The evidence is recorded with the policy's
name and version. pass@k is the unbiased estimator over the verified siblings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from assay.bus.topics import RESULTS, RUN_STATUS, TASKS
from assay.grading.judges import Judge, JudgeFailed, UsageCallback
from assay.grading.swiss import rounds_for
from assay.grading.tournament import Entrant, TournamentOutcome, run_tournament
from assay.kernel import RunId, RunState
from assay.kernel.scores import (
    Capped,
    CoreViolation,
    Ranked,
    Score,
    Ungraded,
    UngradedReason,
    Verdict,
)
from assay.messages import (
    Episode,
    JudgePurpose,
    RolloutClosed,
    RolloutProgress,
    RolloutResult,
    RunStatusChanged,
    RunVerified,
    SelectionRecord,
    SiblingResult,
    Usage,
)
from assay.record import BranchKey
from assay.workflow import RubricItem, WorkflowDef
from assay_tournament.events import JudgeAnswered, RolloutSelected, SiblingWaiting
from assay_tournament.grading import Scoring, TournamentUnitOfWork, load_episode
from assay_tournament.matrix import Contender, MatrixRanking, rank_matrix
from assay_tournament.purse import GradingCeilingReached
from assay_tournament.state import JudgeAnswer, Rollout, Sibling

TIE = 1e-9
"""Strengths closer than this are equal; the lower index wins."""


def pass_at_k(n: int, c: int) -> list[float]:
    """Unbiased pass@k for k = 1..n with c passes among n samples: 1 - C(n-c, k) / C(n, k)."""
    return [1.0 - math.comb(n - c, k) / math.comb(n, k) for k in range(1, n + 1)]


class RecordedJudge:
    """The stage's judge, its answers for one selection made durable as they are given.

    Each verdict and screen is recorded and committed (with its metered usage) the
    moment the judge answers, so a selection redelivered after a crash asks nothing
    twice: a restart repeats no evaluator call (DESIGN §13).
    """

    def __init__(self, s: Scoring, group: str) -> None:
        self.scoring, self.judge, self.group = s, s.judge, group
        self.name = self.judge.name
        self.max_context_tokens = self.judge.max_context_tokens
        self.stream = BranchKey.main(s.uow.tenant, f"rollout:{group}")

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        key = f"{self.group}/{a.run.run_id}/{b.run.run_id}"
        known = await self.scoring.uow.get(JudgeAnswer, key)
        if known is not None and known.verdict is not None:
            return known.verdict
        verdict = await self.judge.compare(a, b, rubric, on_usage=on_usage)
        await self._keep(JudgeAnswered(key=key, verdict=verdict.value))
        return verdict

    async def screen(
        self, episode: Episode, rubric: list[RubricItem], *, on_usage: UsageCallback | None = None
    ) -> list[CoreViolation]:
        key = f"{self.group}/{episode.run.run_id}"
        known = await self.scoring.uow.get(JudgeAnswer, key)
        if known is not None:
            return list(known.violations)
        violations = await self.judge.screen(episode, rubric, on_usage=on_usage)
        dumped = [v.model_dump(mode="json") for v in violations]
        await self._keep(JudgeAnswered(key=key, violations=dumped))
        return violations

    async def _keep(self, answer: JudgeAnswered) -> None:
        async with self.scoring.uow.step():
            self.scoring.uow.record(self.stream, answer)
            self.scoring.flush()


async def on_sibling(msg: RunVerified, uow: TournamentUnitOfWork) -> None:
    """Keep the sibling's verified episode; tell ingest it ended."""
    r = msg.run
    assert r.rollout is not None
    group = r.rollout.group
    if await uow.get(Sibling, f"{group}/{r.run_id}") is not None:
        return
    uow.record(
        BranchKey.main(uow.tenant, f"rollout:{group}"),
        SiblingWaiting(group=group, verified=msg.model_dump(mode="json")),
    )
    uow.emit(
        RUN_STATUS,
        RunStatusChanged(
            run=r, state=RunState.GRADING, detail=f"waiting for rollout group {group}"
        ),
    )
    uow.emit(
        TASKS,
        RolloutProgress(
            tenant=r.tenant,
            idempotency_key=group,
            run_id=r.run_id,
            index=r.rollout.index,
            ended="verified",
            model_calls=msg.usage.model_calls,
            tokens=msg.usage.prompt_tokens + msg.usage.completion_tokens,
            cost_usd=msg.cost_usd,
        ),
    )


@dataclass(frozen=True)
class _Verified:
    """A sibling that ran to verification: its episode (None: unavailable) and its `Core`
    violations."""

    verified: RunVerified
    episode: Episode | None
    violations: list[CoreViolation]

    @property
    def index(self) -> int:
        return self.verified.run.rollout.index if self.verified.run.rollout else 0


async def on_rollout_closed(msg: RolloutClosed, uow: TournamentUnitOfWork) -> None:
    """Select once among the siblings that ran; publish the group's one result."""
    group = msg.idempotency_key
    if await uow.get(Rollout, group) is not None:
        return  # selected already
    s = await Scoring.open(uow)
    judge = RecordedJudge(s, group)
    verified, cancelled = await _siblings(s, judge, msg)
    ranking = await _ranked_matrix(s, judge, msg, verified)
    scores: dict[RunId, Ranked | Ungraded]
    if ranking is not None:
        scores, record, winner = dict(ranking.scores), ranking.record, ranking.winner
    else:
        scores, record, winner = await _select(s, judge, msg, verified)
    for v in verified:
        score: Score = (
            Capped(violations=v.violations)
            if v.violations
            else scores.get(v.verified.run.run_id)
            or Ungraded(reason=UngradedReason.INSUFFICIENT_GROUP)
        )
        s.finish_sibling(v.verified, score)
    result = _result(msg, verified, cancelled, scores, record, winner)
    if ranking is not None:
        matrix = {"candidates": ranking.candidates, "control": ranking.control}
        result = result.model_copy(update={**matrix, "estimate": msg.estimate})
    uow.record(
        BranchKey.main(uow.tenant, f"rollout:{group}"),
        RolloutSelected(group=group, result=result.model_dump(mode="json")),
    )
    s.flush()
    uow.emit(RESULTS, result)


async def _ranked_matrix(
    s: Scoring, judge: Judge, msg: RolloutClosed, verified: list[_Verified]
) -> MatrixRanking | None:
    """A candidate matrix's ranking against its control (`matrix.py`); None for a
    homogeneous group."""
    if msg.candidates is None:
        return None
    contenders = [Contender(v.index, v.verified, v.episode, bool(v.violations)) for v in verified]
    return await rank_matrix(s, judge, msg, contenders)


async def _siblings(
    s: Scoring, judge: Judge, msg: RolloutClosed
) -> tuple[list[_Verified], list[SiblingResult]]:
    """The siblings that ran to verification (screened), and those cancelled before."""
    verified: list[_Verified] = []
    cancelled: list[SiblingResult] = []
    for index, run in enumerate(msg.runs):
        sibling = await s.uow.get(Sibling, f"{msg.idempotency_key}/{run}")
        if sibling is None:
            cancelled.append(
                SiblingResult(
                    run_id=run,
                    index=index,
                    ended="cancelled",
                    passed=False,
                    verification=[],
                    usage=Usage(),
                )
            )
            continue
        ran = RunVerified.model_validate(sibling.model_dump())
        episode = await load_episode(s.uow, ran.episode)
        verified.append(_Verified(ran, episode, await _screen(s, judge, ran, episode)))
    return verified, cancelled


def _result(
    msg: RolloutClosed,
    verified: list[_Verified],
    cancelled: list[SiblingResult],
    scores: dict[RunId, Ranked | Ungraded],
    record: SelectionRecord,
    winner: RunId | None,
) -> RolloutResult:
    """The group's one result: every sibling, pass@k, and the winner with its evidence."""
    siblings = cancelled + [
        SiblingResult(
            run_id=v.verified.run.run_id,
            index=v.index,
            ended="verified",
            passed=v.verified.passed,
            capped=bool(v.violations),
            verification=v.verified.results,
            usage=v.verified.usage,
            rank=score if isinstance(score := scores.get(v.verified.run.run_id), Ranked) else None,
        )
        for v in verified
    ]
    siblings.sort(key=lambda sib: sib.index)
    passes = sum(1 for sib in siblings if sib.ended == "verified" and sib.passed)
    chosen = next((sib for sib in siblings if sib.run_id == winner), None)
    won = next((v.episode for v in verified if v.verified.run.run_id == winner), None)
    return RolloutResult(
        tenant=msg.tenant,
        idempotency_key=msg.idempotency_key,
        task_id=msg.task_id,
        workflow_id=msg.workflow_id,
        workflow_version=msg.workflow_version,
        mode=msg.spec.mode,
        requested=msg.spec.n,
        admitted=msg.admitted,
        siblings=siblings,
        passes=passes,
        pass_at_k=pass_at_k(len(verified), passes),
        best_of_n_passed=bool(chosen and chosen.passed),
        winner=winner,
        output=won.output if won else None,
        selection=record,
        closed=msg.reason,
        detail=msg.detail,
        model_calls=msg.model_calls,
        tokens=msg.tokens,
        cost_usd=msg.cost_usd,
        peak_concurrency=msg.peak_concurrency,
    )


async def _screen(
    s: Scoring, judge: Judge, sibling: RunVerified, episode: Episode | None
) -> list[CoreViolation]:
    """The sibling's `Core` violations (none when it cannot be screened)."""
    if episode is None:
        return []
    rubric = list(WorkflowDef.model_validate(episode.definition).rubric)
    meter, run = s.meter, sibling.run.run_id
    if not any(item.layer == "core" for item in rubric) or meter.exhausted(s.uow.tenant):
        return []
    try:
        return await judge.screen(episode, rubric, on_usage=meter.sink(run, JudgePurpose.SCREEN))
    except GradingCeilingReached:
        return []  # unscreened, as when the budget was spent before
    except JudgeFailed as exc:
        meter.failed(run, JudgePurpose.SCREEN, str(exc))
        return []


async def _select(
    s: Scoring, judge: Judge, msg: RolloutClosed, verified: list[_Verified]
) -> tuple[dict[RunId, Ranked | Ungraded], SelectionRecord, RunId | None]:
    """The policy's choice among the siblings of the best outcome class, and its record."""
    policy = msg.spec.selection
    eligible = [(v.verified, v.episode) for v in verified if not v.violations and v.episode]
    passing = [(r, e) for r, e in eligible if r.passed]
    best = passing or [(r, e) for r, e in eligible if not r.passed]
    scores: dict[RunId, Ranked | Ungraded] = {}
    answered = failed = 0
    winner: RunId | None = None
    decided_by: Literal["verifier", "judge", "index", "none"] = "none"
    index = {r.run.run_id: r.run.rollout.index if r.run.rollout else 0 for r, _ in best}
    if msg.spec.mode == "trajectory_collection":
        evidence = "trajectory collection selects no winner"
    elif not best:
        evidence = "no sibling was verified without a Core violation"
    elif len(best) == 1:
        winner, decided_by = best[0][0].run.run_id, "verifier"
        how = "passed" if passing else "failed, as every sibling did,"
        evidence = f"sibling #{index[winner]} alone {how} without a Core violation"
    elif s.meter.exhausted(s.uow.tenant):
        winner, decided_by = min(index, key=index.__getitem__), "index"
        evidence = "the tenant's judge budget is spent: the lowest index of the best class"
    elif (outcome := await _tournament(s, judge, msg, best)) is None:
        winner, decided_by = min(index, key=index.__getitem__), "index"
        evidence = (
            "the tenant's grading ceiling holds not one round of the best class's "
            "tournament: the lowest index of the best class"
        )
    else:
        answered, failed = outcome.answered, len(outcome.failures)
        scores = {RunId(name): score for name, score in outcome.scores.items()}
        winner, decided_by, evidence = _judged(outcome, index, passing=bool(passing))
    record = SelectionRecord(
        policy=policy.name,
        policy_version=policy.policy_version,
        decided_by=decided_by,
        evidence=evidence,
        judge_calls=answered,
        judge_failures=failed,
    )
    return scores, record, winner


def _judged(
    outcome: TournamentOutcome, index: dict[RunId, int], *, passing: bool
) -> tuple[RunId, Literal["judge", "index"], str]:
    """The winner of the best class's tournament, who decided it, and the evidence. A
    sibling the judge answered nothing about is not ranked and cannot win on strength."""
    ranks = {RunId(name): rank for name, rank in outcome.ranked.items()}
    if not ranks:
        return (
            min(index, key=index.__getitem__),
            "index",
            f"the judge answered none of {outcome.asked} comparisons: the lowest index of "
            "the best class",
        )
    top = max(r.strength for r in ranks.values())
    leaders = sorted(
        (run for run, r in ranks.items() if top - r.strength < TIE), key=index.__getitem__
    )
    shown = ", ".join(
        f"#{index[run]} {ranks[run].strength:+.3f} "
        f"[{ranks[run].interval[0]:+.2f}, {ranks[run].interval[1]:+.2f}]"
        for run in sorted(ranks, key=index.__getitem__)
    )
    tie = "tie broken by the lowest index" if len(leaders) > 1 else "the strongest won"
    unranked = len(index) - len(ranks)
    left = f"; {unranked} unranked (the judge answered nothing about them)" if unranked else ""
    evidence = (
        f"{len(index)} siblings {'passed' if passing else 'failed'}; "
        f"Bradley-Terry strengths {shown}{left}; {tie}"
    )
    return leaders[0], "index" if len(leaders) > 1 else "judge", evidence


async def _tournament(
    s: Scoring, judge: Judge, msg: RolloutClosed, best: list[tuple[RunVerified, Episode]]
) -> TournamentOutcome | None:
    """Rank the best outcome class: Swiss pairing, both orderings, Bradley-Terry; in
    fewer rounds when the tenant's grading ceiling holds only those, None when it holds
    not one."""
    meter = s.meter
    workflow = WorkflowDef.model_validate(best[0][1].definition)
    sinks = {r.run.run_id: meter.sink(r.run.run_id, JudgePurpose.ROLLOUT) for r, _ in best}
    async with s.purse.rounds(rounds_for(len(best)), 2 * (len(best) // 2)) as affordable:
        if affordable == 0:
            return None
        outcome = await run_tournament(
            [Entrant(name=str(r.run.run_id), episode=e, control=False) for r, e in best],
            judge,
            list(workflow.rubric),
            seed=f"{s.uow.tenant}/rollout/{msg.idempotency_key}",
            prior_precision=workflow.grading.precision,
            on_usage=lambda shown, usage: sinks[RunId(shown)](usage),
            rounds=affordable,
        )
    for failure in outcome.failures:
        meter.failed(RunId(failure.billed_to), JudgePurpose.ROLLOUT, failure.reason)
    return outcome
