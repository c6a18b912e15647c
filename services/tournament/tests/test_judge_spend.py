"""Judge spend has one source of truth: what a run's `RunGraded` says it spent, the
`UsageRecorded` messages and the grading meter agree, by purpose, with failed calls
counted as failed; and nothing is ranked that no answered comparison supports."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest

from assay.bus import USAGE
from assay.cli.health import merged
from assay.grading.judges import JudgeFailed
from assay.grading.strategies import GradingPolicy
from assay.kernel import AttemptState
from assay.kernel.scores import Ranked, Ungraded, UngradedReason, UnrankedAttempts
from assay.messages import JudgePurpose, RunGraded, UsageRecorded, open_envelope
from services.tournament.tests.tournament_harness import (
    T1,
    T2,
    TENANT,
    Graded,
    Stage,
    challenger,
    closed,
    current,
    deliver,
    graded_workflow,
    open_stage,
    pinned,
    sibling,
    task_id,
    view,
)

STOPPED = JudgeFailed("the model call failed (ModelUnavailable: ConnectError)")
MALFORMED = JudgeFailed("not one JSON object", "A, I think")

PAIRWISE = graded_workflow("What is {{ task.question }}?", {"strategy": "pairwise_sequential"})
TWO_FAILED_ATTEMPTS = [
    view(1, AttemptState.FAILED, None, "p"),
    view(2, AttemptState.FAILED, None, "p"),
    view(3, AttemptState.SUCCEEDED, "5", "p, carefully"),
]


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as opened:
        yield opened


async def meter_of(stage: Stage) -> dict[str, Any]:
    return merged([doc for _, doc in await stage.log.scan(TENANT, "meter", "grading")])


def agree(stage_meter: dict[str, Any], outs: Iterable[Graded]) -> None:
    """RunGraded, UsageRecorded and the meter report the same calls, by purpose."""
    graded: list[RunGraded] = [g for out in outs for g in out.graded()]
    usage: list[UsageRecorded] = [u for out in outs for u in out.usage()]
    answered: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for g in graded:
        answered.update({p.value: n for p, n in g.judge_calls_by_purpose.items()})
        failed.update({p.value: n for p, n in g.judge_failures_by_purpose.items()})
        assert g.judge_calls == sum(g.judge_calls_by_purpose.values())
        assert g.judge_failures == sum(g.judge_failures_by_purpose.values())
    used = Counter(u.judge_purpose.value for u in usage if u.judge_purpose and not u.failed)
    assert dict(answered) == dict(used) == stage_meter["by_purpose"]
    assert sum(answered.values()) == stage_meter["calls_total"]
    assert dict(failed) == stage_meter["failures_by_purpose"]
    assert sum(failed.values()) == stage_meter["judge_failures"]
    assert sum(u.failed for u in usage) == stage_meter["failures_billed"]


async def test_attempts_no_judge_answered_have_no_rank_and_count_as_failed(stage: Stage) -> None:
    """The gateway stopped: the attempt tournament asked twice, nothing answered."""
    stage.judge.fail_with, stage.judge.billed = STOPPED, False
    run = current(task_id(40)).model_copy(update={"workflow_version": PAIRWISE.version})
    out = await deliver(stage, run, PAIRWISE, "5", attempts=TWO_FAILED_ATTEMPTS)
    (graded,) = out.graded()
    assert graded.attempt_ranks == []
    assert graded.unranked_attempts == [
        UnrankedAttempts(
            step="solve",
            iteration=0,
            succeeded=False,
            attempts=[1, 2],
            reason=UngradedReason.JUDGE_FAILED,
        )
    ]
    assert (graded.judge_calls, graded.judge_failures) == (0, 2)
    assert graded.judge_failures_by_purpose == {JudgePurpose.ATTEMPTS: 2}
    assert out.usage() == []  # nothing answered, nothing billed
    meter = await meter_of(stage)
    assert (meter["calls_total"], meter["calls_today"], meter["judge_failures"]) == (0, 0, 2)
    agree(meter, [out])
    assert [c.failed_attempt for c in graded.step_credit] == [1, 2]  # credit needs no judge


async def test_a_billed_failure_is_usage_marked_failed_never_an_answer(stage: Stage) -> None:
    stage.judge.fail_with = MALFORMED
    run = current(task_id(41)).model_copy(update={"workflow_version": PAIRWISE.version})
    out = await deliver(stage, run, PAIRWISE, "5", attempts=TWO_FAILED_ATTEMPTS)
    (graded,) = out.graded()
    assert (graded.judge_calls, graded.judge_failures, graded.attempt_ranks) == (0, 2, [])
    usage = out.usage()
    assert [(u.judge_purpose, u.failed) for u in usage] == [(JudgePurpose.ATTEMPTS, True)] * 2
    meter = await meter_of(stage)
    # billed, so the ceiling counts them; answered, never
    assert (meter["calls_today"], meter["calls_total"], meter["failures_billed"]) == (2, 0, 2)
    agree(meter, [out])


async def test_a_group_the_judge_answered_nothing_about_is_ungraded_judge_failed(
    stage: Stage,
) -> None:
    t = task_id(42)
    runs = [pinned(current(t), T1)] + [pinned(challenger(t, f"c{i}"), T2) for i in range(3)]
    stage.judge.fail_with, stage.judge.billed = STOPPED, False
    outs = [
        await deliver(stage, run, T1 if i == 0 else T2, "x" * (i + 1)) for i, run in enumerate(runs)
    ]
    graded = outs[-1].graded()
    assert {g.run.run_id for g in graded} == {r.run_id for r in runs}
    assert {g.score.kind for g in graded} == {"ungraded"}
    assert all(g.score == Ungraded(reason=UngradedReason.JUDGE_FAILED) for g in graded)
    assert sum(g.judge_failures for g in graded) == len(stage.judge.compared) == 8
    assert all(g.judge_calls == 0 for g in graded)
    meter = await meter_of(stage)
    assert meter["scores"] == {"ungraded:judge_failed": 4}
    agree(meter, outs)


async def test_every_run_reports_what_it_spent_while_it_waited_for_its_group(
    stage: Stage,
) -> None:
    """Screens, attempt tournaments and the group's comparisons all reach the run's
    RunGraded, the usage topic and the meter — the member whose join fills the group
    included (its handler's meter is the one the closing tournament adds to)."""
    t = task_id(43)
    runs = [pinned(current(t), T1)] + [pinned(challenger(t, f"c{i}"), T2) for i in range(3)]
    stage.judge.prefer_longer, stage.judge.screen_usage = True, True
    outs = [
        await deliver(
            stage,
            run,
            T1 if i == 0 else T2,
            "x" * (i + 1),
            attempts=TWO_FAILED_ATTEMPTS if i in (1, 3) else None,
        )
        for i, run in enumerate(runs)
    ]
    graded = {g.run.run_id: g for g in outs[-1].graded()}
    assert set(graded) == {r.run_id for r in runs}
    for i, run in enumerate(runs):
        mine = graded[run.run_id].judge_calls_by_purpose
        assert mine[JudgePurpose.SCREEN] == 1
        assert mine.get(JudgePurpose.ATTEMPTS, 0) == (2 if i in (1, 3) else 0)
        assert mine[JudgePurpose.TOURNAMENT] >= 1
        score = graded[run.run_id].score
        assert isinstance(score, Ranked)
        assert score.comparisons == 4
        assert score.comparisons_failed == 0
    meter = await meter_of(stage)
    assert meter["by_purpose"] == {"screen": 4, "attempts": 4, "tournament": 8}
    agree(meter, outs)


async def test_a_rollout_the_judge_answered_nothing_about_is_decided_by_index(
    stage: Stage,
) -> None:
    t = task_id(44)
    runs = [sibling(t, i) for i in range(4)]
    outs = [await stage.verified(run, output="x" * (i + 1)) for i, run in enumerate(runs)]
    stage.judge.fail_with = MALFORMED
    outs.append(await stage.deliver(closed(t, runs)))
    (result,) = outs[-1].rollout_results()
    assert result.selection.decided_by == "index"
    assert "the judge answered none of 8 comparisons" in result.selection.evidence
    assert (result.selection.judge_calls, result.selection.judge_failures) == (0, 8)
    assert result.winner == runs[0].run_id
    assert all(s.rank is None for s in result.siblings)
    graded = outs[-1].graded()
    assert all(g.score == Ungraded(reason=UngradedReason.JUDGE_FAILED) for g in graded)
    agree(await meter_of(stage), outs)


async def test_two_calls_that_cost_the_same_are_two_usage_messages(tmp_path: Path) -> None:
    """A consumer deduplicates by message id: equal usage must not share one."""
    async with open_stage(tmp_path, GradingPolicy(order_check=1.0)) as stage:
        t = task_id(45)
        await stage.verified(current(t))
        out = await stage.verified(challenger(t))  # compared, then order-checked
        usage = [e for e in out.entries if e.topic == USAGE]
        assert len(usage) == 2
        first, second = (open_envelope(e.value) for e in usage)
        assert first.payload == second.payload  # the same model, tokens and cost
        assert first.id != second.id
        agree(await meter_of(stage), [out])
