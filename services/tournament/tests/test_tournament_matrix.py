"""Ranking a candidate matrix (§11.1 `ReplayTournament`) in the tournament stage: one
Bradley-Terry-Davidson fit, the control pinned to zero, a verified pass beating a fail
without a judge, each outcome class judged by Swiss pairing in both orderings."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.grading.strategies import GradingPolicy
from assay.kernel import TaskId
from assay.kernel.scores import Ranked, Ungraded
from assay.messages import Purpose, RolloutClosed, RolloutSpec, RunRef
from assay.messages.candidates import MatrixEstimate, PlannedCandidate
from services.tournament.tests.tournament_harness import (
    V1,
    V2,
    Stage,
    closed,
    open_stage,
    sibling,
    task_id,
)

NAMES = ["v2", "big", "careful", "current"]


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as opened:
        yield opened


def candidates(t: TaskId, control: int = 3) -> tuple[list[RunRef], RolloutClosed]:
    runs = [
        sibling(t, i, size=len(NAMES)).model_copy(update={"purpose": Purpose.REPLAY})
        for i in range(len(NAMES))
    ]
    plans = [
        PlannedCandidate(
            name=name,
            index=i,
            kind="version",
            variant=f"version {V2.version if i == 0 else V1.version}",
            workflow_version=V2.version if i == 0 else V1.version,
            control=i == control,
            implicit=name == "current",
            max_model_calls=2,
        )
        for i, name in enumerate(NAMES)
    ]
    spec = RolloutSpec.model_validate(
        {"candidates": [{"name": n, "model": f"m-{n}"} for n in NAMES[:-1]], "mode": "evaluation"}
    )
    group = closed(t, runs).model_copy(
        update={
            "spec": spec,
            "candidates": plans,
            "estimate": MatrixEstimate(model_calls=8, replay_calls=8),
        }
    )
    return runs, group


async def test_every_candidate_is_ranked_against_the_pinned_control(stage: Stage) -> None:
    t = task_id(40)
    runs, group = candidates(t)
    passed = [True, True, False, True]  # `careful` failed its verifier
    for run, ok, output in zip(runs, passed, ["xxxx", "xx", "xxxxxx", "x"], strict=True):
        await stage.verified(run, passed=ok, output=output)
    stage.judge.prefer_longer = True
    out = await stage.deliver(group)
    (result,) = out.rollout_results()
    assert result.control == "current"
    assert result.estimate == MatrixEstimate(model_calls=8, replay_calls=8)
    assert result.candidates is not None
    lines = {c.name: c for c in result.candidates}
    assert list(lines) == NAMES
    control = lines["current"].strength
    assert control is not None
    assert (control.strength, control.interval, control.anchored) == (0.0, (0.0, 0.0), True)
    strength = {n: c.strength.strength for n, c in lines.items() if c.strength is not None}
    assert set(strength) == set(NAMES)
    assert max(strength, key=strength.__getitem__) == "v2"  # it won every judged bout
    assert min(strength, key=strength.__getitem__) == "careful"  # it alone failed
    ranks = {n: lines[n].rank for n in NAMES}
    assert ranks["v2"] == 1
    for a in NAMES:  # the stronger ranks first; equal strengths share a rank
        for b in NAMES:
            if strength[a] > strength[b] + 1e-9:
                assert (ranks[a] or 0) < (ranks[b] or 0)
            if abs(strength[a] - strength[b]) < 1e-9:
                assert ranks[a] == ranks[b]
    assert [lines[n].pass_rate for n in NAMES] == [1.0, 1.0, 0.0, 1.0]
    for c in lines.values():
        assert c.runs == [runs[NAMES.index(c.name)].run_id]
        assert c.strength is not None
        low, high = c.strength.interval
        assert low <= c.strength.strength <= high
    assert result.winner == runs[0].run_id
    assert result.selection.decided_by == "judge"
    assert "against the control" in result.selection.evidence
    # the failed candidate was never shown to the judge: pass beats fail by definition
    shown = {run for pair in stage.judge.compared for run in pair}
    assert runs[2].run_id not in shown
    assert result.selection.judge_calls == len(stage.judge.compared)
    scores = {g.run.run_id: g.score for g in out.graded()}
    assert all(isinstance(scores[r.run_id], Ranked) for r in runs)


async def test_a_lone_verified_candidate_wins_and_the_rest_are_not_ranked(stage: Stage) -> None:
    t = task_id(41)
    runs, group = candidates(t, control=0)
    await stage.verified(runs[0], passed=True)
    group = group.model_copy(update={"cancelled": [r.run_id for r in runs[1:]]})
    out = await stage.deliver(group)
    (result,) = out.rollout_results()
    assert result.candidates is not None
    assert result.winner == runs[0].run_id
    assert result.selection.decided_by == "verifier"
    assert [c.strength for c in result.candidates] == [None] * 4  # nothing to compare
    assert [c.rank for c in result.candidates] == [None] * 4
    assert [c.verified for c in result.candidates] == [1, 0, 0, 0]
    assert [c.pass_rate for c in result.candidates] == [1.0, None, None, None]
    (graded,) = out.graded()
    assert isinstance(graded.score, Ungraded)
    assert stage.judge.compared == []
