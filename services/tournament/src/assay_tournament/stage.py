"""Tournament: `assay.verified` -> `assay.graded`, `assay.results` (§11).

Keyed by `(tenant, task)`, so every episode of a task lands here on one
partition. Each episode is graded by the strategy its pinned workflow declares:

- `pairwise_sequential` (default, §11.3): the first episode of each version on a
  task is that version's reference on it; a challenger episode is compared with
  the current version's reference — pass-vs-fail by the verifier, otherwise by
  the judge with the challenger's position alternating, and on a sampled
  fraction asked again with the positions swapped to measure order consistency.
  A challenger whose paired reference run is still on its way waits.
- `deterministic`: like pairwise, but the comparison is a number the episode
  holds, with no judge.
- `tournament` (§11.4-§11.6): see `groups.py`.

Every episode is screened for `Core` violations first (a capped episode leaves
the bracket), and attempt tournaments run on its retries (§11.5). Judge calls
are metered per tenant and purpose; a tenant at its daily ceiling is
`Ungraded{BudgetExhausted}`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from assay.bus.topics import VERIFIED
from assay.grading import compare_with_reference
from assay.grading.attempts import AttemptGrades
from assay.grading.deterministic import deterministic_rank, metric_value
from assay.grading.judges import JudgeFailed
from assay.grading.strategies import StrategyRefused, check_fits, profile
from assay.kernel import RunId, WorkflowVersion
from assay.kernel.canonical import digest
from assay.kernel.errors import Refused
from assay.kernel.scores import Capped, Score, Ungraded, UngradedReason
from assay.messages import Episode, GroupDue, JudgePurpose, Role, RolloutClosed, RunVerified
from assay.record import BranchKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.runtime.timers import timer
from assay.workflow import GradingSpec, RubricItem, WorkflowDef
from assay_tournament.events import (
    TOURNAMENT_EVENTS,
    ChallengerParked,
    GroupClosed,
    GroupJoined,
    ReferenceSet,
    RunScored,
    fold_tournament,
)
from assay_tournament.grading import Grading, JudgeSpend, Meter, load_episode
from assay_tournament.groups import Groups, clock_ms
from assay_tournament.rollouts import RolloutSelection

__all__ = [
    "TOURNAMENT_EVENTS",
    "ChallengerParked",
    "GroupClosed",
    "GroupJoined",
    "ReferenceSet",
    "RunScored",
    "create_stage",
    "fold_tournament",
]


def _sampled(run_id: RunId, fraction: float) -> bool:
    """Whether this run's comparison is order-checked: a stable draw from its id."""
    return int(digest(f"order-check/{run_id}".encode())[:8], 16) / 16**8 < fraction


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the tournament stage.

    Raises:
        StrategyRefused: the default strategy does not fit the declared capacity.
    """
    judge = deps.judge
    policy = deps.grading
    check_fits(profile(GradingSpec(), judge, order_check=policy.order_check), policy)
    grading = Grading(deps)
    groups = Groups(grading)
    rollouts = RolloutSelection(grading)

    async def next_index(uow: UnitOfWork[Any], version: WorkflowVersion) -> int:
        counter = await uow.get_document("comparisons", version)
        return int(counter["next"]) if counter else 0

    async def compare(
        uow: UnitOfWork[Any],
        msg: RunVerified,
        episode: Episode,
        reference: dict[str, Any],
        index: int,
        was_parked: bool,
        attempts: AttemptGrades | None,
        meter: Meter,
        carried: JudgeSpend | None = None,
    ) -> int:
        """Score one challenger episode against the reference; return the next index."""
        r = msg.run
        spec = WorkflowDef.model_validate(episode.definition).grading
        ref_episode = await load_episode(uow, reference["episode"])
        if ref_episode is None:
            grading.finish(
                uow,
                msg,
                episode,
                Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE),
                was_parked=was_parked,
                attempts=attempts,
                carried=carried,
                meter=meter,
            )
            return index
        if spec.strategy == "deterministic":
            assert spec.metric is not None
            mine, theirs = (
                metric_value(episode, spec.metric),
                metric_value(ref_episode, spec.metric),
            )
            score: Score = (
                Ungraded(reason=UngradedReason.NO_METRIC)
                if mine is None or theirs is None
                else deterministic_rank(
                    mine, theirs, higher_is_better=spec.higher_is_better is not False
                )
            )
            grading.finish(
                uow,
                msg,
                episode,
                score,
                was_parked=was_parked,
                attempts=attempts,
                carried=carried,
                meter=meter,
            )
            return index
        if meter.exhausted(r.tenant):
            grading.finish(
                uow,
                msg,
                episode,
                Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED),
                was_parked=was_parked,
                attempts=attempts,
                carried=carried,
                meter=meter,
            )
            return index
        rubric = list(WorkflowDef.model_validate(episode.definition).rubric)
        try:
            relative, _ = await compare_with_reference(
                challenger=episode,
                challenger_passed=msg.passed,
                reference=ref_episode,
                reference_passed=reference["passed"],
                reference_run=RunId(reference["run_id"]),
                order_index=index,
                judge=judge,
                rubric=rubric,
                on_usage=meter.sink(r.run_id, JudgePurpose.COMPARE),
                order_check=_sampled(r.run_id, policy.order_check),
            )
        except JudgeFailed as exc:
            meter.failed(r.run_id, JudgePurpose.COMPARE, str(exc))
            grading.finish(
                uow,
                msg,
                episode,
                Ungraded(reason=UngradedReason.JUDGE_FAILED),
                was_parked=was_parked,
                attempts=attempts,
                carried=carried,
                meter=meter,
            )
            return index
        if relative.order_consistent is not None:
            meter.order_checked(consistent=relative.order_consistent)
        grading.finish(
            uow,
            msg,
            episode,
            relative,
            order_index=index,
            was_parked=was_parked,
            attempts=attempts,
            carried=carried,
            meter=meter,
        )
        return index + 1

    async def release_parked(uow: UnitOfWork[Any], msg: RunVerified, meter: Meter) -> None:
        """Grade the challengers parked on this task that waited for this current run."""
        r = msg.run
        index: int | None = None
        for _, parked in await uow.scan_documents("parked", f"{r.task_id}/"):
            kept = Grading.waiting_from(parked)
            waiting, attempts = kept.verified, kept.attempts
            if waiting.run.baseline_version != r.workflow_version:
                continue
            waiting_episode = await load_episode(uow, waiting.episode)
            fresh: dict[str, Any] = {
                "run_id": r.run_id,
                "episode": msg.episode,
                "passed": msg.passed,
            }
            if waiting_episode is None:
                grading.finish(
                    uow,
                    waiting,
                    None,
                    Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE),
                    was_parked=True,
                    attempts=attempts,
                    carried=kept.spent,
                    meter=meter,
                )
                continue
            if index is None:
                index = await next_index(uow, waiting.run.workflow_version)
            index = await compare(
                uow,
                waiting,
                waiting_episode,
                fresh,
                index,
                was_parked=True,
                attempts=attempts,
                meter=meter,
                carried=kept.spent,
            )

    async def pairwise(
        uow: UnitOfWork[Any],
        msg: RunVerified,
        episode: Episode,
        attempts: AttemptGrades | None,
        meter: Meter,
    ) -> None:
        """Pairwise-sequential and deterministic grading against the current reference."""
        r = msg.run
        task_stream = BranchKey.main(uow.tenant, f"task:{r.task_id}")
        own_ref = await uow.get_document("reference", f"{r.task_id}/{r.workflow_version}")
        if own_ref is None:
            uow.record(
                task_stream,
                ReferenceSet(
                    task_id=r.task_id,
                    workflow_version=r.workflow_version,
                    run_id=r.run_id,
                    episode=msg.episode,
                    passed=msg.passed,
                ),
            )
        if r.role is Role.CURRENT:
            reason = UngradedReason.NO_REFERENCE if own_ref is None else UngradedReason.BASELINE
            grading.finish(
                uow, msg, episode, Ungraded(reason=reason), attempts=attempts, meter=meter
            )
            await release_parked(uow, msg, meter)
            return
        baseline = r.baseline_version
        reference = (
            await uow.get_document("reference", f"{r.task_id}/{baseline}")
            if baseline is not None
            else None
        )
        if reference is not None:
            index = await next_index(uow, r.workflow_version)
            await compare(
                uow,
                msg,
                episode,
                reference,
                index,
                was_parked=False,
                attempts=attempts,
                meter=meter,
            )
        elif r.reference_expected:
            uow.record(
                task_stream,
                ChallengerParked(verified=Grading.waiting_doc(msg, attempts, meter.take(r.run_id))),
            )
            grading.waiting(uow, msg, "waiting for the reference run")
        else:
            grading.finish(
                uow,
                msg,
                episode,
                Ungraded(reason=UngradedReason.NO_REFERENCE),
                attempts=attempts,
                meter=meter,
            )

    async def on_verified(msg: RunVerified, uow: UnitOfWork[Any]) -> None:
        r = msg.run
        if await uow.get_document("scored", r.run_id) is not None:
            return
        if r.rollout is not None:  # a sibling waits for its group's selection (§13)
            await rollouts.on_sibling(msg, uow)
            return
        episode = await load_episode(uow, msg.episode)
        meter = await grading.meter(uow)
        if episode is None:
            grading.finish(
                uow, msg, None, Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE), meter=meter
            )
            if r.role is Role.CURRENT:  # they waited for this run; do not strand them
                await release_parked(uow, msg, meter)
            return
        try:
            workflow = WorkflowDef.model_validate(episode.definition)
        except ValidationError as exc:
            raise Refused(f"the episode's workflow definition does not validate: {exc}") from exc
        spec = workflow.grading
        rubric: list[RubricItem] = list(workflow.rubric)
        try:
            check_fits(profile(spec, judge, rubric, order_check=policy.order_check), policy)
        except StrategyRefused as exc:
            raise Refused(str(exc)) from exc
        screened = spec.strategy != "deterministic" and (
            r.role is Role.CHALLENGER or spec.strategy == "tournament"
        )
        if screened and any(item.layer == "core" for item in rubric):
            if meter.exhausted(r.tenant):
                grading.finish(
                    uow, msg, episode, Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED), meter=meter
                )
                return
            try:
                violations = await judge.screen(
                    episode, rubric, on_usage=meter.sink(r.run_id, JudgePurpose.SCREEN)
                )
            except JudgeFailed as exc:
                meter.failed(r.run_id, JudgePurpose.SCREEN, str(exc))
                grading.finish(
                    uow, msg, episode, Ungraded(reason=UngradedReason.JUDGE_FAILED), meter=meter
                )
                return
            if violations:  # §11.7: capped, out of the bracket, not the reference
                grading.finish(uow, msg, episode, Capped(violations=violations), meter=meter)
                return
        attempts = await grading.rank_attempts(episode, spec, rubric, meter)
        grading.flush(uow, meter)  # attempt calls are the run's, whenever it is scored
        if spec.strategy == "tournament":
            await groups.join(uow, msg, episode, spec, attempts, meter)
        else:
            await pairwise(uow, msg, episode, attempts, meter)
            grading.flush(uow, meter)

    return StageSpec(
        name="tournament",
        events=TOURNAMENT_EVENTS,
        fold=fold_tournament,
        handlers={
            VERIFIED: {
                RunVerified.type: on_verified,
                GroupDue.type: groups.on_due,
                RolloutClosed.type: rollouts.on_closed,
            },
        },
        background=(timer("group", Groups.due, lambda: clock_ms() / 1000),),
    )
