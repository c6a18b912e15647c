"""Bradley–Terry with the Davidson tie term and a prior (§11.4): recovery, coverage, refusals."""

from __future__ import annotations

import math
from statistics import NormalDist

import choix
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from assay.grading import bt_posterior
from assay.grading.bt import BtFitError, PairCount, Ties, count_rows, fit
from assay.kernel.errors import AssayError


def davidson_counts(
    rng: np.random.Generator, theta: NDArray[np.float64], nu: float, per_pair: int
) -> list[PairCount]:
    """Every pair of players compared `per_pair` times under the Davidson model."""
    counts = []
    for a in range(len(theta)):
        for b in range(a + 1, len(theta)):
            pa, pb = math.exp(theta[a]), math.exp(theta[b])
            pd = nu * math.sqrt(pa * pb)
            total = pa + pb + pd
            wins_a, wins_b, draws = rng.multinomial(per_pair, [pa / total, pb / total, pd / total])
            counts.append(PairCount(f"p{a}", f"p{b}", float(wins_a), float(wins_b), float(draws)))
    return counts


def strengths(fitted_names: list[str], result: dict[str, float]) -> NDArray[np.float64]:
    return np.array([result[name] for name in fitted_names])


# -- recovery -----------------------------------------------------------------------------------


def test_davidson_recovers_known_strengths_and_tie_parameter() -> None:
    rng = np.random.default_rng(20_240_701)
    theta = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 0.2, 1.5, -0.3])
    result = fit(davidson_counts(rng, theta, nu=0.8, per_pair=500), prior_precision=0)
    assert result.anchor == ("p0",)
    assert result.comparisons == 28 * 500
    assert result.tie == pytest.approx(0.8, abs=0.05)
    for k, truth in enumerate(theta):
        s = result.strengths[f"p{k}"]
        assert abs(s.strength - truth) < 4 * s.se + 1e-12
        assert s.se < 0.08


def test_tie_heavy_data_recovers_a_large_tie_parameter() -> None:
    rng = np.random.default_rng(3)
    theta = rng.normal(0, 0.5, 6)
    result = fit(davidson_counts(rng, theta, nu=3.0, per_pair=400), prior_precision=0)
    assert result.tie == pytest.approx(3.0, rel=0.08)
    # Equal strengths draw with probability ν / (2 + ν): most of these comparisons are draws.
    assert result.tie is not None
    assert result.tie / (2 + result.tie) > 0.5


def test_intervals_cover_the_truth_at_their_nominal_rate() -> None:
    # Strengths drawn from the prior the fit assumes, so a 95% interval should hold the
    # true delta 95% of the time, up to the Laplace approximation's error: with 16
    # comparisons per pair that error is small (with 8 coverage sits near 94%).
    rng = np.random.default_rng(20_240_702)
    covered = total = 0
    for _ in range(400):
        theta = rng.normal(0, 1, 8)
        result = fit(davidson_counts(rng, theta, nu=0.5, per_pair=16), prior_precision=1.0)
        for k in range(1, 8):
            low, high = result.strengths[f"p{k}"].interval
            covered += low <= theta[k] - theta[0] <= high
            total += 1
    assert 0.93 <= covered / total <= 0.97


def test_plain_maximum_likelihood_matches_choix() -> None:
    rng = np.random.default_rng(5)
    k, n = 20, 3000
    theta = rng.normal(0, 1, k)
    a = rng.integers(0, k, n)
    b = (a + rng.integers(1, k, n)) % k
    a_won = rng.random(n) < 1 / (1 + np.exp(theta[b] - theta[a]))
    winners, losers = np.where(a_won, a, b), np.where(a_won, b, a)
    data = list(zip(winners.tolist(), losers.tolist(), strict=True))
    ours = fit(
        count_rows((str(w), str(x), "a") for w, x in data),
        prior_precision=0,
        ties=Ties.NONE,
        players=[str(i) for i in range(k)],
        anchor="0",
    )
    theirs = choix.ilsr_pairwise(k, data, alpha=0.0)
    assert ours.tie is None
    got = np.array([ours.strengths[str(i)].strength for i in range(k)])
    assert np.max(np.abs(got - (theirs - theirs[0]))) < 1e-3


# -- the prior ----------------------------------------------------------------------------------


def test_a_player_who_wins_everything_gets_a_finite_strength_and_a_wider_interval() -> None:
    counts = [
        PairCount("champ", "b", 2, 0),
        PairCount("champ", "c", 2, 0),
        PairCount("champ", "d", 2, 0),
        PairCount("b", "c", 1, 1),
        PairCount("b", "d", 2, 0),
        PairCount("c", "d", 1, 1),
    ]
    result = fit(counts, anchor="b", prior_precision=1.0)
    champ = result.strengths["champ"]
    assert math.isfinite(champ.strength)
    assert champ.strength > 0
    others = [result.strengths[name].se for name in ("c", "d")]
    assert champ.se > max(others)
    with pytest.raises(BtFitError, match="'champ' won every comparison"):
        fit(counts, anchor="b", prior_precision=0)


