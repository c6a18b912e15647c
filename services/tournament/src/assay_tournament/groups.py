"""Tournament grading (§11.4-§11.6): groups that fill, close once, and never reopen.

A group is keyed `(tenant, task, outcome class, epoch)`. An episode joins the
open group of its task and verifier outcome class; the group closes when it
reaches its quorum or when its timeout passes (a timer in this stage sends
itself a `GroupDue`, ordered with the task's episodes on their partition), and
is graded once: Swiss pairing, both orderings, Bradley-Terry-Davidson with the
control version pinned to zero. Closing moves the task's outcome class to the
next epoch, so a late arrival starts a new group — strengths already published
never change underneath a decision (§11.6). An installed grouped strategy that
declares its own `rank` grades its closed groups by it instead of the Swiss rounds.
A group that closes with one member reports `Ungraded{InsufficientGroup}`, a stated
reason, not a silence; a member the judge answered no comparison about is
`Ungraded{JudgeFailed}`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from assay.bus.topics import VERIFIED
from assay.grading.strategies import (
    GroupToRank,
    RankingStrategy,
    StrategyRefused,
    params_of,
    strategy_named,
)
from assay.grading.swiss import rounds_for
from assay.grading.tournament import Entrant, run_tournament
from assay.kernel import RunId, TaskId, TenantId
from assay.kernel.scores import Ranked, Ungraded, UngradedReason
from assay.messages import GroupDue, JudgePurpose, Role
from assay.record import BranchKey
from assay.runtime.timers import Fired
from assay.workflow import GradingSpec, WorkflowDef
from assay_tournament.events import GroupClosed, GroupJoined, outcome_class
from assay_tournament.grading import (
    Candidate,
    OrderChecks,
    Scoring,
    TournamentUnitOfWork,
    load_episode,
)
from assay_tournament.purse import GradingCeilingReached
from assay_tournament.state import Group, Member


def clock_ms() -> int:
    """Wall-clock milliseconds: when a group opened, and whether its timeout passed."""
    return int(time.time() * 1000)


async def join_group(s: Scoring, c: Candidate, spec: GradingSpec) -> None:
    """Add the episode to its open group; grade the group if that fills it."""
    uow, r, passed = s.uow, c.run, c.verified.passed
    key = f"{r.task_id}/{outcome_class(passed)}"
    group = await uow.get(Group, key) or Group(epoch=0, members=0)
    opened_ms, quorum, timeout_s = _clock(group, spec)
    members = group.members + 1
    joined = Candidate(c.verified, c.episode, c.attempts, s.meter.take(r.run_id))
    uow.record(
        BranchKey.main(uow.tenant, f"task:{r.task_id}"),
        GroupJoined(
            task_id=r.task_id,
            passed=passed,
            epoch=group.epoch,
            opened_ms=opened_ms,
            quorum=quorum,
            timeout_s=timeout_s,
            members=members,
            member=joined.kept(joined.carried),
        ),
    )
    s.flush()
    if members >= quorum:
        await close_group(s, r.task_id, passed, group.epoch, joined=joined, on_timeout=False)
    else:
        why = f"in tournament group {key}#{group.epoch} ({members} of {quorum})"
        s.waiting(c.verified, why)


def _clock(group: Group, spec: GradingSpec) -> tuple[int, int, float]:
    """When the group opened, its quorum and its timeout: the spec's, now, for a group
    this episode opens."""
    if group.members and group.opened_ms is not None and group.quorum and group.timeout_s:
        return group.opened_ms, group.quorum, group.timeout_s
    return clock_ms(), spec.group_quorum, spec.timeout_s


async def on_group_due(msg: GroupDue, uow: TournamentUnitOfWork) -> None:
    """A group's timeout passed: close it, unless it already closed."""
    group = await uow.get(Group, f"{msg.task_id}/{outcome_class(msg.passed)}")
    if group is None or group.epoch != msg.epoch or group.members == 0:
        return  # closed on quorum meanwhile, or a repeated timer
    s = await Scoring.open(uow)
    await close_group(s, msg.task_id, msg.passed, msg.epoch, joined=None, on_timeout=True)


