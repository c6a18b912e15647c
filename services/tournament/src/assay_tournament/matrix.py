"""Ranking a candidate matrix (§11.1 `ReplayTournament`): one fit, control pinned.

Every candidate's sibling ran the same task. The candidates are ranked in one
Bradley-Terry fit with the Davidson tie term, the control's strength pinned to
zero, from two kinds of comparison:

- **Verifier-decided.** A candidate every verifier passed beats one that failed
  (§11.8: by definition, never shown to a judge), counted as a bout both of
  whose orderings it won.
- **Judged.** Within each outcome class, a Swiss tournament (both orderings)
  among the candidates of that class, as a rollout group's selection runs it.

A capped candidate (`Core` violation) or one cancelled before verification is
not ranked. The winner is the strongest of the best outcome class — the
recorded policy `verifier_then_judge` — with equal strengths falling to the
lowest index. Judge calls are metered as the group's selection's (purpose
`rollout`); the candidates' own runs were metered as `replay`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from assay.grading.bt import PairCount, Ties, fit
from assay.grading.judges import Judge
from assay.grading.tournament import Bout, Entrant, run_tournament
from assay.kernel import RunId
from assay.kernel.scores import Ranked
from assay.messages import Episode, JudgePurpose, RolloutClosed, RunVerified, SelectionRecord
from assay.messages.candidates import CandidateResult, PlannedCandidate
from assay.workflow import WorkflowDef
from assay_tournament.grading import Scoring

TIE = 1e-9
"""Strengths closer than this are equal: they share a rank, and the lower index wins."""


@dataclass(frozen=True)
class Contender:
    """A candidate's sibling that ran to verification."""

    index: int
    verified: RunVerified
    episode: Episode | None
    capped: bool

    @property
    def name(self) -> str:
        return str(self.verified.run.run_id)


@dataclass(frozen=True)
class MatrixRanking:
    """The matrix's scores (by run), the selection record and winner, and each candidate's
    line of the result."""

    scores: dict[RunId, Ranked]
    record: SelectionRecord
    winner: RunId | None
    candidates: list[CandidateResult]
    control: str


async def rank_matrix(
    s: Scoring, judge: Judge, msg: RolloutClosed, contenders: list[Contender]
) -> MatrixRanking:
    """Rank every verified, uncapped candidate against the pinned control; select."""
    assert msg.candidates is not None
    plans = {p.index: p for p in msg.candidates}
    control = next(p for p in msg.candidates if p.control)
    eligible = [c for c in contenders if not c.capped and c.episode is not None]
    seen = await _comparisons(s, judge, msg, eligible)
    scores = _fit(seen, eligible, plans)
    passing = [c for c in eligible if c.verified.passed]
    best = passing or eligible
    winner, decided_by, evidence = _winner(msg, best, scores, plans, seen.asked)
    record = SelectionRecord(
        policy=msg.spec.selection.name,
        policy_version=msg.spec.selection.policy_version,
        decided_by=decided_by,
        evidence=evidence,
        judge_calls=seen.asked - seen.unanswered,
        judge_failures=seen.unanswered,
    )
    lines = _lines(msg, contenders, scores)
    return MatrixRanking(scores, record, winner, lines, control.name)


@dataclass
class Comparisons:
    """Every comparison of the matrix: the counts the fit reads; by contender, those
    decided (by a verifier or an answered judge call) and those the judge left unanswered;
    the judge calls asked and left unanswered."""

    counts: list[PairCount]
    answered: dict[str, int]
    failed: dict[str, int]
    asked: int = 0
    unanswered: int = 0


async def _comparisons(
    s: Scoring, judge: Judge, msg: RolloutClosed, eligible: list[Contender]
) -> Comparisons:
    """The verifier-decided counts, then each outcome class's judged bouts."""
    counts: list[PairCount] = []
    answered = {c.name: 0 for c in eligible}
    failed = {c.name: 0 for c in eligible}
    seen = Comparisons(counts, answered, failed)
    for p in (c for c in eligible if c.verified.passed):
        for f in (c for c in eligible if not c.verified.passed):
            counts.append(PairCount(p.name, f.name, 2.0, 0.0, 0.0))  # §11.8: pass beats fail
            answered[p.name] += 2
            answered[f.name] += 2
    for outcome in (True, False):
        group = [c for c in eligible if c.verified.passed is outcome]
        if len(group) < 2 or s.meter.exhausted(s.uow.tenant):
            continue
        bouts, asked = await _judged(s, judge, msg, group, "pass" if outcome else "fail")
        seen.asked += asked
        for bout in bouts:
            count = bout.count()
            if count.a_wins + count.b_wins + count.draws > 0:
                counts.append(count)
            for verdict in (bout.first, bout.second):
                tally = answered if verdict is not None else failed
                tally[bout.a] += 1
                tally[bout.b] += 1
                seen.unanswered += verdict is None
    return seen


