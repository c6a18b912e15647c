"""Tournament: `assay.verified` -> `assay.graded`, `assay.results` (§11).

Keyed by `(tenant, task)`, so every episode of a task lands here on one
partition. Each episode is graded by the strategy its pinned workflow declares:
`pairwise_sequential` (default, §11.3) and `deterministic` against the current
version's reference (`pairwise.py`), `tournament` in groups (§11.4-§11.6,
`groups.py`). A rollout group's siblings wait for its selection (`rollouts.py`).

Every episode is screened for `Core` violations first (a capped episode leaves
the bracket), and attempt tournaments run on its retries (§11.5). Judge calls
are metered per tenant and purpose; a tenant at its daily ceiling is
`Ungraded{BudgetExhausted}`.
"""

from __future__ import annotations

from pydantic import ValidationError

from assay.grading.judges import JudgeFailed
from assay.grading.strategies import StrategyRefused, check_fits, profile
from assay.kernel.errors import Refused
from assay.kernel.scores import Capped, Score, Ungraded, UngradedReason
from assay.messages import Episode, JudgePurpose, Role, RunVerified
from assay.record.compaction import with_compaction
from assay.runtime import StageDeps, StageSpec, routes
from assay.runtime.timers import timer
from assay.workflow import GradingSpec, WorkflowDef
from assay_tournament.events import (
    TOURNAMENT_EVENTS,
    ChallengerParked,
    GroupClosed,
    GroupJoined,
    ReferenceSet,
    RunScored,
)
from assay_tournament.grading import (
    Candidate,
    Judging,
    Scoring,
    TournamentUnitOfWork,
    load_episode,
)
from assay_tournament.groups import clock_ms, group_due, join_group, on_group_due
from assay_tournament.pairwise import grade_pairwise, release_parked
from assay_tournament.rollouts import on_rollout_closed, on_sibling
from assay_tournament.state import Group, Scored, backlog_gauges, fold_tournament

__all__ = [
    "TOURNAMENT_EVENTS",
    "ChallengerParked",
    "GroupClosed",
    "GroupJoined",
    "ReferenceSet",
    "RunScored",
    "create_stage",
    "fold_tournament",
    "on_group_due",
    "on_rollout_closed",
    "on_run_verified",
]


async def on_run_verified(msg: RunVerified, uow: TournamentUnitOfWork) -> None:
    """Grade a verified run by its workflow's strategy: screen it for `Core` violations,
    rank its attempts, then compare it with its reference or add it to its group.

    Raises:
        Refused: the episode's workflow does not validate, or its grading does not fit.
    """
    r = msg.run
    if await uow.get(Scored, r.run_id) is not None:
        return
    if r.rollout is not None:  # a sibling waits for its group's selection (§13)
        await on_sibling(msg, uow)
        return
    s = await Scoring.open(uow)
    episode = await load_episode(uow, msg.episode)
    if episode is None:
        s.finish(Candidate(msg), Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE))
        if r.role is Role.CURRENT:  # they waited for this run; do not strand them
            await release_parked(s, msg)
        return
    workflow = _workflow(episode, uow.deps)
    kept_out = await _screened_out(s, msg, episode, workflow)
    if kept_out is not None:
        s.finish(Candidate(msg, episode), kept_out)
        return
    spec = workflow.grading
    attempts = await s.rank_attempts(episode, spec, list(workflow.rubric))
    s.flush()  # attempt calls are the run's, whenever it is scored
    if spec.strategy == "tournament":
        await join_group(s, Candidate(msg, episode, attempts), spec)
    else:
        await grade_pairwise(s, Candidate(msg, episode, attempts))
        s.flush()


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the tournament stage.

    Raises:
        StrategyRefused: the default strategy does not fit the declared capacity.
    """
    judging = Judging(judge=deps.judge, policy=deps.grading)
    check_fits(
        profile(GradingSpec(), judging.judge, order_check=judging.policy.order_check),
        judging.policy,
    )
    return StageSpec(
        name="tournament",
        events=TOURNAMENT_EVENTS,
        fold=with_compaction(fold_tournament),
        handlers=routes(on_run_verified, on_group_due, on_rollout_closed),
        deps=judging,
        background=(timer(Group.kind, group_due, lambda: clock_ms() / 1000),),
        gauges=backlog_gauges,
    )


def _workflow(episode: Episode, judging: Judging) -> WorkflowDef:
    """The episode's workflow, its grading checked against the declared capacity."""
    try:
        workflow = WorkflowDef.model_validate(episode.definition)
    except ValidationError as exc:
        raise Refused(f"the episode's workflow definition does not validate: {exc}") from exc
    rubric = list(workflow.rubric)
    policy = judging.policy
    try:
        check_fits(
            profile(workflow.grading, judging.judge, rubric, order_check=policy.order_check), policy
        )
    except StrategyRefused as exc:
        raise Refused(str(exc)) from exc
    return workflow


async def _screened_out(
    s: Scoring, msg: RunVerified, episode: Episode, workflow: WorkflowDef
) -> Score | None:
    """The score of an episode the `Core` screen keeps out of grading (§11.7: capped, out
    of the bracket, not the reference), or of one that could not be screened; None when
    it goes on to be graded."""
    r, rubric, strategy = msg.run, list(workflow.rubric), workflow.grading.strategy
    screened = strategy != "deterministic" and (
        r.role is Role.CHALLENGER or strategy == "tournament"
    )
    if not screened or not any(item.layer == "core" for item in rubric):
        return None
    if s.meter.exhausted(r.tenant):
        return Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)
    try:
        violations = await s.judge.screen(
            episode, rubric, on_usage=s.meter.sink(r.run_id, JudgePurpose.SCREEN)
        )
    except JudgeFailed as exc:
        s.meter.failed(r.run_id, JudgePurpose.SCREEN, str(exc))
        return Ungraded(reason=UngradedReason.JUDGE_FAILED)
    return Capped(violations=violations) if violations else None
