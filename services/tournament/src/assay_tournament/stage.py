"""Tournament: `assay.verified` -> `assay.graded`, `assay.results` (§11).

Keyed by `(tenant, task)`, so every episode of a task lands here on one
partition. Each episode is graded by the strategy its pinned workflow declares:
a pairwise one — `pairwise_sequential` (default, §11.3), `deterministic` or an
installed one — against the current version's reference (`pairwise.py`), a grouped
one (`tournament`, or an installed one) in groups (§11.4-§11.6, `groups.py`), ranked
by the Swiss tournament or by the strategy's own `rank`; the stage asks the
registered strategy, never its name. A rollout group's siblings wait for its
selection (`rollouts.py`).

Every episode is screened for `Core` violations first (a capped episode leaves
the bracket), and attempt tournaments run on its retries (§11.5). Judge calls
are metered per tenant and purpose; a tenant at its daily ceiling is
`Ungraded{BudgetExhausted}`. A branch cancelled while verified or graded gets no
judge call from then on and a `cancelled` result (`cancels.py`).
"""

from __future__ import annotations

import functools

from pydantic import ValidationError

from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.calibration_set import read_calibration_set
from assay.grading.judges import JudgeFailed
from assay.grading.strategies import StrategyRefused, check_fits, profile, strategy_named
from assay.kernel.errors import Refused
from assay.kernel.ids import TenantId
from assay.kernel.scores import Capped, Score, Ungraded, UngradedReason
from assay.messages import Episode, JudgePurpose, Role, RunVerified
from assay.record.compaction import with_compaction
from assay.runtime import Gauge, StageDeps, StageSpec, routes
from assay.runtime.timers import timer
from assay.store import EventLog
from assay.store.inline_blobs import claimed_blob
from assay.workflow import GradingSpec, WorkflowDef
from assay_tournament.calibration import (
    calibration_timer,
    keep_for_calibration,
    on_calibration_due,
)
from assay_tournament.calibration_state import calibration_gauges
from assay_tournament.cancels import on_grading_cancelled
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
    on_episode_reduced,
)
from assay_tournament.groups import clock_ms, group_due, join_group, on_group_due
from assay_tournament.pairwise import grade_pairwise, release_parked
from assay_tournament.purse import GradingCeilingReached
from assay_tournament.rollouts import on_rollout_closed, on_sibling
from assay_tournament.state import Group, Scored, Stopped, backlog_gauges, fold_tournament

__all__ = [
    "TOURNAMENT_EVENTS",
    "ChallengerParked",
    "GroupClosed",
    "GroupJoined",
    "ReferenceSet",
    "RunScored",
    "create_stage",
    "fold_tournament",
    "on_calibration_due",
    "on_grading_cancelled",
    "on_group_due",
    "on_rollout_closed",
    "on_run_verified",
]