async def _judged(
    s: Scoring, judge: Judge, msg: RolloutClosed, group: list[Contender], outcome: str
) -> tuple[list[Bout], int]:
    """One outcome class's Swiss tournament (both orderings): its bouts and calls asked."""
    meter = s.meter
    sinks = {
        c.verified.run.run_id: meter.sink(c.verified.run.run_id, JudgePurpose.ROLLOUT)
        for c in group
    }
    workflow = _workflow(group)
    played = await run_tournament(
        [Entrant(name=c.name, episode=c.episode, control=False) for c in group if c.episode],
        judge,
        list(workflow.rubric),
        seed=f"{s.uow.tenant}/replay/{msg.idempotency_key}/{outcome}",
        prior_precision=workflow.grading.precision,
        on_usage=lambda shown, usage: sinks[RunId(shown)](usage),
    )
    for failure in played.failures:
        meter.failed(RunId(failure.billed_to), JudgePurpose.ROLLOUT, failure.reason)
    return list(played.bouts), played.asked


def _workflow(group: list[Contender]) -> WorkflowDef:
    """The workflow of the group's first episode: its rubric and prior (every candidate
    varies one workflow)."""
    episode = next(c.episode for c in group if c.episode is not None)
    return WorkflowDef.model_validate(episode.definition)


def _fit(
    seen: Comparisons, eligible: list[Contender], plans: dict[int, PlannedCandidate]
) -> dict[RunId, Ranked]:
    """One Bradley-Terry-Davidson fit over every comparison, the control pinned to zero
    when it was compared (else the mean, and `anchored` says so)."""
    counts, answered, failed = seen.counts, seen.answered, seen.failed
    players = [c.name for c in eligible if answered[c.name] > 0]
    if not counts or len(players) < 2:
        return {}
    controls = [c.name for c in eligible if plans[c.index].control and c.name in players]
    result = fit(
        counts,
        anchor=controls or players,
        prior_precision=_workflow(eligible).grading.precision,
        ties=Ties.DAVIDSON,
        players=players,
    )
    return {
        RunId(name): Ranked(
            strength=st.strength,
            interval=st.interval,
            group_size=len(eligible),
            anchored=bool(controls),
            comparisons=answered[name],
            comparisons_failed=failed[name],
        )
        for name, st in result.strengths.items()
    }


def _winner(
    msg: RolloutClosed,
    best: list[Contender],
    scores: dict[RunId, Ranked],
    plans: dict[int, PlannedCandidate],
    asked: int,
) -> tuple[RunId | None, Literal["verifier", "judge", "index", "none"], str]:
    """The strongest of the best outcome class (ties to the lowest index), who decided it,
    and the evidence."""
    if msg.spec.mode == "trajectory_collection" or not best:
        return None, "none", "no candidate was verified without a Core violation"
    how = "passed" if best[0].verified.passed else "failed"
    if len(best) == 1:
        only = best[0]
        return (
            only.verified.run.run_id,
            "verifier",
            f"candidate {plans[only.index].name!r} alone {how} without a Core violation; "
            + _shown(scores, plans, best),
        )
    ranked = [c for c in best if c.verified.run.run_id in scores]
    if not ranked:
        first = min(best, key=lambda c: c.index)
        why = f"the judge answered none of {asked} comparisons" if asked else "no judge call"
        return first.verified.run.run_id, "index", f"{why}: the lowest index of the best class"
    top = max(scores[c.verified.run.run_id].strength for c in ranked)
    leaders = sorted(
        (c for c in ranked if top - scores[c.verified.run.run_id].strength < TIE),
        key=lambda c: c.index,
    )
    tie = "tie broken by the lowest index" if len(leaders) > 1 else "the strongest won"
    evidence = f"{len(best)} candidates {how}; {_shown(scores, plans, best)}; {tie}"
    return leaders[0].verified.run.run_id, "index" if len(leaders) > 1 else "judge", evidence


def _shown(
    scores: dict[RunId, Ranked], plans: dict[int, PlannedCandidate], shown: list[Contender]
) -> str:
    parts = []
    for c in sorted(shown, key=lambda c: c.index):
        r = scores.get(c.verified.run.run_id)
        if r is not None:
            lo, hi = r.interval
            parts.append(f"{plans[c.index].name} {r.strength:+.3f} [{lo:+.2f}, {hi:+.2f}]")
    if not parts:
        return "no Bradley-Terry strength"
    return "Bradley-Terry strengths against the control: " + ", ".join(parts)


def _lines(
    msg: RolloutClosed, contenders: list[Contender], scores: dict[RunId, Ranked]
) -> list[CandidateResult]:
    """Each candidate's line: strength, rank (1 = strongest; equal strengths share one),
    pass rate over its verified siblings."""
    assert msg.candidates is not None
    strengths = sorted({round(r.strength, 9) for r in scores.values()}, reverse=True)
    lines = []
    for plan in msg.candidates:
        runs = [msg.runs[plan.index]] if plan.index < len(msg.runs) else []
        ran = [c for c in contenders if c.index == plan.index]
        passes = sum(1 for c in ran if c.verified.passed)
        score = next(
            (scores[c.verified.run.run_id] for c in ran if c.verified.run.run_id in scores), None
        )
        lines.append(
            CandidateResult(
                name=plan.name,
                kind=plan.kind,
                variant=plan.variant,
                workflow_version=plan.workflow_version,
                control=plan.control,
                runs=runs,
                verified=len(ran),
                passes=passes,
                pass_rate=passes / len(ran) if ran else None,
                capped=any(c.capped for c in ran),
                strength=score,
                rank=None if score is None else strengths.index(round(score.strength, 9)) + 1,
            )
        )
    return lines
