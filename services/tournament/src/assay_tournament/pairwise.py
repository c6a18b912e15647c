"""Pairwise-sequential and deterministic grading (§11.3): a challenger episode against
the current version's reference on the same task.

The first episode of each version on a task is that version's reference there. A
challenger is compared with the current version's reference — pass-vs-fail by the
verifier, otherwise by the judge with the challenger's position alternating (and,
on a sampled fraction, asked again with the positions swapped to measure order
consistency) or, for `deterministic`, by a number the episodes hold — whatever the
workflow's registered pairwise strategy's `compare` says. A challenger
whose paired reference run is still on its way is parked until it arrives.
"""

from __future__ import annotations

from assay.grading.judges import JudgeFailed
from assay.grading.strategies import Pair, strategy_named
from assay.kernel import RunId, WorkflowVersion
from assay.kernel.canonical import digest
from assay.kernel.scores import Relative, Score, Ungraded, UngradedReason
from assay.messages import JudgePurpose, Role, RunVerified
from assay.record import BranchKey
from assay.workflow import WorkflowDef
from assay_tournament.events import ChallengerParked, ReferenceSet
from assay_tournament.grading import Candidate, Scoring, load_episode
from assay_tournament.purse import GradingCeilingReached
from assay_tournament.state import Comparisons, Parked, Reference


def _sampled(run_id: RunId, fraction: float) -> bool:
    """Whether this run's comparison is order-checked: a stable draw from its id."""
    return int(digest(f"order-check/{run_id}".encode())[:8], 16) / 16**8 < fraction


async def grade_pairwise(s: Scoring, c: Candidate) -> None:
    """A current version's episode becomes the reference (releasing the challengers that
    waited for it); a challenger's is compared with its baseline's reference, or parked."""
    uow, r = s.uow, c.run
    own = await uow.get(Reference, f"{r.task_id}/{r.workflow_version}")
    if own is None:
        uow.record(
            BranchKey.main(uow.tenant, f"task:{r.task_id}"),
            ReferenceSet(
                task_id=r.task_id,
                workflow_version=r.workflow_version,
                run_id=r.run_id,
                episode=c.verified.episode,
                passed=c.verified.passed,
            ),
        )
    if r.role is Role.CURRENT:
        reason = UngradedReason.NO_REFERENCE if own is None else UngradedReason.BASELINE
        await s.finish(c, Ungraded(reason=reason))
        await release_parked(s, c.verified)
        return
    baseline = r.baseline_version
    reference = await uow.get(Reference, f"{r.task_id}/{baseline}") if baseline else None
    if reference is not None:
        await compare(s, c, reference, await _next_index(s, r.workflow_version))
    elif r.reference_expected:
        kept = c.kept(s.meter.take(r.run_id))
        uow.record(BranchKey.main(uow.tenant, f"task:{r.task_id}"), ChallengerParked(verified=kept))
        s.waiting(c.verified, "waiting for the reference run")
    else:
        await s.finish(c, Ungraded(reason=UngradedReason.NO_REFERENCE))


async def release_parked(s: Scoring, msg: RunVerified) -> None:
    """Grade the challengers parked on this task that waited for this current run."""
    r = msg.run
    fresh = Reference(run_id=r.run_id, episode=msg.episode, passed=msg.passed)
    index: int | None = None
    for _, parked in await s.uow.scan(Parked, f"{r.task_id}/"):
        if parked.run.baseline_version != r.workflow_version:
            continue
        episode = await load_episode(s.uow, parked.episode)
        c = Candidate.waiting(parked, episode, parked=True)
        if episode is None:
            await s.finish(c, Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE))
            continue
        if index is None:
            index = await _next_index(s, c.run.workflow_version)
        index = await compare(s, c, reference=fresh, index=index)


async def compare(s: Scoring, c: Candidate, reference: Reference, index: int) -> int:
    """Score one challenger episode against the reference; the next comparison index."""
    score, compared = await _against(s, c, reference, index)
    await s.finish(c, score, order_index=index if compared else None)
    return index + 1 if compared else index


async def _against(
    s: Scoring, c: Candidate, reference: Reference, index: int
) -> tuple[Score, bool]:
    """The challenger's score against the reference by its workflow's registered strategy,
    and whether the judge compared them (only a judged comparison takes an index)."""
    assert c.episode is not None
    workflow = WorkflowDef.model_validate(c.episode.definition)
    strategy = strategy_named(workflow.grading.strategy, s.uow.deps.strategies)
    theirs = await load_episode(s.uow, reference.episode)
    if theirs is None:
        return Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE), False
    meter, run = s.meter, c.run.run_id
    if strategy.judged and meter.exhausted(c.run.tenant):
        return Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED), False
    pair = Pair(
        spec=workflow.grading,
        rubric=list(workflow.rubric),
        challenger=c.episode,
        challenger_passed=c.verified.passed,
        reference=theirs,
        reference_passed=reference.passed,
        reference_run=reference.run_id,
        order_index=index,
        order_check=strategy.judged and _sampled(run, meter.policy.order_check),
        judge=s.judge,
        on_usage=meter.sink(run, JudgePurpose.COMPARE),
    )
    try:
        score = await strategy.compare(pair)
    except GradingCeilingReached:
        return Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED), False
    except JudgeFailed as exc:
        meter.failed(run, JudgePurpose.COMPARE, str(exc))
        return Ungraded(reason=UngradedReason.JUDGE_FAILED), False
    if isinstance(score, Relative) and score.order_consistent is not None:
        meter.order_checked(consistent=score.order_consistent)
    return score, strategy.judged and not isinstance(score, Ungraded)


async def _next_index(s: Scoring, version: WorkflowVersion) -> int:
    counter = await s.uow.get(Comparisons, version)
    return counter.next if counter else 0