@dataclass(frozen=True)
class _Bracket:
    """What a group's tournament took (nothing when it could not be held)."""

    answered: int = 0
    failed: int = 0
    inconsistent: int = 0
    anchored: bool = False
    rounds_planned: int = 0
    rounds_played: int = 0


async def close_group(
    s: Scoring,
    task: TaskId,
    passed: bool,
    epoch: int,
    *,
    joined: Candidate | None,
    on_timeout: bool,
) -> None:
    """Grade the group once and move its task and outcome class to the next epoch.

    `joined` is the member whose joining filled the group: it joined in this very
    commit, so the committed state does not hold it yet.
    """
    uow, key = s.uow, f"{task}/{outcome_class(passed)}"
    members = [Candidate.waiting(m, parked=False) for _, m in await uow.scan(Member, f"{key}/")]
    if joined is not None and all(m.run.graded_as != joined.run.graded_as for m in members):
        members.append(joined)
    members.sort(key=lambda m: m.run.graded_as)
    present = []
    for m in members:
        episode = await load_episode(uow, m.verified.episode)
        if episode is None:
            await s.finish(m, Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE))
        else:
            present.append(Candidate(m.verified, episode, m.attempts, m.carried))
    bracket = await _bracket(s, present, seed=f"{uow.tenant}/{key}/{epoch}")
    s.flush()
    uow.record(
        BranchKey.main(uow.tenant, f"task:{task}"),
        GroupClosed(
            task_id=task,
            passed=passed,
            epoch=epoch,
            runs=[RunId(m.run.graded_as) for m in members],  # a fork's with its branch
            on_timeout=on_timeout,
            judge_calls=bracket.answered,
            judge_failures=bracket.failed,
            inconsistent=bracket.inconsistent,
            anchored=bracket.anchored,
            rounds_planned=bracket.rounds_planned,
            rounds_played=bracket.rounds_played,
        ),
    )


