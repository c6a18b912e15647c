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
from collections.abc import Callable
from typing import Any, Literal

from assay.bus.topics import RESULTS, RUN_STATUS, TASKS
from assay.grading.judges import Judge, JudgeFailed, UsageCallback
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
from assay.runtime import UnitOfWork
from assay.workflow import RubricItem, WorkflowDef
from assay_tournament.events import JudgeAnswered, RolloutSelected, SiblingWaiting
from assay_tournament.grading import Grading, Meter, load_episode

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

    def __init__(self, judge: Judge, uow: UnitOfWork[Any], group: str, flush: Callable[[], None]):
        self.judge, self.uow, self.group, self.flush = judge, uow, group, flush
        self.name = judge.name
        self.max_context_tokens = judge.max_context_tokens
        self.stream = BranchKey.main(uow.tenant, f"rollout:{group}")

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        key = f"{self.group}/{a.run.run_id}/{b.run.run_id}"
        known = await self.uow.get_document("verdict", key)
        if known is not None:
            return Verdict(known["verdict"])
        verdict = await self.judge.compare(a, b, rubric, on_usage=on_usage)
        self.uow.record(self.stream, JudgeAnswered(key=key, verdict=verdict.value))
        await self._commit()
        return verdict

    async def screen(
        self, episode: Episode, rubric: list[RubricItem], *, on_usage: UsageCallback | None = None
    ) -> list[CoreViolation]:
        key = f"{self.group}/{episode.run.run_id}"
        known = await self.uow.get_document("verdict", key)
        if known is not None:
            return [CoreViolation.model_validate(v) for v in known["violations"]]
        violations = await self.judge.screen(episode, rubric, on_usage=on_usage)
        self.uow.record(
            self.stream,
            JudgeAnswered(key=key, violations=[v.model_dump(mode="json") for v in violations]),
        )
        await self._commit()
        return violations

    async def _commit(self) -> None:
        self.flush()
        await self.uow.commit()


