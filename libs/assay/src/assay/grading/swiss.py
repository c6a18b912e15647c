"""Swiss pairing for tournament groups (§11.4).

A group of G episodes plays ⌈log₂ G⌉ rounds: G = 8 is twelve comparisons
rather than round robin's twenty-eight, and unlike single elimination every
episode keeps playing, so the Bradley–Terry fit gets a full ranking.

Each round ranks the players by points, breaks ties by a shuffle derived from
a seed (§11.4: shuffling into brackets also cancels position bias), and pairs
top-down: the highest-ranked unpaired player meets the highest-ranked one it
has not met yet. In order of precedence:

1. nobody gets a second bye while someone has had none;
2. as few rematches as possible (none when any pairing avoids them);
3. the bye goes to the lowest-ranked player who may take it;
4. pairs are as close in rank as the top-down order allows.

Pairing is a pure function of its inputs — not of the order the players are
listed in — so a redelivered message pairs the same round identically.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from assay.kernel.errors import AssayError


class PairingError(AssayError):
    """The round cannot be paired as asked; the message says why."""


@dataclass(frozen=True)
class SwissRound:
    """One round: who meets whom, higher-ranked first, and who sits out.

    Attributes:
        pairs: the round's comparisons as (higher-ranked, lower-ranked).
        bye: the player without an opponent this round (odd groups only).
    """

    pairs: list[tuple[str, str]]
    bye: str | None


def rounds_for(group_size: int) -> int:
    """Rounds a group of `group_size` plays: ⌈log₂ G⌉, and 0 for G ≤ 1."""
    return 0 if group_size <= 1 else (group_size - 1).bit_length()


def pair_round(
    players: Sequence[str],
    points: Mapping[str, float],
    played: Collection[frozenset[str]],
    seed: str,
    byes: Collection[str] = (),
) -> SwissRound:
    """Pair one round of a Swiss group.

    Args:
        players: the group; their order does not matter.
        points: each player's points so far (a player missing from it has 0).
        played: the pairs that have already met.
        seed: the shuffle that orders players level on points, e.g. the group's key.
        byes: the players who have already had a bye.

    Raises:
        PairingError: a player is listed twice, or has points that are not finite.
    """
    if len(set(players)) != len(players):
        raise PairingError("a player is listed more than once in the group")
    for name in players:
        if not math.isfinite(points.get(name, 0.0)):
            raise PairingError(f"{name!r} has points {points[name]}, which is not finite")
    ranked = sorted(players, key=lambda name: _rank_key(name, points, seed))
    had_bye = set(byes)
    if len(ranked) % 2 == 0:
        bye_order: list[str | None] = [None]
    else:
        lowest_first = ranked[::-1]
        bye_order = [p for p in lowest_first if p not in had_bye] or list(lowest_first)
    met = set(played)
    for allowed in range(len(ranked) // 2 + 1):
        for bye in bye_order:
            rest = [p for p in ranked if p != bye]
            pairs = _top_down(rest, met, allowed)
            if pairs is not None:
                return SwissRound(pairs=pairs, bye=bye)
    raise AssertionError("unreachable: with every rematch allowed, any even list pairs")


def _rank_key(name: str, points: Mapping[str, float], seed: str) -> tuple[float, bytes, str]:
    """Most points first; level players in the seed's shuffled order."""
    shuffle = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    return (-points.get(name, 0.0), shuffle, name)


def _top_down(
    ranked: list[str], met: set[frozenset[str]], allowed: int
) -> list[tuple[str, str]] | None:
    """The first top-down pairing of `ranked` with at most `allowed` rematches, if any.

    Depth-first: the highest-ranked unpaired player takes the highest-ranked
    partner that still lets the rest pair. Remaining sets already shown not to
    pair are remembered, so no dead end is explored twice.
    """
    count = len(ranked)
    rematch = [[frozenset((x, y)) in met for y in ranked] for x in ranked]
    dead: set[tuple[int, int]] = set()

    def search(left: int, budget: int) -> list[tuple[int, int]] | None:
        if left == 0:
            return []
        if (left, budget) in dead:
            return None
        top = (left & -left).bit_length() - 1  # highest-ranked unpaired
        for other in range(top + 1, count):
            cost = int(rematch[top][other])
            if not left >> other & 1 or cost > budget:
                continue
            rest = search(left & ~(1 << top) & ~(1 << other), budget - cost)
            if rest is not None:
                return [(top, other), *rest]
        dead.add((left, budget))
        return None

    found = search((1 << count) - 1, allowed)
    return None if found is None else [(ranked[a], ranked[b]) for a, b in found]