async def on_run_verified(msg: RunVerified, uow: TournamentUnitOfWork) -> None:
    """Grade a verified run by its workflow's strategy: screen it for `Core` violations,
    rank its attempts, then compare it with its reference or add it to its group.

    The episode is its inline copy when the message carried one; what is kept of the run
    for later (parked, a group member, a sibling) keeps the blob's ref, not the copy, and
    the copy goes to the blob cache for those later reads.

    Raises:
        Refused: the episode's workflow does not validate, or its grading does not fit.
        InlineCopyMismatch: the inline copy is not the blob the message names.
    """
    r = msg.run
    if await uow.get(Scored, r.graded_as) or await uow.get(Stopped, r.graded_as):
        return  # graded already, or its grading was cancelled: no judge call
    inline, msg = msg.episode_inline, msg.model_copy(update={"episode_inline": None})
    await keep_for_calibration(uow, msg)
    if r.rollout is not None:  # a sibling waits for its group's selection (§13)
        if inline is not None:  # checked now, and cached for the group's close
            await claimed_blob(uow.blobs, uow.tenant, msg.episode, inline)
        await on_sibling(msg, uow)
        return
    s = await Scoring.open(uow)
    episode = await load_episode(uow, msg.episode, inline)
    if episode is None:
        await s.finish(Candidate(msg), Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE))
        if r.role is Role.CURRENT:  # they waited for this run; do not strand them
            await release_parked(s, msg)
        return
    workflow = _workflow(episode, uow.deps)
    kept_out = await _screened_out(s, msg, episode, workflow)
    if kept_out is not None:
        await s.finish(Candidate(msg, episode), kept_out)
        return
    spec = workflow.grading
    attempts = await s.rank_attempts(episode, spec, list(workflow.rubric))
    s.flush()  # attempt calls are the run's, whenever it is scored
    if strategy_named(spec.strategy, uow.deps.strategies).grouped:
        await join_group(s, Candidate(msg, episode, attempts), spec)
    else:
        await grade_pairwise(s, Candidate(msg, episode, attempts))
        s.flush()


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the tournament stage.

    Raises:
        StrategyRefused: the default strategy does not fit the declared capacity.
        AssayError: the calibration file (`ASSAY_CALIBRATION_FILE`) cannot be read.
    """
    calibration = deps.calibration
    given = None
    if calibration.scheduled and calibration.file is not None:
        given = tuple(read_calibration_set(calibration.file))
    judging = Judging(
        judge=deps.judge,
        policy=deps.grading,
        calibration=calibration,
        calibration_set=given,
        strategies=deps.strategies,
    )
    check_fits(
        profile(
            GradingSpec(),
            judging.judge,
            order_check=judging.policy.order_check,
            strategies=judging.strategies,
        ),
        judging.policy,
    )
    background = [timer(Group.kind, group_due, lambda: clock_ms() / 1000)]
    if calibration.scheduled:
        tenants = frozenset(TenantId(p.passed.run.tenant) for p in given or ())
        background.append(calibration_timer(tenants, lambda: clock_ms() / 1000))
    return StageSpec(
        name="tournament",
        events=TOURNAMENT_EVENTS,
        fold=with_compaction(fold_tournament),
        handlers=routes(
            on_run_verified,
            on_group_due,
            on_rollout_closed,
            on_calibration_due,
            on_grading_cancelled,
            on_episode_reduced,
        ),
        deps=judging,
        background=tuple(background),
        gauges=functools.partial(_gauges, policy=calibration),
    )


async def _gauges(log: EventLog, policy: CalibrationPolicy) -> list[Gauge]:
    """The grading backlog and the judge's calibrated health."""
    return [*await backlog_gauges(log), *await calibration_gauges(log, policy)]


def _workflow(episode: Episode, judging: Judging) -> WorkflowDef:
    """The episode's workflow, its grading checked against the declared capacity."""
    try:
        workflow = WorkflowDef.model_validate(episode.definition)
    except ValidationError as exc:
        raise Refused(f"the episode's workflow definition does not validate: {exc}") from exc
    rubric = list(workflow.rubric)
    policy = judging.policy
    try:
        needs = profile(
            workflow.grading,
            judging.judge,
            rubric,
            order_check=policy.order_check,
            strategies=judging.strategies,
        )
        check_fits(needs, policy)
    except StrategyRefused as exc:
        raise Refused(str(exc)) from exc
    return workflow


async def _screened_out(
    s: Scoring, msg: RunVerified, episode: Episode, workflow: WorkflowDef
) -> Score | None:
    """The score of an episode the `Core` screen keeps out of grading (§11.7: capped, out
    of the bracket, not the reference), or of one that could not be screened; None when
    it goes on to be graded."""
    r, rubric = msg.run, list(workflow.rubric)
    strategy = strategy_named(workflow.grading.strategy, s.uow.deps.strategies)
    screened = strategy.judged and (r.role is Role.CHALLENGER or strategy.grouped)
    if not screened or not any(item.layer == "core" for item in rubric):
        return None
    if s.meter.exhausted(r.tenant):
        return Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)
    try:
        violations = await s.judge.screen(
            episode, rubric, on_usage=s.meter.sink(r.run_id, JudgePurpose.SCREEN)
        )
    except GradingCeilingReached:
        return Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)
    except JudgeFailed as exc:
        s.meter.failed(r.run_id, JudgePurpose.SCREEN, str(exc))
        return Ungraded(reason=UngradedReason.JUDGE_FAILED)
    return Capped(violations=violations) if violations else None
