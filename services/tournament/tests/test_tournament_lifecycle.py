"""The tournament stage and the run lifecycle: a cancel stops grading (no judge call, a
`cancelled` result, never a grade), and a task's result follows its live branch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.grading.strategies import GradingPolicy
from assay.kernel import RunState
from assay.kernel.scores import Verdict
from assay.messages import GradingCancelled, Purpose, RunBranch, RunRef, Usage
from services.tournament.tests.tournament_harness import (
    T1,
    T2,
    Graded,
    Stage,
    challenger,
    current,
    deliver,
    open_stage,
    pinned,
    task_id,
)

WORK = Purpose.WORK


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as opened:
        yield opened


async def cancel(stage: Stage, run: RunRef, *, verified: bool = True) -> Graded:
    msg = GradingCancelled(
        run=run, reason="stop", succeeded=True, usage=Usage(model_calls=1), verified=verified
    )
    return await stage.deliver(msg, mid=f"cancel-{run.graded_as}")


def forked(run: RunRef, branch: int, parent: int = 0) -> RunRef:
    return run.model_copy(update={"branch": RunBranch(branch=branch, parent=parent)})


def assert_cancelled(out: Graded, run: RunRef) -> None:
    (result,) = [r for r in out.results() if r.run_id == run.run_id]
    assert (result.status, result.score, result.termination) == ("cancelled", None, "succeeded")
    assert (result.passed, result.branch) == (False, run.branch_id)
    assert [s.state for s in out.statuses() if s.run == run] == [RunState.CANCELLED]
    assert [g for g in out.graded() if g.run == run] == []  # never a grade


async def test_a_challenger_cancelled_while_it_waits_gets_no_judge_call(stage: Stage) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, purpose=WORK, reference_expected=True)
    await stage.verified(chal)  # parked: rests in Grading, waiting for its reference
    assert_cancelled(await cancel(stage, chal), chal)
    assert await stage.log.scan(chal.tenant, "parked") == []
    stage.judge.verdicts = [Verdict.A]
    late = await stage.verified(cur)  # the reference arrives: nothing is left to compare
    assert stage.judge.compared == []
    assert [r.run_id for r in late.results()] == [cur.run_id]
    again = await stage.verified(chal, mid="redelivered")  # its verdict again: still nothing
    assert (again.results(), again.graded(), stage.judge.compared) == ([], [], [])


async def test_a_branch_cancelled_before_its_verdict_arrives_is_never_judged(
    stage: Stage,
) -> None:
    t = task_id(2)
    cur, chal = current(t), challenger(t, purpose=WORK)
    await stage.verified(cur)
    assert_cancelled(await cancel(stage, chal, verified=False), chal)
    out = await stage.verified(chal)  # verify had verified it before the cancel reached it
    assert (out.results(), out.graded(), stage.judge.compared, stage.judge.screened) == (
        [],
        [],
        [],
        [],
    )


async def test_a_cancelled_group_member_leaves_the_bracket(stage: Stage) -> None:
    t = task_id(3)
    runs = [pinned(current(t), T1)] + [
        pinned(challenger(t, f"c{i}", purpose=WORK), T2) for i in range(3)
    ]
    gone = runs[1]
    for run in runs[:2]:
        await deliver(stage, run, T1 if run.role.value == "current" else T2, "5")
    assert_cancelled(await cancel(stage, gone), gone)
    for run in runs[2:]:
        out = await deliver(stage, run, T2, "55")
    assert stage.judge.compared  # the others were judged, among themselves
    assert all(gone.run_id not in pair for pair in stage.judge.compared)
    assert gone.run_id not in {g.run.run_id for g in out.graded()}


async def test_a_cancel_after_grading_ended_changes_nothing(stage: Stage) -> None:
    t = task_id(4)
    cur = current(t)
    await stage.verified(cur)
    out = await cancel(stage, cur)
    assert (out.results(), out.statuses(), out.graded()) == ([], [], [])


async def test_the_result_follows_the_live_branch(stage: Stage) -> None:
    t = task_id(5)
    run = current(t)
    first = await stage.verified(run)
    assert [(r.branch, r.superseded_by) for r in first.results()] == [(0, None)]
    rewound = forked(run, 1)
    second = await stage.verified(rewound, mid="branch-1")
    # branch 0's result goes out again, replaced, before branch 1's, the task's result now
    assert [(r.branch, r.superseded_by) for r in second.results()] == [(0, 1), (1, None)]
    assert second.results()[0].model_copy(update={"superseded_by": None}) == first.results()[0]
    (grade,) = second.graded()
    assert grade.run.branch == RunBranch(branch=1, parent=0)
    assert second.results()[1].parent_branch == 0
    # a lower branch graded late is superseded from the start
    third = await stage.verified(forked(run, 3, parent=1), mid="branch-3")
    late = await stage.verified(forked(run, 2, parent=1), mid="branch-2")
    assert [(r.branch, r.superseded_by) for r in third.results()] == [(1, 3), (3, None)]
    assert [(r.branch, r.superseded_by) for r in late.results()] == [(2, 3)]
    # a cancelled fork's result is issued the same way
    gone = await cancel(stage, forked(run, 4, parent=1))
    assert [(r.branch, r.superseded_by, r.status) for r in gone.results()] == [
        (3, 4, "graded" if first.results()[0].status == "graded" else "ungraded"),
        (4, None, "cancelled"),
    ]