def test_more_prior_precision_shrinks_strengths_toward_each_other() -> None:
    counts = [PairCount("a", "b", 7, 3), PairCount("b", "c", 6, 4), PairCount("a", "c", 8, 2)]
    spreads = [fit(counts, prior_precision=lam).strengths["c"].strength for lam in (0.0, 1.0, 10.0)]
    assert spreads[0] < spreads[1] < spreads[2] < 0


def test_the_anchor_only_moves_the_origin() -> None:
    rng = np.random.default_rng(8)
    counts = davidson_counts(rng, rng.normal(0, 1, 5), nu=0.4, per_pair=3)
    by_p0 = fit(counts, prior_precision=2.0)
    by_p3 = fit(counts, prior_precision=2.0, anchor="p3")
    shift = by_p0.strengths["p3"].strength
    for name, s in by_p0.strengths.items():
        assert by_p3.strengths[name].strength == pytest.approx(s.strength - shift, abs=1e-9)
    assert by_p3.tie == pytest.approx(by_p0.tie)
    anchor = by_p3.strengths["p3"]
    assert (anchor.strength, anchor.se, anchor.interval) == (0.0, 0.0, (0.0, 0.0))
    # The delta between two non-anchors has one uncertainty, whoever the anchor is, so
    # p0's standard error against p3 is p3's against p0.
    assert by_p3.strengths["p0"].se == pytest.approx(by_p0.strengths["p3"].se, rel=1e-9)


def test_several_anchors_pin_their_mean() -> None:
    counts = [PairCount("a", "b", 5, 2), PairCount("b", "c", 4, 4, 2), PairCount("a", "c", 6, 1)]
    result = fit(counts, anchor=["b", "c"])
    assert result.anchor == ("b", "c")
    mean = (result.strengths["b"].strength + result.strengths["c"].strength) / 2
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert result.strengths["b"].se > 0


def test_the_default_anchor_is_the_first_player_to_appear() -> None:
    counts = [PairCount("x", "y", 1, 2), PairCount("z", "x", 3, 1)]
    assert fit(counts).anchor == ("x",)
    assert fit(counts, players=["z", "y", "x"]).anchor == ("z",)
    assert list(fit(counts, players=["z", "y", "x"]).strengths) == ["z", "y", "x"]


def test_a_player_without_comparisons_gets_the_prior() -> None:
    result = fit([PairCount("a", "b", 3, 1)], players=["a", "b", "idle"], prior_precision=4.0)
    idle = result.strengths["idle"]
    assert math.isfinite(idle.strength)
    assert idle.se > result.strengths["b"].se


def test_the_level_sets_the_interval_width() -> None:
    counts = [PairCount("a", "b", 6, 4, 1)]
    wide, narrow = fit(counts, level=0.95), fit(counts, level=0.5)
    assert wide.level == 0.95
    for result in (wide, narrow):
        z = NormalDist().inv_cdf((1 + result.level) / 2)
        s = result.strengths["b"]
        assert s.interval == pytest.approx((s.strength - z * s.se, s.strength + z * s.se))


def test_data_without_draws_fits_a_zero_tie_parameter() -> None:
    counts = [PairCount("a", "b", 6, 4), PairCount("b", "c", 5, 5), PairCount("a", "c", 7, 3)]
    davidson, plain = fit(counts), fit(counts, ties=Ties.NONE)
    assert (davidson.tie, plain.tie) == (0.0, None)
    for name in "abc":
        assert davidson.strengths[name] == plain.strengths[name]


def test_nothing_but_draws_leaves_the_strengths_to_the_prior() -> None:
    result = fit([PairCount("a", "b", 0, 0, 4)], prior_precision=1.0)
    assert result.tie == math.inf
    assert result.strengths["b"].strength == 0.0
    assert result.strengths["b"].se == pytest.approx(math.sqrt(2.0))  # var of a delta: 2/λ


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcde"),
            st.sampled_from("abcde"),
            st.sampled_from(["a", "b", "draw"]),
        ).filter(lambda row: row[0] != row[1]),
        min_size=1,
        max_size=40,
    )
)
def test_orientation_and_order_of_rows_do_not_change_the_fit(
    rows: list[tuple[str, str, str]],
) -> None:
    flipped = [(b, a, {"a": "b", "b": "a", "draw": "draw"}[w]) for a, b, w in reversed(rows)]
    players = sorted({name for a, b, _ in rows for name in (a, b)})
    one = fit(count_rows(rows), players=players)
    other = fit(count_rows(flipped), players=players)
    assert one.tie == pytest.approx(other.tie)
    for name in players:
        assert one.strengths[name].strength == pytest.approx(
            other.strengths[name].strength, abs=1e-7
        )
        assert one.strengths[name].se == pytest.approx(other.strengths[name].se, abs=1e-7)