async def _bracket(s: Scoring, present: list[Candidate], *, seed: str) -> _Bracket:
    """Grade the members whose episodes are at hand: a tournament among them, or each
    `Ungraded` when there are fewer than two or the tenant's judge budget is spent. The
    tournament's calls are reserved first: when all its rounds do not fit under the
    tenant's grading ceiling it plays fewer (downsampled), and none when not one fits."""
    meter = s.meter
    if len(present) < 2 or meter.exhausted(s.uow.tenant):
        few = len(present) < 2
        reason = UngradedReason.INSUFFICIENT_GROUP if few else UngradedReason.BUDGET_EXHAUSTED
        for m in present:
            await s.finish(m, Ungraded(reason=reason))
        return _Bracket()
    # Entrants are named as graded (`RunRef.graded_as`): two branches of a run are two.
    episodes = {m.run.graded_as: m.episode for m in present if m.episode is not None}
    runs = {m.run.graded_as: m.run.run_id for m in present}
    workflow = WorkflowDef.model_validate(episodes[present[0].run.graded_as].definition)
    sinks = {name: meter.sink(runs[name], JudgePurpose.TOURNAMENT) for name in episodes}
    strategy = strategy_named(workflow.grading.strategy, s.uow.deps.strategies)
    if isinstance(strategy, RankingStrategy):
        return await _ranked_by(s, strategy, workflow, present, sinks, seed=seed)
    planned = rounds_for(len(present))
    async with s.purse.rounds(planned, 2 * (len(present) // 2)) as affordable:
        if affordable == 0:  # not one round fits under the tenant's grading ceiling
            for m in present:
                await s.finish(m, Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED))
            return _Bracket(rounds_planned=planned)
        outcome = await run_tournament(
            [
                Entrant(
                    name=m.run.graded_as,
                    episode=episodes[m.run.graded_as],
                    control=m.run.role is Role.CURRENT,
                )
                for m in present
            ],
            s.judge,
            list(workflow.rubric),
            seed=seed,
            prior_precision=workflow.grading.precision,
            on_usage=lambda shown, usage: sinks[shown](usage),
            rounds=affordable,
        )
    for failure in outcome.failures:
        billed = runs.get(failure.billed_to, RunId(failure.billed_to))
        meter.failed(billed, JudgePurpose.TOURNAMENT, failure.reason)
    signals, wf = s.uow.signals, str(workflow.id)
    checks = {name: OrderChecks() for name in episodes}
    for bout in outcome.bouts:
        if bout.consistent is not None:
            meter.order_checked(consistent=bout.consistent)
            for entrant in (bout.a, bout.b):  # each run's RunGraded: the ladder's drift check
                checks[entrant] = checks[entrant].add(consistent=bout.consistent)
            if signals is not None:  # §15: the bout is an order check, counted once committed
                s.uow.on_landed(
                    functools.partial(
                        signals.order_checked, str(s.uow.tenant), wf, consistent=bout.consistent
                    )
                )
    for m in present:
        name = m.run.graded_as
        await s.finish(m, outcome.scores[name], order_checks=checks[name])
    return _Bracket(
        outcome.answered,
        len(outcome.failures),
        outcome.inconsistent,
        outcome.anchored,
        outcome.rounds_planned,
        outcome.rounds_played,
    )


async def _ranked_by(
    s: Scoring,
    strategy: RankingStrategy,
    workflow: WorkflowDef,
    present: list[Candidate],
    sinks: dict[str, Any],
    *,
    seed: str,
) -> _Bracket:
    """Grade the group by the strategy's own ranking (it declared `rank`): each judge call
    it makes is reserved on its own against the tenant's ceiling; one that does not fit
    leaves the group `Ungraded{BudgetExhausted}`. An entrant the ranking leaves out is
    `Ungraded{JudgeFailed}`.

    Raises:
        StrategyRefused: the ranking gave an entrant a score that is neither the variant
            the strategy produces nor `Ungraded`.
    """
    grading = workflow.grading
    group = GroupToRank(
        spec=grading,
        params=params_of(strategy, grading),
        entrants=[
            Entrant(name=m.run.graded_as, episode=m.episode, control=m.run.role is Role.CURRENT)
            for m in present
            if m.episode is not None
        ],
        judge=s.judge,
        rubric=list(workflow.rubric),
        seed=seed,
        on_usage=lambda shown, usage: sinks[shown](usage),
    )
    try:
        scores = dict(await strategy.rank(group))
    except GradingCeilingReached:
        for m in present:
            await s.finish(m, Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED))
        return _Bracket()
    for name, score in scores.items():
        if not isinstance(score, strategy.produces | Ungraded):
            raise StrategyRefused(
                f"grading strategy {grading.strategy!r} ranked {name} as a "
                f"{type(score).__name__}; it produces {strategy.produces.__name__} or Ungraded"
            )
    for m in present:
        found = scores.get(m.run.graded_as)
        await s.finish(
            m, found if found is not None else Ungraded(reason=UngradedReason.JUDGE_FAILED)
        )
    anchored = any(isinstance(v, Ranked) and v.anchored for v in scores.values())
    return _Bracket(anchored=anchored)


def group_due(tenant: TenantId, key: str, doc: dict[str, Any], now_ms: float) -> Fired | None:
    """An open group whose timeout passed sends itself its `GroupDue`."""
    group = Group.model_validate(doc)
    if group.members == 0 or group.opened_ms is None or group.timeout_s is None:
        return None
    if group.opened_ms + group.timeout_s * 1000 > now_ms:
        return None
    task, outcome = key.rsplit("/", 1)
    msg = GroupDue(tenant=tenant, task_id=TaskId(task), passed=outcome == "pass", epoch=group.epoch)
    return VERIFIED, msg, f"group-due:{key}:{group.epoch}"
