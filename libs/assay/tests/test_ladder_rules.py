"""The promotion ladder's rules as properties (§12.3, §12.5): nothing held out moves a
challenger, a cap always rolls it back, rungs are climbed one at a time, and the
policy's settings name themselves when they are wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.grading.ladder import LadderPolicy, MoveKind, Standing, step
from assay.grading.sprt import SprtPolicy
from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion, tenant_id
from assay.kernel.scores import WinRecord
from assay.messages import HeldOutTally, Ladder, Rung, StrengthSummary, VariantAggregate
from assay.runtime.settings import AssaySettings, SettingsInvalid

TENANT: TenantId = tenant_id("6f1c7a8e-2b0d-4c1e-9a55-3d1f0e2b7c44")
POLICY = LadderPolicy()
SPRT = SprtPolicy()
RUNGS = {
    Ladder.DEFAULT: [Rung.SHADOW, Rung.TRIAL],
    Ladder.RESOURCED: [Rung.SHADOW, Rung.CANARY, Rung.RAMP],
}

counts = st.integers(0, 40)
records = st.builds(
    WinRecord,
    judge_wins=counts,
    judge_losses=counts,
    draws=counts,
    verifier_wins=counts,
    verifier_losses=counts,
    capped=st.integers(0, 2),
)


@st.composite
def strengths(draw: st.DrawFn) -> StrengthSummary | None:
    if draw(st.booleans()):
        return None
    mean = draw(st.floats(-2, 2))
    half = draw(st.floats(0, 2))
    return StrengthSummary(
        episodes=draw(st.integers(0, 30)),
        mean=mean,
        interval=(mean - half, mean + half),
        unanchored=0,
    )


@st.composite
def aggregates(draw: st.DrawFn) -> VariantAggregate:
    runs, base = draw(st.integers(0, 60)), draw(st.integers(0, 60))
    return VariantAggregate(
        tenant=TENANT,
        workflow_id=WorkflowId("arith"),
        workflow_version=WorkflowVersion("b" * 64),
        baseline_version=WorkflowVersion("a" * 64),
        record=draw(records),
        runs=runs,
        passes=draw(st.integers(0, runs)),
        strength=draw(strengths()),
        screened=draw(counts),
        served=draw(counts),
        baseline_runs=base,
        baseline_passes=draw(st.integers(0, base)),
        order_checked=draw(st.integers(0, 10)),
        order_inconsistent=draw(st.integers(0, 10)),
        held_out=None,
    )


@st.composite
def standings(draw: st.DrawFn) -> Standing:
    ladder = draw(st.sampled_from(list(Ladder)))
    rung = draw(st.sampled_from(RUNGS[ladder]))
    shares = {Rung.SHADOW: [0.0], Rung.TRIAL: [0.05], Rung.CANARY: [0.05], Rung.RAMP: [0.2, 0.5]}
    return Standing(
        ladder=ladder,
        rung=rung,
        share=draw(st.sampled_from(shares[rung])),
        entered_served=draw(st.integers(0, 10)),
        entered_episodes=draw(st.integers(0, 10)),
        accepted=draw(st.booleans()),
    )


held_out_tallies = st.builds(
    HeldOutTally,
    runs=counts,
    passes=counts,
    record=records,
    strength=strengths(),
    baseline_runs=counts,
    baseline_passes=counts,
)


@settings(max_examples=200, deadline=None)
@given(standings(), aggregates(), held_out_tallies)
def test_nothing_held_out_moves_a_challenger(
    standing: Standing, agg: VariantAggregate, held: HeldOutTally
) -> None:
    assert step(standing, agg, POLICY, SPRT) == step(
        standing, agg.model_copy(update={"held_out": held}), POLICY, SPRT
    )


@settings(max_examples=200, deadline=None)
@given(standings(), aggregates())
def test_a_capped_selection_episode_always_rolls_back(
    standing: Standing, agg: VariantAggregate
) -> None:
    move = step(standing, agg, POLICY, SPRT)
    if agg.record.capped:
        assert (move.kind, move.trigger) == (MoveKind.ROLL_BACK, "capped")
    else:
        assert move.trigger != "capped"


@settings(max_examples=200, deadline=None)
@given(standings(), aggregates())
def test_rungs_are_climbed_one_at_a_time_and_only_the_top_one_swaps(
    standing: Standing, agg: VariantAggregate
) -> None:
    move = step(standing, agg, POLICY, SPRT)
    rungs = RUNGS[standing.ladder]
    if move.kind is MoveKind.ADVANCE:
        assert move.rung is not None
        assert move.share > standing.share
        assert rungs.index(move.rung) in (
            rungs.index(standing.rung),
            rungs.index(standing.rung) + 1,
        )
    if move.kind is MoveKind.PROMOTE:
        assert standing.rung is rungs[-1] or (
            standing.ladder is Ladder.RESOURCED and standing.rung is Rung.RAMP
        )
        assert standing.accepted or move.accepted_now or standing.ladder is Ladder.RESOURCED
        assert agg.record.capped == 0


def test_policy_settings_name_the_variable() -> None:
    assert AssaySettings.from_env({"ASSAY_LADDER_RAMP_SHARES": "0.3, 0.6"}).ladder.ramp_shares == (
        0.3,
        0.6,
    )
    assert AssaySettings.from_env({"ASSAY_HELD_OUT_FRACTION": "0"}).ladder.held_out_fraction == 0.0
    with pytest.raises(SettingsInvalid, match="ASSAY_LADDER_TRIAL_SHARE='x'"):
        AssaySettings.from_env({"ASSAY_LADDER_TRIAL_SHARE": "x"})
    with pytest.raises(SettingsInvalid, match="ASSAY_HELD_OUT_FRACTION='1'"):
        AssaySettings.from_env({"ASSAY_HELD_OUT_FRACTION": "1"})
    with pytest.raises(SettingsInvalid, match="ramp_shares must rise"):
        AssaySettings.from_env({"ASSAY_LADDER_RAMP_SHARES": "0.5,0.2"})
    demo = AssaySettings.from_env({}).ladder.over({"trial_share": 0.1})
    assert demo.trial_share == 0.1
    assert AssaySettings.from_env({"ASSAY_LADDER_TRIAL_SHARE": "0.15"}).ladder.over(
        {"trial_share": 0.1}
    ) == (LadderPolicy(trial_share=0.15))
