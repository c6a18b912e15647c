"""Ranking a candidate matrix (§11.1 `ReplayTournament`): one fit, control pinned.

Every candidate's siblings (`samples` of them, default one) ran the same task.
The candidates are ranked in one Bradley-Terry fit with the Davidson tie term,
the control's strength pinned to zero, whose players are the candidates: every
comparison between siblings of two candidates counts for those two candidates,
so a candidate's strength pools its siblings' comparisons and its interval
narrows as it runs more. The comparisons are of two kinds:

- **Verifier-decided.** A sibling every verifier passed beats one that failed
  (§11.8: by definition, never shown to a judge), counted as a bout both of
  whose orderings it won.
- **Judged.** Within each outcome class, a Swiss tournament (both orderings)
  among the siblings of that class, as a rollout group's selection runs it;
  siblings of one candidate are paired only when the round cannot avoid it, and
  such a bout ranks nothing.

A capped sibling (`Core` violation) or one cancelled before verification is not
ranked. The winner is a sibling of the strongest candidate of the best outcome
class — the recorded policy `verifier_then_judge` — its lowest index in that
class, with equal strengths falling to the lowest index. Each ranked sibling's
score is its candidate's. Judge calls are metered as the group's selection's
(purpose `rollout`); the candidates' own runs were metered as `replay`.
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
    """Rank every candidate with a verified, uncapped sibling against the pinned control;
    select."""
    assert msg.candidates is not None
    plans = {i: p for p in msg.candidates for i in p.indexes}
    control = next(p for p in msg.candidates if p.control)
    eligible = [c for c in contenders if not c.capped and c.episode is not None]
    seen = await _comparisons(s, judge, msg, eligible, plans)
    strengths = _fit(seen, eligible, plans)
    scores = {
        c.verified.run.run_id: strengths[plans[c.index].name]
        for c in eligible
        if plans[c.index].name in strengths
    }
    passing = [c for c in eligible if c.verified.passed]
    best = passing or eligible
    winner, decided_by, evidence = _winner(msg, best, strengths, plans, seen.asked)
    record = SelectionRecord(
        policy=msg.spec.selection.name,
        policy_version=msg.spec.selection.policy_version,
        decided_by=decided_by,
        evidence=evidence,
        judge_calls=seen.asked - seen.unanswered,
        judge_failures=seen.unanswered,
    )
    lines = _lines(msg, contenders, strengths)
    return MatrixRanking(scores, record, winner, lines, control.name)


@dataclass
class Comparisons:
    """Every comparison of the matrix between two candidates' siblings, as the counts the
    fit reads (by candidate); by candidate, those decided (by a verifier or an answered
    judge call) and those the judge left unanswered; the judge calls asked and left
    unanswered (a bout of two siblings of one candidate included)."""

    counts: list[PairCount]
    answered: dict[str, int]
    failed: dict[str, int]
    asked: int = 0
    unanswered: int = 0


async def _comparisons(
    s: Scoring,
    judge: Judge,
    msg: RolloutClosed,
    eligible: list[Contender],
    plans: dict[int, PlannedCandidate],
) -> Comparisons:
    """The verifier-decided counts, then each outcome class's judged bouts, each between
    two siblings counted for their candidates."""
    of = {c.name: plans[c.index].name for c in eligible}
    counts: list[PairCount] = []
    answered = dict.fromkeys(of.values(), 0)
    failed = dict.fromkeys(of.values(), 0)
    seen = Comparisons(counts, answered, failed)
    for p in (c for c in eligible if c.verified.passed):
        for f in (c for c in eligible if not c.verified.passed):
            if of[p.name] == of[f.name]:
                continue  # one candidate's pass and fail: no evidence between candidates
            counts.append(PairCount(of[p.name], of[f.name], 2.0, 0.0, 0.0))  # §11.8
            answered[of[p.name]] += 2
            answered[of[f.name]] += 2
    for outcome in (True, False):
        group = [c for c in eligible if c.verified.passed is outcome]
        if len({of[c.name] for c in group}) < 2 or s.meter.exhausted(s.uow.tenant):
            continue
        bouts, asked = await _judged(s, judge, msg, group, "pass" if outcome else "fail", of)
        seen.asked += asked
        for bout in bouts:
            a, b = of[bout.a], of[bout.b]
            seen.unanswered += (bout.first is None) + (bout.second is None)
            if a == b:
                continue  # two siblings of one candidate: it ranks nothing
            count = bout.count()
            if count.a_wins + count.b_wins + count.draws > 0:
                counts.append(PairCount(a, b, count.a_wins, count.b_wins, count.draws))
            for verdict in (bout.first, bout.second):
                tally = answered if verdict is not None else failed
                tally[a] += 1
                tally[b] += 1
    return seen


async def _judged(
    s: Scoring,
    judge: Judge,
    msg: RolloutClosed,
    group: list[Contender],
    outcome: str,
    of: dict[str, str],
) -> tuple[list[Bout], int]:
    """One outcome class's Swiss tournament (both orderings), siblings of one candidate
    kept apart while the round allows: its bouts and calls asked."""
    meter = s.meter
    sinks = {
        c.verified.run.run_id: meter.sink(c.verified.run.run_id, JudgePurpose.ROLLOUT)
        for c in group
    }
    workflow = _workflow(group)
    kin = [
        frozenset((a.name, b.name))
        for i, a in enumerate(group)
        for b in group[i + 1 :]
        if of[a.name] == of[b.name]
    ]
    played = await run_tournament(
        [Entrant(name=c.name, episode=c.episode, control=False) for c in group if c.episode],
        judge,
        list(workflow.rubric),
        seed=f"{s.uow.tenant}/replay/{msg.idempotency_key}/{outcome}",
        prior_precision=workflow.grading.precision,
        on_usage=lambda shown, usage: sinks[RunId(shown)](usage),
        apart=kin,
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
) -> dict[str, Ranked]:
    """One Bradley-Terry-Davidson fit over every comparison, by candidate, the control
    pinned to zero when it was compared (else the mean, and `anchored` says so)."""
    counts, answered, failed = seen.counts, seen.answered, seen.failed
    return fit_candidates(
        counts,
        answered,
        failed,
        control=next(p.name for p in plans.values() if p.control),
        prior_precision=_workflow(eligible).grading.precision if eligible else 0.0,
    )


def fit_candidates(
    counts: list[PairCount],
    answered: dict[str, int],
    failed: dict[str, int],
    *,
    control: str,
    prior_precision: float,
) -> dict[str, Ranked]:
    """The candidates' strengths from their pooled counts: one Bradley-Terry-Davidson fit
    over every candidate with an answered comparison (`answered`: by candidate), `control`
    pinned to zero when it is one of them (else their mean, not `anchored`)."""
    players = [name for name, n in answered.items() if n > 0]
    if not counts or len(players) < 2:
        return {}
    anchored = control in players
    result = fit(
        counts,
        anchor=[control] if anchored else players,
        prior_precision=prior_precision,
        ties=Ties.DAVIDSON,
        players=players,
    )
    return {
        name: Ranked(
            strength=st.strength,
            interval=st.interval,
            group_size=len(answered),
            anchored=anchored,
            comparisons=answered[name],
            comparisons_failed=failed.get(name, 0),
        )
        for name, st in result.strengths.items()
    }


def _winner(
    msg: RolloutClosed,
    best: list[Contender],
    strengths: dict[str, Ranked],
    plans: dict[int, PlannedCandidate],
    asked: int,
) -> tuple[RunId | None, Literal["verifier", "judge", "index", "none"], str]:
    """A sibling of the strongest candidate of the best outcome class (its lowest index
    there; equal strengths to the lowest index), who decided it, and the evidence."""
    if msg.spec.mode == "trajectory_collection" or not best:
        return None, "none", "no candidate was verified without a Core violation"
    how = "passed" if best[0].verified.passed else "failed"
    first = min(best, key=lambda c: c.index)
    shown = sorted({plans[c.index].index: plans[c.index] for c in best}.items())
    classed = [plan for _, plan in shown]
    if len(classed) == 1:
        return (
            first.verified.run.run_id,
            "verifier",
            f"candidate {classed[0].name!r} alone {how} without a Core violation; "
            + _shown(strengths, classed),
        )
    ranked = [c for c in best if plans[c.index].name in strengths]
    if not ranked:
        why = f"the judge answered none of {asked} comparisons" if asked else "no judge call"
        return first.verified.run.run_id, "index", f"{why}: the lowest index of the best class"
    top = max(strengths[plans[c.index].name].strength for c in ranked)
    leaders = sorted(
        (c for c in ranked if top - strengths[plans[c.index].name].strength < TIE),
        key=lambda c: c.index,
    )
    tied = len({plans[c.index].name for c in leaders}) > 1
    tie = "tie broken by the lowest index" if tied else "the strongest won"
    evidence = f"{len(classed)} candidates {how}; {_shown(strengths, classed)}; {tie}"
    return leaders[0].verified.run.run_id, "index" if tied else "judge", evidence


def _shown(strengths: dict[str, Ranked], shown: list[PlannedCandidate]) -> str:
    parts = []
    for plan in shown:
        r = strengths.get(plan.name)
        if r is not None:
            lo, hi = r.interval
            parts.append(f"{plan.name} {r.strength:+.3f} [{lo:+.2f}, {hi:+.2f}]")
    if not parts:
        return "no Bradley-Terry strength"
    return "Bradley-Terry strengths against the control: " + ", ".join(parts)


def _lines(
    msg: RolloutClosed, contenders: list[Contender], strengths: dict[str, Ranked]
) -> list[CandidateResult]:
    """Each candidate's line over all its siblings: strength, rank (1 = strongest; equal
    strengths share one), pass rate over its verified siblings."""
    assert msg.candidates is not None
    ordered = sorted({round(r.strength, 9) for r in strengths.values()}, reverse=True)
    lines = []
    for plan in msg.candidates:
        runs = [msg.runs[i] for i in plan.indexes if i < len(msg.runs)]
        ran = [c for c in contenders if c.index in plan.indexes]
        passes = sum(1 for c in ran if c.verified.passed)
        score = strengths.get(plan.name)
        lines.append(
            CandidateResult(
                name=plan.name,
                kind=plan.kind,
                variant=plan.variant,
                workflow_version=plan.workflow_version,
                control=plan.control,
                samples=plan.samples,
                runs=runs,
                verified=len(ran),
                passes=passes,
                pass_rate=passes / len(ran) if ran else None,
                capped=any(c.capped for c in ran),
                strength=score,
                rank=None if score is None else ordered.index(round(score.strength, 9)) + 1,
            )
        )
    return lines
