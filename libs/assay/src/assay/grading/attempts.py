"""Attempt tournaments (§11.5): per-step credit from the retries already on disk.

The attempts of one step are a group on identical context the moment a retry
happens, at no agent cost. Two things come out of them:

- **Rankings** of same-outcome attempts — "which failure got further" is a
  question no verifier answers, so the judge answers it, in a tournament whose
  anchor is the step's earliest attempt in the group. An attempt the judge
  answered no comparison about gets no rank: it is listed as unranked with the
  reason (`judge_failed`), never given a strength from the prior alone.
- **Credit** for each fail-then-pass retry. That pair is never shown to a judge
  (§11.8: a pass beats a fail by definition); what differed between the two
  attempts is attributed to the step structurally.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from assay.grading.judges import Judge, UsageCallback
from assay.grading.tournament import Entrant, run_tournament
from assay.kernel.attempts import AttemptState
from assay.kernel.scores import AttemptRank, Ranked, StepCredit, UngradedReason, UnrankedAttempts
from assay.messages.episode import AttemptView, Episode
from assay.workflow.ir import RubricItem

_RANKED = {
    AttemptState.SUCCEEDED: True,
    AttemptState.FAILED: False,
    AttemptState.TIMED_OUT: False,
}
"""Outcome class of an attempt; cancelled and indeterminate attempts are neither."""


@dataclass(frozen=True)
class AttemptGrades:
    """What the attempts of one episode yielded, and the comparisons it took.

    `asked` counts the comparisons put to the judge and `answered` those it answered;
    `failures` holds why each of the others failed.
    """

    ranks: tuple[AttemptRank, ...]
    credit: tuple[StepCredit, ...]
    asked: int
    answered: int
    failures: tuple[str, ...]
    unranked: tuple[UnrankedAttempts, ...] = ()


def _by_step(episode: Episode) -> dict[tuple[str, int], list[AttemptView]]:
    groups: dict[tuple[str, int], list[AttemptView]] = defaultdict(list)
    for view in episode.attempts:
        groups[(str(view.step), view.iteration)].append(view)
    for views in groups.values():
        views.sort(key=lambda v: int(v.attempt))
    return groups


def _changes(failed: AttemptView, passed: AttemptView) -> list[str]:
    changed = []
    if failed.prompt != passed.prompt:
        before, after = len(failed.prompt or ""), len(passed.prompt or "")
        changed.append(f"prompt ({before} -> {after} characters)")
    return changed


def step_credit(episode: Episode) -> list[StepCredit]:
    """Each failed attempt paired with the retry of its step that succeeded after it."""
    credit = []
    for (step, iteration), views in sorted(_by_step(episode).items()):
        passed = next((v for v in views if v.state is AttemptState.SUCCEEDED), None)
        if passed is None:
            continue
        for failed in views:
            if _RANKED.get(failed.state) is False and failed.attempt < passed.attempt:
                credit.append(
                    StepCredit(
                        step=step,
                        iteration=iteration,
                        failed_attempt=int(failed.attempt),
                        passed_attempt=int(passed.attempt),
                        failure=failed.error or failed.state.value,
                        changed=_changes(failed, passed),
                    )
                )
    return credit


def attempt_view(episode: Episode, view: AttemptView) -> Episode:
    """The episode as a judge should see one attempt: that attempt alone, its output."""
    return episode.model_copy(
        update={
            "attempts": [view],
            "outputs": {str(view.step): view.output} if view.output is not None else {},
            "output": view.output,
            "succeeded": view.state is AttemptState.SUCCEEDED,
            "failed_step": None if view.state is AttemptState.SUCCEEDED else view.step,
            "usage": view.usage,
        }
    )


def ranking_groups(episode: Episode) -> Iterable[tuple[str, int, bool, list[AttemptView]]]:
    """Same-outcome attempt groups of two or more, per step and iteration."""
    for (step, iteration), views in sorted(_by_step(episode).items()):
        for succeeded in (True, False):
            group = [v for v in views if _RANKED.get(v.state) is succeeded]
            if len(group) >= 2:
                yield step, iteration, succeeded, group


async def grade_attempts(
    episode: Episode,
    judge: Judge,
    rubric: list[RubricItem],
    *,
    prior_precision: float,
    on_usage: UsageCallback | None = None,
) -> AttemptGrades:
    """Rank same-outcome attempts of every step and credit fail-then-pass retries."""
    ranks: list[AttemptRank] = []
    unranked: list[UnrankedAttempts] = []
    failures: list[str] = []
    asked = answered = 0
    for step, iteration, succeeded, group in ranking_groups(episode):
        entrants = [
            Entrant(name=str(v.attempt), episode=attempt_view(episode, v), control=i == 0)
            for i, v in enumerate(group)
        ]
        outcome = await run_tournament(
            entrants,
            judge,
            rubric,
            seed=f"{episode.run.run_id}/{step}/{iteration}/{succeeded}",
            prior_precision=prior_precision,
            on_usage=None if on_usage is None else (lambda _shown, usage: on_usage(usage)),
        )
        asked += outcome.asked
        answered += outcome.answered
        failures.extend(f.reason for f in outcome.failures)
        left = []
        for v in group:
            score = outcome.scores[str(v.attempt)]
            if isinstance(score, Ranked):
                ranks.append(
                    AttemptRank(
                        step=step,
                        iteration=iteration,
                        attempt=int(v.attempt),
                        succeeded=succeeded,
                        rank=score,
                    )
                )
            else:
                left.append(int(v.attempt))
        if left:
            unranked.append(
                UnrankedAttempts(
                    step=step,
                    iteration=iteration,
                    succeeded=succeeded,
                    attempts=left,
                    reason=UngradedReason.JUDGE_FAILED,
                )
            )
    return AttemptGrades(
        ranks=tuple(ranks),
        credit=tuple(step_credit(episode)),
        asked=asked,
        answered=answered,
        failures=tuple(failures),
        unranked=tuple(unranked),
    )
