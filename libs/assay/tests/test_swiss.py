"""Swiss pairing (§11.4): rounds, no avoidable rematch, byes, determinism."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.grading.swiss import PairingError, SwissRound, pair_round, rounds_for


@pytest.mark.parametrize(
    ("size", "rounds"), [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (64, 6)]
)
def test_rounds_are_the_ceiling_of_log2(size: int, rounds: int) -> None:
    assert rounds_for(size) == rounds


def play_group(size: int, seed: str, rng: random.Random) -> list[SwissRound]:
    """A whole Swiss group with random results (a win is 1 point, a draw 0.5 each)."""
    players = [f"e{i}" for i in range(size)]
    points = dict.fromkeys(players, 0.0)
    played: set[frozenset[str]] = set()
    byes: list[str] = []
    rounds = []
    for _ in range(rounds_for(size)):
        this = pair_round(players, points, played, seed, byes)
        rounds.append(this)
        for a, b in this.pairs:
            played.add(frozenset((a, b)))
            result = rng.choice([1.0, 0.5, 0.0])
            points[a] += result
            points[b] += 1 - result
        if this.bye is not None:
            byes.append(this.bye)
            points[this.bye] += 1
    return rounds


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_a_group_meets_each_opponent_at_most_once_and_plays_once_per_round(size: int) -> None:
    rng = random.Random(size)
    for trial in range(20):
        rounds = play_group(size, f"group-{trial}", rng)
        seen: set[frozenset[str]] = set()
        for this in rounds:
            present = [p for pair in this.pairs for p in pair]
            if this.bye is not None:
                present.append(this.bye)
            assert sorted(present) == sorted(f"e{i}" for i in range(size))
            assert (this.bye is None) == (size % 2 == 0)
            for pair in this.pairs:
                assert frozenset(pair) not in seen
                seen.add(frozenset(pair))


def test_eight_players_play_twelve_comparisons_in_three_rounds() -> None:
    rounds = play_group(8, "task-1/epoch-0", random.Random(0))
    assert len(rounds) == 3
    assert [len(r.pairs) for r in rounds] == [4, 4, 4]
    assert len({frozenset(p) for r in rounds for p in r.pairs}) == 12


def test_byes_rotate_to_players_without_one() -> None:
    rounds = play_group(7, "odd", random.Random(1))
    byes = [r.bye for r in rounds]
    assert len(set(byes)) == len(byes) == 3


def test_the_bye_goes_to_the_lowest_ranked_player_without_one() -> None:
    players = ["a", "b", "c", "d", "e"]
    points = {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.5, "e": 0.0}
    assert pair_round(players, points, set(), "s").bye == "e"
    assert pair_round(players, points, set(), "s", byes={"e"}).bye == "d"
    everyone = pair_round(players, points, set(), "s", byes=set(players))
    assert everyone.bye == "e"


def test_pairing_is_top_down_by_points() -> None:
    players = ["a", "b", "c", "d", "e", "f"]
    points = {"a": 2.0, "b": 2.0, "c": 1.0, "d": 1.0, "e": 0.0, "f": 0.0}
    ordered = pair_round(players, points, set(), "s")
    assert [frozenset(p) for p in ordered.pairs] == [
        frozenset("ab"),
        frozenset("cd"),
        frozenset("ef"),
    ]
    # a and b have met: the leader takes the next player it has not met.
    rematch_free = pair_round(players, points, {frozenset("ab")}, "s")
    assert all(frozenset(p) != frozenset("ab") for p in rematch_free.pairs)
    assert points[rematch_free.pairs[0][0]] == 2.0
    assert points[rematch_free.pairs[0][1]] == 1.0


def test_pairs_list_the_higher_ranked_player_first() -> None:
    points = {"a": 0.0, "b": 3.0}
    assert pair_round(["a", "b"], points, set(), "s").pairs == [("b", "a")]


def test_a_rematch_is_played_only_when_unavoidable() -> None:
    assert pair_round(["a", "b"], {}, {frozenset("ab")}, "s").pairs in ([("a", "b")], [("b", "a")])
    every_pair = {frozenset(p) for p in ["ab", "ac", "ad", "bc", "bd", "cd"]}
    forced = pair_round(["a", "b", "c", "d"], {}, every_pair, "s")
    assert len(forced.pairs) == 2


def test_the_same_inputs_pair_identically_whatever_the_listing_order() -> None:
    players = [f"e{i}" for i in range(9)]
    points = {p: float(i % 3) for i, p in enumerate(players)}
    played = {frozenset(("e0", "e3")), frozenset(("e1", "e4"))}
    first = pair_round(players, points, played, "seed-1", byes=["e2"])
    again = pair_round(list(reversed(players)), dict(points), set(played), "seed-1", byes={"e2"})
    assert first == again


def test_the_seed_shuffles_players_level_on_points() -> None:
    players = [f"e{i}" for i in range(8)]
    orders = {tuple(pair_round(players, {}, set(), f"seed-{n}").pairs) for n in range(10)}
    assert len(orders) > 1


@pytest.mark.parametrize(
    ("players", "points", "message"),
    [
        (["a", "b", "a"], {}, "listed more than once"),
        (["a", "b"], {"a": float("nan")}, "'a' has points nan"),
    ],
)
def test_bad_groups_are_refused(players: list[str], points: dict[str, float], message: str) -> None:
    with pytest.raises(PairingError, match=message):
        pair_round(players, points, set(), "s")


def perfect_matchings(items: list[str]) -> Iterator[list[frozenset[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for i, other in enumerate(rest):
        for tail in perfect_matchings(rest[:i] + rest[i + 1 :]):
            yield [frozenset((first, other)), *tail]


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(min_value=2, max_value=8),
    points=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=8, max_size=8),
    played_bits=st.integers(min_value=0, max_value=(1 << 28) - 1),
    had_byes=st.sets(st.integers(min_value=0, max_value=7)),
    seed=st.text(max_size=8),
)
def test_a_round_has_the_fewest_rematches_any_pairing_has(
    size: int, points: list[float], played_bits: int, had_byes: set[int], seed: str
) -> None:
    players = [f"e{i}" for i in range(size)]
    all_pairs = [frozenset((f"e{i}", f"e{j}")) for i in range(8) for j in range(i + 1, 8)]
    played = {pair for bit, pair in enumerate(all_pairs) if played_bits >> bit & 1}
    byes = {f"e{i}" for i in had_byes}
    this = pair_round(players, dict(zip(players, points, strict=False)), played, seed, byes)
    eligible = [p for p in players if p not in byes] or players
    if size % 2:
        assert this.bye in eligible
    rest = [p for p in players if p != this.bye]
    assert sorted(p for pair in this.pairs for p in pair) == sorted(rest)
    rematches = sum(frozenset(p) in played for p in this.pairs)
    fewest = min(
        sum(pair in played for pair in matching)
        for bye in (eligible if size % 2 else [None])
        for matching in perfect_matchings([p for p in players if p != bye])
    )
    assert rematches == fewest