# -- counting rows ------------------------------------------------------------------------------


def test_count_rows_merges_both_orders_of_a_pair() -> None:
    rows = [("x", "y", "a"), ("y", "x", "a"), ("y", "x", "draw"), ("x", "z", "b"), ("x", "y", "b")]
    assert count_rows(rows) == [PairCount("x", "y", 1, 2, 1), PairCount("x", "z", 0, 1, 0)]


def test_count_rows_reads_the_winner_by_position_not_by_name() -> None:
    # A player may be called "a" or "draw": the winner column is always positional.
    assert count_rows([("b", "a", "a")]) == [PairCount("b", "a", 1, 0, 0)]
    assert count_rows([("draw", "a", "draw")]) == [PairCount("draw", "a", 0, 0, 1)]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([("x", "y", "a"), ("x", "x", "a")], "row 2: 'x' is compared with itself"),
        ([("x", "y", "x")], "row 1: winner must be 'a', 'b' or 'draw', not 'x'"),
    ],
)
def test_count_rows_refuses_bad_rows(rows: list[tuple[str, str, str]], message: str) -> None:
    with pytest.raises(BtFitError, match=message):
        count_rows(rows)


# -- refusals -----------------------------------------------------------------------------------

GOOD = [PairCount("a", "b", 3, 2, 1), PairCount("b", "c", 2, 2), PairCount("a", "c", 1, 3)]


@pytest.mark.parametrize(
    ("counts", "kwargs", "message"),
    [
        (GOOD, {"anchor": "zed"}, "unknown anchor 'zed'"),
        (GOOD, {"anchor": []}, "the anchor names no player"),
        (GOOD, {"prior_precision": math.inf}, "prior_precision must be finite and >= 0"),
        (GOOD, {"prior_precision": math.nan}, "prior_precision must be finite and >= 0"),
        (GOOD, {"prior_precision": -1.0}, "prior_precision must be finite and >= 0"),
        (GOOD, {"level": 1.0}, r"level must lie in \(0, 1\)"),
        (GOOD, {"ties": Ties.NONE}, "holds 1 draws and ties=none has no draw term"),
        (GOOD, {"players": ["a", "b"]}, "the counts name 'c', who is not among players"),
        (GOOD, {"players": ["a", "b", "c", "a"]}, "players lists 'a' more than once"),
        ([], {}, "there are no players to fit"),
        ([PairCount("a", "a", 1, 0)], {}, "pairs 'a' with itself"),
        ([PairCount("a", "b", -1, 2)], {}, "a_wins = -1"),
        ([PairCount("a", "b", 1, math.nan)], {}, "b_wins = nan"),
        ([PairCount("a", "b", 1, 1, math.inf)], {}, "draws = inf"),
        (
            [PairCount("a", "b", 1, 1), PairCount("c", "d", 2, 1)],
            {"prior_precision": 0},
            r"2 groups never compared with each other \('a', 'b'; 'c', 'd'\)",
        ),
        (
            [PairCount("a", "b", 1, 1), PairCount("c", "b", 3, 0), PairCount("c", "a", 1, 0)],
            {"prior_precision": 0},
            "'c' won every comparison against the other players",
        ),
        (
            [PairCount("a", "b", 0, 0, 2)],
            {"prior_precision": 0},
            "every comparison is a draw",
        ),
        (GOOD, {"players": ["a", "b", "c", "idle"], "prior_precision": 0}, "'idle'"),
    ],
)
def test_fit_refuses_with_the_reason(
    counts: list[PairCount], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(BtFitError, match=message) as caught:
        fit(counts, **kwargs)  # type: ignore[arg-type]
    assert isinstance(caught.value, AssayError)


def test_a_fit_that_does_not_converge_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bt_posterior, "MAX_NEWTON_STEPS", 1)
    with pytest.raises(BtFitError, match="the fit failed: Newton did not converge in 1 steps"):
        fit(GOOD)


def test_draws_with_a_losing_group_are_still_bounded() -> None:
    # A draw links both ways: a group that drew with the rest is not separated.
    counts = [PairCount("a", "b", 2, 1), PairCount("c", "a", 0, 2, 1)]
    result = fit(counts, prior_precision=0)
    assert all(math.isfinite(s.strength) for s in result.strengths.values())