class RolloutSelection:
    """The tournament stage's rollout handlers."""

    def __init__(self, grading: Grading) -> None:
        self.grading = grading

    async def on_sibling(self, msg: RunVerified, uow: UnitOfWork[Any]) -> None:
        """Keep the sibling's verified episode; tell ingest it ended."""
        r = msg.run
        assert r.rollout is not None
        group = r.rollout.group
        if await uow.get_document("sibling", f"{group}/{r.run_id}") is not None:
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

    async def on_closed(self, msg: RolloutClosed, uow: UnitOfWork[Any]) -> None:
        """Select once among the siblings that ran; publish the group's one result."""
        group = msg.idempotency_key
        if await uow.get_document("rollout", group) is not None:
            return  # selected already
        meter = await self.grading.meter(uow)
        judge = RecordedJudge(
            self.grading.deps.judge, uow, group, lambda: self.grading.flush(uow, meter)
        )
        verified: list[tuple[RunVerified, Episode | None, list[CoreViolation]]] = []
        cancelled: list[SiblingResult] = []
        for index, run in enumerate(msg.runs):
            doc = await uow.get_document("sibling", f"{group}/{run}")
            if doc is None:
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
            sibling = RunVerified.model_validate(doc)
            episode = await load_episode(uow, sibling.episode)
            screened = await self._screen(uow, judge, sibling, episode, meter)
            verified.append((sibling, episode, screened))
        scores, record, winner = await self._select(uow, judge, msg, verified, meter)
        ranks = {run: score for run, score in scores.items() if isinstance(score, Ranked)}
        siblings = cancelled + [
            SiblingResult(
                run_id=s.run.run_id,
                index=s.run.rollout.index if s.run.rollout else 0,
                ended="verified",
                passed=s.passed,
                capped=bool(violations),
                verification=s.results,
                usage=s.usage,
                rank=ranks.get(s.run.run_id),
            )
            for s, _, violations in verified
        ]
        siblings.sort(key=lambda s: s.index)
        for s, _, violations in verified:
            score: Score = (
                Capped(violations=violations)
                if violations
                else scores.get(s.run.run_id) or Ungraded(reason=UngradedReason.INSUFFICIENT_GROUP)
            )
            self.grading.finish_sibling(uow, s, score, meter=meter)
        passes = sum(1 for s in siblings if s.ended == "verified" and s.passed)
        chosen = next((s for s in siblings if s.run_id == winner), None)
        winner_episode = next((e for s, e, _ in verified if s.run.run_id == winner), None)
        result = RolloutResult(
            tenant=msg.tenant,
            idempotency_key=group,
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
            output=winner_episode.output if winner_episode else None,
            selection=record,
            closed=msg.reason,
            detail=msg.detail,
            model_calls=msg.model_calls,
            tokens=msg.tokens,
            cost_usd=msg.cost_usd,
            peak_concurrency=msg.peak_concurrency,
        )
        uow.record(
            BranchKey.main(uow.tenant, f"rollout:{group}"),
            RolloutSelected(group=group, result=result.model_dump(mode="json")),
        )
        self.grading.flush(uow, meter)
        uow.emit(RESULTS, result)

    async def _screen(
        self,
        uow: UnitOfWork[Any],
        judge: Judge,
        s: RunVerified,
        episode: Episode | None,
        meter: Meter,
    ) -> list[CoreViolation]:
        if episode is None:
            return []
        rubric = list(WorkflowDef.model_validate(episode.definition).rubric)
        if not any(item.layer == "core" for item in rubric) or meter.exhausted(uow.tenant):
            return []
        try:
            return await judge.screen(
                episode, rubric, on_usage=meter.sink(s.run.run_id, JudgePurpose.SCREEN)
            )
        except JudgeFailed as exc:
            meter.failed(s.run.run_id, JudgePurpose.SCREEN, str(exc))
            return []

    async def _select(
        self,
        uow: UnitOfWork[Any],
        judge: Judge,
        msg: RolloutClosed,
        verified: list[tuple[RunVerified, Episode | None, list[CoreViolation]]],
        meter: Meter,
    ) -> tuple[dict[RunId, Ranked | Ungraded], SelectionRecord, RunId | None]:
        policy = msg.spec.selection
        eligible = [(s, e) for s, e, v in verified if not v and e is not None]
        passing = [(s, e) for s, e in eligible if s.passed]
        best = passing or [(s, e) for s, e in eligible if not s.passed]
        scores: dict[RunId, Ranked | Ungraded] = {}
        answered = failed = 0
        winner: RunId | None = None
        decided_by: Literal["verifier", "judge", "index", "none"] = "none"
        index = {s.run.run_id: s.run.rollout.index if s.run.rollout else 0 for s, _ in best}
        if msg.spec.mode == "trajectory_collection":
            evidence = "trajectory collection selects no winner"
        elif not best:
            evidence = "no sibling was verified without a Core violation"
        elif len(best) == 1:
            winner, decided_by = best[0][0].run.run_id, "verifier"
            how = "passed" if passing else "failed, as every sibling did,"
            evidence = f"sibling #{index[winner]} alone {how} without a Core violation"
        elif meter.exhausted(uow.tenant):
            winner, decided_by = min(index, key=index.__getitem__), "index"
            evidence = "the tenant's judge budget is spent: the lowest index of the best class"
        else:
            outcome = await self._tournament(uow, judge, msg, best, meter)
            answered, failed = outcome.answered, len(outcome.failures)
            scores = {RunId(name): score for name, score in outcome.scores.items()}
            winner, decided_by, evidence = self._judged(outcome, index, passing=bool(passing))
        record = SelectionRecord(
            policy=policy.name,
            policy_version=policy.policy_version,
            decided_by=decided_by,
            evidence=evidence,
            judge_calls=answered,
            judge_failures=failed,
        )
        return scores, record, winner

    @staticmethod
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
        self,
        uow: UnitOfWork[Any],
        judge: Judge,
        msg: RolloutClosed,
        best: list[tuple[RunVerified, Episode]],
        meter: Meter,
    ) -> TournamentOutcome:
        """Rank the best outcome class: Swiss pairing, both orderings, Bradley-Terry."""
        workflow = WorkflowDef.model_validate(best[0][1].definition)
        sinks = {s.run.run_id: meter.sink(s.run.run_id, JudgePurpose.ROLLOUT) for s, _ in best}
        outcome = await run_tournament(
            [Entrant(name=str(s.run.run_id), episode=e, control=False) for s, e in best],
            judge,
            list(workflow.rubric),
            seed=f"{uow.tenant}/rollout/{msg.idempotency_key}",
            prior_precision=workflow.grading.precision,
            on_usage=lambda shown, usage: sinks[RunId(shown)](usage),
        )
        for failure in outcome.failures:
            meter.failed(RunId(failure.billed_to), JudgePurpose.ROLLOUT, failure.reason)
        return outcome
