"""The promotion ladder through the decide stage (§12.3): each rung's entry criteria,
automatic rollback, the latched sequential test and the drift check."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.grading.ladder import LadderPolicy
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    ChallengerRejected,
    Ladder,
    Promoted,
    Rung,
)
from services.decide.tests.decide_harness import (
    LADDER,
    TOURNAMENT,
    Stage,
    definition,
    evidence,
    ir,
    only_allocation,
    open_stage,
    strength,
)

WINS = WinRecord(judge_wins=6, verifier_wins=3)  # crosses the accept boundary (9 wins)
SOME = WinRecord(judge_wins=3, judge_losses=1)  # within the boundaries
CLEAN = LADDER.min_shadow_runs


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path) as s:
        await s.register(1)
        await s.register(2)
        yield s


async def standing(stage: Stage) -> dict[str, Any]:
    doc: dict[str, Any] | None = await stage.standing()
    assert doc is not None
    return doc


# -- default ladder: shadow -> trial -> current -----------------------------------------------


async def test_shadow_waits_for_enough_clean_episodes(stage: Stage) -> None:
    assert await stage.evidence(evidence(2, record=SOME, screened=CLEAN - 1)) == []
    assert (await stage.allocation())["rung"] == "shadow"


async def test_clean_shadow_episodes_move_the_challenger_to_trial(stage: Stage) -> None:
    alloc = only_allocation(await stage.evidence(evidence(2, record=SOME, screened=CLEAN)))
    assert (alloc.generation, alloc.rung, alloc.ladder) == (3, Rung.TRIAL, Ladder.DEFAULT)
    assert alloc.challenger_share == LADDER.trial_share
    assert alloc.challenger == ir(2).version
    assert set(alloc.definitions) == {ir(1).version, ir(2).version}
    doc = await standing(stage)
    assert (doc["rung"], doc["share"], doc["entered_served"]) == ("trial", 0.05, 0)


async def test_trial_promotes_once_the_test_accepts_and_trial_episodes_are_clean(
    stage: Stage,
) -> None:
    await stage.evidence(evidence(2, record=SOME, screened=CLEAN))  # -> trial
    # accepted, but too few trial episodes yet: the decision is latched, nothing moves
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs - 1))
    assert out == []
    accepted = await stage.state("accepted", ir(2).version)
    assert accepted is not None
    assert "accept boundary" in accepted["reason"]
    assert (await standing(stage))["accepted"] is True
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
    promoted, alloc = out
    assert (promoted.workflow_version, promoted.previous) == (ir(2).version, ir(1).version)
    assert (alloc.current, alloc.challenger, alloc.rung) == (ir(2).version, None, None)
    assert alloc.challenger_share == 0.0  # the swap takes all traffic at once
    assert alloc.definitions == {ir(2).version: definition(2)}
    decision = await stage.state("decision", ir(2).version)
    assert decision is not None
    assert (decision["outcome"], decision["rung"], decision["accepted"]) == (
        "promoted",
        "trial",
        True,
    )
    assert await stage.standing() is None


async def test_accepting_in_shadow_still_climbs_through_trial(stage: Stage) -> None:
    out = await stage.evidence(evidence(2, record=WINS, screened=CLEAN, served=0))
    alloc = only_allocation(out)
    assert alloc.rung is Rung.TRIAL  # not straight to current: trial episodes come first
    assert (await standing(stage))["accepted"] is True


async def test_the_accept_decision_is_latched(stage: Stage) -> None:
    """Wald's test stops at its first crossing; later records under the boundary (but
    above the reject one) do not take the acceptance back."""
    await stage.evidence(evidence(2, record=WINS, screened=CLEAN))  # accepted, -> trial
    later = WinRecord(judge_wins=9, judge_losses=3)  # llr back under the accept boundary
    out = await stage.evidence(evidence(2, record=later, served=LADDER.min_trial_runs))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_trial_episodes_count_from_the_rung_entry(stage: Stage) -> None:
    await stage.evidence(evidence(2, record=SOME, screened=CLEAN, served=2))  # -> trial at 2
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs + 1))
    assert out == []  # 4 trial episodes since entry, not 6
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs + 2))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_an_inconsistent_judge_holds_the_swap_until_the_drift_check_is_clean(
    stage: Stage,
) -> None:
    await stage.evidence(evidence(2, record=SOME, screened=CLEAN))  # -> trial
    served = LADDER.min_trial_runs
    drifting = evidence(2, record=WINS, served=served, order_checked=6, order_inconsistent=3)
    assert await stage.evidence(drifting) == []
    doc = await standing(stage)
    assert "contradicted itself on 3/6" in doc["held"]
    assert (await stage.allocation())["rung"] == "trial"
    steady = evidence(2, record=WINS, served=served + 1, order_checked=12, order_inconsistent=3)
    out = await stage.evidence(steady)
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


# -- rollback -------------------------------------------------------------------------


@pytest.mark.parametrize("rung", ["shadow", "trial"])
async def test_one_capped_episode_rolls_the_challenger_back(stage: Stage, rung: str) -> None:
    if rung == "trial":
        await stage.evidence(evidence(2, record=WINS, screened=CLEAN))
    capped = WinRecord(judge_wins=9, capped=1)  # however strong its other evidence
    out = await stage.evidence(evidence(2, record=capped, served=3))
    assert [type(m).__name__ for m in out] == ["RolledBack", "AllocationChanged"]
    rolled, alloc = out
    assert (rolled.workflow_version, rolled.current) == (ir(2).version, ir(1).version)
    assert (rolled.trigger, rolled.rung) == ("capped", Rung(rung))
    assert "1 Core violation" in rolled.reason
    assert (alloc.current, alloc.challenger, alloc.challenger_share) == (ir(1).version, None, 0.0)
    decision = await stage.state("decision", ir(2).version)
    assert decision is not None
    assert (decision["outcome"], decision["trigger"]) == ("rolled_back", "capped")
    # a traffic change, never a delete: the version stays known, and is not revived
    assert await stage.state("known", ir(2).version) is not None
    assert await stage.register(2) == []
    assert only_allocation(await stage.register(3)).challenger == ir(3).version


async def test_a_pass_rate_regression_beyond_the_margin_rolls_back(stage: Stage) -> None:
    n = LADDER.min_pass_rate_runs
    regressed = evidence(
        2, record=SOME, runs=n, passes=n // 2, baseline_runs=n, baseline_passes=n - 1
    )
    out = await stage.evidence(regressed)
    assert [type(m).__name__ for m in out] == ["RolledBack", "AllocationChanged"]
    assert out[0].trigger == "pass_rate"
    assert "below the current version's" in out[0].reason
    assert (out[0].runs, out[0].passes, out[0].baseline_runs) == (n, n // 2, n)


@pytest.mark.parametrize(
    ("runs", "passes", "baseline_runs", "baseline_passes"),
    [
        (20, 17, 20, 19),  # 85% against 95%: within the 10-point margin
        (19, 5, 40, 40),  # far below, but too few runs of its own to say so
        (40, 5, 19, 19),  # and too few of the current version's
    ],
)
async def test_no_rollback_within_the_margin_or_on_too_few_runs(
    stage: Stage, runs: int, passes: int, baseline_runs: int, baseline_passes: int
) -> None:
    agg = evidence(
        2,
        record=SOME,
        screened=1,
        runs=runs,
        passes=passes,
        baseline_runs=baseline_runs,
        baseline_passes=baseline_passes,
    )
    assert await stage.evidence(agg) == []


async def test_a_rollback_wins_over_an_accept_in_the_same_evidence(stage: Stage) -> None:
    await stage.evidence(evidence(2, record=SOME, screened=CLEAN))  # -> trial
    out = await stage.evidence(evidence(2, record=WINS.model_copy(update={"capped": 1}), served=9))
    assert [type(m).__name__ for m in out] == ["RolledBack", "AllocationChanged"]


# -- resourced ladder: shadow -> canary -> ramp -> current -------------------------------------


@pytest.fixture
async def resourced(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path) as s:
        await s.register(1)
        await s.register(2, **TOURNAMENT)
        yield s


def ranked(**fields: Any) -> Any:
    return evidence(2, extra=TOURNAMENT, **fields)


async def test_the_strength_interval_must_exclude_zero_for_canary(resourced: Stage) -> None:
    few = strength(0.8, 0.2, 1.4, LADDER.min_strength_episodes - 1)
    assert await resourced.evidence(ranked(record=SOME, strength=few)) == []
    spans_zero = strength(0.3, -0.1, 0.7, 8)
    assert await resourced.evidence(ranked(record=SOME, strength=spans_zero)) == []
    above = strength(0.6, 0.1, 1.1, 8)
    alloc = only_allocation(await resourced.evidence(ranked(record=SOME, strength=above)))
    assert (alloc.rung, alloc.challenger_share, alloc.ladder) == (
        Rung.CANARY,
        LADDER.trial_share,
        Ladder.RESOURCED,
    )
    assert (await standing(resourced))["entered_episodes"] == 8


async def test_an_interval_below_zero_rejects(resourced: Stage) -> None:
    below = strength(-0.6, -1.1, -0.1, 8)
    out = await resourced.evidence(ranked(record=SOME, strength=below))
    assert [type(m) for m in out] == [ChallengerRejected, AllocationChanged]
    assert "worse than the current version" in out[0].reason


async def test_canary_ramps_then_swaps_when_the_strength_holds(resourced: Stage) -> None:
    k = LADDER.ramp_episodes
    await resourced.evidence(ranked(record=SOME, strength=strength(0.6, 0.1, 1.1, 8)))
    # canary -> ramp needs the sequential test at alpha and clean canary episodes
    assert await resourced.evidence(ranked(record=SOME, strength=strength(0.6, 0.1, 1, 9))) == []
    served = LADDER.min_trial_runs
    ramp = only_allocation(
        await resourced.evidence(
            ranked(record=WINS, served=served, strength=strength(0.6, 0.2, 1, 10))
        )
    )
    assert (ramp.rung, ramp.challenger_share) == (Rung.RAMP, 0.2)
    # each ramp step must sustain the interval over `ramp_episodes` more episodes
    assert (
        await resourced.evidence(ranked(record=WINS, strength=strength(0.6, 0.2, 1, 9 + k))) == []
    )
    half = only_allocation(
        await resourced.evidence(ranked(record=WINS, strength=strength(0.6, 0.2, 1, 10 + k)))
    )
    assert (half.rung, half.challenger_share) == (Rung.RAMP, 0.5)
    out = await resourced.evidence(ranked(record=WINS, strength=strength(0.6, 0.2, 1, 10 + 2 * k)))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
    assert out[1].current == ir(2, **TOURNAMENT).version


async def test_a_ramp_whose_interval_reaches_zero_holds_its_share(resourced: Stage) -> None:
    k = LADDER.ramp_episodes
    await resourced.evidence(ranked(record=SOME, strength=strength(0.6, 0.1, 1.1, 8)))
    await resourced.evidence(
        ranked(record=WINS, served=LADDER.min_trial_runs, strength=strength(0.6, 0.2, 1, 10))
    )
    wobbling = strength(0.2, -0.1, 0.5, 10 + 3 * k)
    assert await resourced.evidence(ranked(record=WINS, strength=wobbling)) == []
    assert (await resourced.allocation())["challenger_share"] == 0.2


async def test_without_ramp_shares_canary_swaps_directly(tmp_path: Path) -> None:
    async with open_stage(tmp_path, ladder=LadderPolicy(ramp_shares=())) as s:
        await s.register(1)
        await s.register(2, **TOURNAMENT)
        await s.evidence(ranked(record=SOME, strength=strength(0.6, 0.1, 1.1, 8)))
        out = await s.evidence(
            ranked(record=WINS, served=LADDER.min_trial_runs, strength=strength(0.6, 0.2, 1, 9))
        )
        assert [type(m) for m in out] == [Promoted, AllocationChanged]
