"""Calibrated pairwise sequential testing (§11.3): exact boundaries, checked by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from assay.grading import (
    SprtDecision,
    SprtPolicy,
    evaluate,
    fixed_n,
    llr,
    operating_characteristics,
    simulate,
)
from assay.grading.sprt_calibration import calibrate
from assay.kernel.scores import WinRecord
from assay.runtime.settings import AssaySettings

DEFAULT = SprtPolicy()
POLICIES = [
    pytest.param(DEFAULT, id="default"),
    pytest.param(SprtPolicy(beta=0.10), id="b=.10"),
    pytest.param(SprtPolicy(alpha=0.01, beta=0.2), id="a=.01,b=.2"),
    pytest.param(SprtPolicy(p0=0.6, p1=0.9, alpha=0.1, beta=0.1), id="p0=.6,p1=.9"),
    pytest.param(SprtPolicy(p0=0.5, p1=0.6), id="p1=.6"),
]


def wald(policy: SprtPolicy) -> SprtPolicy:
    return policy.model_copy(update={"calibrated": False})


# -- the fixed-sample baseline ------------------------------------------------------------------


def test_fixed_n_of_the_default_policy_is_67() -> None:
    assert fixed_n(0.5, 0.7, 0.05, 0.05) == 67


@pytest.mark.parametrize(
    ("p0", "p1", "alpha", "beta"),
    [(0.5, 0.7, 0.05, 0.05), (0.5, 0.8, 0.1, 0.2), (0.5, 0.6, 0.05, 0.1), (0.3, 0.6, 0.01, 0.05)],
)
def test_fixed_n_is_the_smallest_exact_one_sided_binomial_test(
    p0: float, p1: float, alpha: float, beta: float
) -> None:
    def qualifies(n: int) -> bool:
        cut = np.arange(n + 2)  # every cut-off c, rejecting H0 when wins >= c
        size, power = stats.binom.sf(cut - 1, n, p0), stats.binom.sf(cut - 1, n, p1)
        return bool(np.any((size <= alpha) & (power >= 1 - beta)))

    n = fixed_n(p0, p1, alpha, beta)
    assert qualifies(n)
    assert not any(qualifies(m) for m in range(1, n))


def test_fixed_n_refuses_inconsistent_parameters() -> None:
    with pytest.raises(ValueError, match="0 < p0 < p1 < 1"):
        fixed_n(0.7, 0.5, 0.05, 0.05)


# -- calibration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_calibrated_boundaries_are_no_wider_than_walds(policy: SprtPolicy) -> None:
    assert policy.wald_lower <= policy.lower < 0 < policy.upper <= policy.wald_upper


@pytest.mark.parametrize("policy", POLICIES)
def test_calibrated_exact_error_rates_are_within_alpha_and_beta(policy: SprtPolicy) -> None:
    at_p0 = operating_characteristics(policy, policy.p0)
    at_p1 = operating_characteristics(policy, policy.p1)
    assert at_p0.accept_rate <= policy.alpha
    assert at_p1.reject_rate <= policy.beta
    assert at_p0.undecided_rate < 1e-11
    assert at_p1.undecided_rate < 1e-11


@pytest.mark.parametrize("policy", POLICIES)
def test_calibration_spends_fewer_comparisons_than_wald(policy: SprtPolicy) -> None:
    for p in (policy.p0, policy.p1):
        plain = operating_characteristics(wald(policy), p)
        calibrated = operating_characteristics(policy, p)
        assert calibrated.mean_n <= plain.mean_n
    # Wald's boundaries are conservative on the lattice: that slack is what calibration spends.
    assert operating_characteristics(wald(policy), policy.p0).accept_rate < policy.alpha


def test_default_policy_decides_in_under_55_percent_of_the_fixed_sample() -> None:
    n = fixed_n(DEFAULT.p0, DEFAULT.p1, DEFAULT.alpha, DEFAULT.beta)
    for p in (DEFAULT.p0, DEFAULT.p1):
        assert operating_characteristics(DEFAULT, p).mean_n / n <= 0.55


def test_boundaries_sit_between_lattice_ratios() -> None:
    # A boundary equal to a reachable ratio would leave the decision to float rounding.
    for wins in range(200):
        for losses in range(200):
            value = llr(wins, losses, DEFAULT)
            assert abs(value - DEFAULT.upper) > 1e-9
            assert abs(value - DEFAULT.lower) > 1e-9


def test_calibration_is_computed_once_per_test_parameters() -> None:
    _ = DEFAULT.upper
    before = calibrate.cache_info()
    other = SprtPolicy(draw_ceiling=0.3, min_for_draws=5)  # same test, other draw rule
    assert (other.upper, other.lower) == (DEFAULT.upper, DEFAULT.lower)
    assert calibrate.cache_info().misses == before.misses


def test_calibration_can_be_switched_off_from_the_environment() -> None:
    policy = AssaySettings.from_env({"ASSAY_SPRT_CALIBRATED": "false"}).sprt
    assert not policy.calibrated
    assert (policy.upper, policy.lower) == (policy.wald_upper, policy.wald_lower)


# -- exact operating characteristics against simulation ---------------------------------------


@pytest.mark.parametrize("p", [0.5, 0.6, 0.7])
def test_the_exact_walk_agrees_with_simulation(p: float) -> None:
    reps = 20_000
    exact = operating_characteristics(DEFAULT, p)
    sim = simulate(DEFAULT, p, reps, seed=11)
    se = math.sqrt(exact.accept_rate * (1 - exact.accept_rate) / reps)
    assert abs(sim.accept_rate - exact.accept_rate) < 4 * se
    assert sim.accept_rate + sim.reject_rate == 1.0
    assert sim.mean_n == pytest.approx(exact.mean_n, rel=0.03)
    for name, value in exact.quantiles.items():
        assert abs(sim.quantiles[name] - value) <= max(2, 0.05 * value)


def test_simulated_false_accept_rate_under_h0() -> None:
    sim = simulate(DEFAULT, DEFAULT.p0, 40_000, seed=20_240_601)
    assert sim.accept_rate <= DEFAULT.alpha + 0.01


def test_simulated_false_reject_rate_under_h1() -> None:
    sim = simulate(DEFAULT, DEFAULT.p1, 40_000, seed=20_240_602)
    assert sim.reject_rate <= DEFAULT.beta + 0.01


def test_draws_lengthen_the_test_without_moving_its_decisions() -> None:
    policy = SprtPolicy(min_for_draws=100_000)  # keep the ceiling out of the way
    exact = operating_characteristics(policy, 0.7)
    sim = simulate(policy, 0.7, 20_000, seed=5, p_draw=0.4)
    assert sim.accept_rate == pytest.approx(exact.accept_rate, abs=0.01)
    # Wald's identity: comparisons = decisive comparisons / (1 - draw rate), in expectation.
    assert sim.mean_n == pytest.approx(exact.mean_n / 0.6, rel=0.03)


def test_the_draw_ceiling_rejects_as_evaluate_does() -> None:
    all_draws = simulate(DEFAULT, 0.7, 1_000, seed=1, p_draw=1.0)
    assert all_draws.reject_rate == 1.0
    assert all_draws.mean_n == DEFAULT.min_for_draws
    assert evaluate(WinRecord(draws=DEFAULT.min_for_draws), DEFAULT).decision is (
        SprtDecision.REJECT
    )
    mostly_draws = simulate(DEFAULT, 0.7, 5_000, seed=2, p_draw=0.8)
    assert mostly_draws.reject_rate > 0.95
    assert mostly_draws.quantiles["p50"] == DEFAULT.min_for_draws


def test_a_cut_off_walk_reports_what_is_undecided() -> None:
    horizon = 20
    exact = operating_characteristics(DEFAULT, 0.6, horizon=horizon)
    sim = simulate(DEFAULT, 0.6, 20_000, seed=3, horizon=horizon)
    assert exact.accept_rate + exact.reject_rate + exact.undecided_rate == pytest.approx(1.0)
    assert exact.undecided_rate > 0.5
    assert sim.undecided_rate == pytest.approx(exact.undecided_rate, abs=0.02)
    assert exact.quantiles["p90"] == sim.quantiles["p90"] == horizon


def test_rates_outside_the_unit_interval_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        operating_characteristics(DEFAULT, 1.5)
    with pytest.raises(ValueError, match="rates"):
        simulate(DEFAULT, 0.5, 10, seed=0, p_draw=-0.1)
    with pytest.raises(ValueError, match="reps"):
        simulate(DEFAULT, 0.5, 0, seed=0)
