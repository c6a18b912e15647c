"""Ranking a candidate matrix (§11.1 `ReplayTournament`) in the tournament stage: one
Bradley-Terry-Davidson fit, the control pinned to zero, a verified pass beating a fail
without a judge, each outcome class judged by Swiss pairing in both orderings."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.grading.bt import PairCount, Ties, fit
from assay.grading.strategies import GradingPolicy
from assay.kernel import TaskId
from assay.kernel.scores import Ranked, Ungraded
from assay.messages import Purpose, RolloutClosed, RolloutSpec, RunRef
from assay.messages.candidates import MatrixEstimate, PlannedCandidate
from assay_tournament.matrix import fit_candidates
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


def siblings_of(t: TaskId, samples: dict[str, int]) -> tuple[list[RunRef], RolloutClosed]:
    """A closed matrix whose candidates (the last the control, all running V1) run
    `samples` consecutive siblings each."""
    size = sum(samples.values())
    runs = [
        sibling(t, i, size=size).model_copy(update={"purpose": Purpose.REPLAY}) for i in range(size)
    ]
    plans, index = [], 0
    for name, k in samples.items():
        plans.append(
            PlannedCandidate(
                name=name,
                index=index,
                samples=k,
                kind="version",
                variant=f"version {V1.version}",
                workflow_version=V1.version,
                control=name == "current",
                max_model_calls=2,
            )
        )
        index += k
    spec = RolloutSpec.model_validate(
        {
            "candidates": [
                {"name": n, "version": "current", "samples": k} for n, k in samples.items()
            ],
            "control": "current",
            "mode": "evaluation",
        }
    )
    group = closed(t, runs).model_copy(
        update={
            "spec": spec,
            "candidates": plans,
            "estimate": MatrixEstimate(model_calls=2 * size, replay_calls=2 * size),
        }
    )
    return runs, group


async def test_a_candidates_siblings_pool_into_its_strength_against_the_control(
    stage: Stage,
) -> None:
    """`new`'s three siblings meet the control's one: two pass where the control failed
    (each bout won in both orderings, by the verifier), the third fails and loses both
    orderings to it before the judge — 4 comparisons won of 6 — and `new`'s strength is
    the one the fit gives for exactly that record."""
    t = task_id(42)
    runs, group = siblings_of(t, {"new": 3, "current": 1})
    outcomes = [(True, "x"), (True, "x"), (False, "x"), (False, "xxxx")]
    for run, (ok, output) in zip(runs, outcomes, strict=True):
        await stage.verified(run, passed=ok, output=output)
    stage.judge.prefer_longer = True
    out = await stage.deliver(group)
    (result,) = out.rollout_results()
    assert result.candidates is not None
    new, control = result.candidates
    expected = fit(
        [PairCount("new", "current", 4.0, 2.0)],
        anchor=["current"],
        prior_precision=V1.grading.precision,
        ties=Ties.DAVIDSON,
        players=["new", "current"],
    ).strengths["new"]
    assert new.strength is not None
    assert new.strength.strength == pytest.approx(expected.strength)
    assert new.strength.interval == pytest.approx(expected.interval)
    assert (new.strength.comparisons, new.strength.group_size) == (6, 2)
    assert (new.samples, new.runs, new.verified, new.passes) == (
        3,
        [r.run_id for r in runs[:3]],
        3,
        2,
    )
    assert new.pass_rate == pytest.approx(2 / 3)
    assert (new.rank, control.rank) == (1, 2)
    assert (control.samples, control.runs, control.pass_rate) == (1, [runs[3].run_id], 0.0)
    # the pass class holds one candidate's siblings: nothing to judge there
    assert {frozenset(pair) for pair in stage.judge.compared} == {
        frozenset((runs[2].run_id, runs[3].run_id))
    }
    assert result.winner == runs[0].run_id  # the lowest index of the best class
    assert result.selection.decided_by == "verifier"
    scores = {g.run.run_id: g.score for g in out.graded()}
    assert all(scores[r.run_id] == new.strength for r in runs[:3])  # each sibling: its candidate's


async def test_siblings_of_one_candidate_meet_only_when_the_round_cannot_avoid_it(
    stage: Stage,
) -> None:
    t = task_id(43)
    runs, group = siblings_of(t, {"a": 2, "b": 2, "current": 2})
    for run, output in zip(runs, ["xxx", "xxx", "xx", "xx", "x", "x"], strict=True):
        await stage.verified(run, passed=True, output=output)
    stage.judge.prefer_longer = True
    out = await stage.deliver(group)
    (result,) = out.rollout_results()
    owner = {r.run_id: i // 2 for i, r in enumerate(runs)}
    pairs = {frozenset(pair) for pair in stage.judge.compared}
    assert pairs
    assert all(len({owner[r] for r in pair}) == 2 for pair in pairs)
    assert result.candidates is not None
    ranked = {c.name: c.strength.strength for c in result.candidates if c.strength is not None}
    assert ranked["current"] == 0.0
    assert ranked["a"] > ranked["b"] > 0.0  # the longest answers, then the middle ones
    assert result.winner in {runs[0].run_id, runs[1].run_id}
    assert result.selection.decided_by == "judge"


def test_a_candidates_interval_narrows_as_its_siblings_add_up() -> None:
    """Pooled comparisons in the same proportion — a 2:1 record against the control — over
    one, three and nine siblings' bouts: the plain maximum-likelihood strength is ln 2 each
    time (2 wins to 1), and the interval narrows as the bouts add up."""
    widths = []
    for bouts in (3, 9, 27):
        wins = 2 * bouts // 3 * 2
        losses = bouts // 3 * 2
        strengths = fit_candidates(
            [PairCount("new", "current", wins, losses)],
            {"new": 2 * bouts, "current": 2 * bouts},
            {},
            control="current",
            prior_precision=0.0,
        )
        new = strengths["new"]
        assert new.strength == pytest.approx(math.log(2))
        assert strengths["current"].strength == 0.0
        low, high = new.interval
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2]
    assert widths[1] == pytest.approx(widths[0] / math.sqrt(3))  # the standard error goes as 1/√n
