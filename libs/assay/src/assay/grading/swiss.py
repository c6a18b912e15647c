"""Swiss pairing (§11.4): a full ranking in ⌈log₂ G⌉ rounds instead of G(G-1)/2 pairs.

Each round pairs players of similar standing, top down, without a rematch while
one can be avoided; an odd player out gets a bye (the lowest-ranked who has not
had one). Ties in standing are broken by a shuffle seeded by the caller — the
shuffle is what cancels any order in which episodes arrived — so the same
inputs always pair the same way (a redelivered message re-pairs identically).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SwissRound:
    """One round's pairs, and the player sitting it out."""

    pairs: list[tuple[str, str]]
    bye: str | None


def rounds_for(group_size: int) -> int:
    """⌈log₂ G⌉ rounds for a group of G (none below two players)."""
    return math.ceil(math.log2(group_size)) if group_size >= 2 else 0


def _shuffle_key(seed: str, name: str) -> bytes:
    return hashlib.blake2b(f"{seed}\x1f{name}".encode(), digest_size=16).digest()


def _pair(order: list[str], played: Collection[frozenset[str]]) -> list[tuple[str, str]] | None:
    """Pair `order` top down without rematches, backtracking; None when impossible."""
    if not order:
        return []
    first, rest = order[0], order[1:]
    for i, other in enumerate(rest):
        if frozenset((first, other)) in played:
            continue
        tail = _pair(rest[:i] + rest[i + 1 :], played)
        if tail is not None:
            return [(first, other), *tail]
    return None


def pair_round(
    players: Sequence[str],
    points: Mapping[str, float],
    played: Collection[frozenset[str]],
    *,
    seed: str,
    byes: Collection[str] = (),
) -> SwissRound:
    """Pair one round by standing; see the module docstring for the rules.

    Raises:
        ValueError: a player is named twice.
    """
    if len(set(players)) != len(players):
        raise ValueError("a player is named twice")
    order = sorted(players, key=lambda p: (-points.get(p, 0.0), _shuffle_key(seed, p)))
    bye: str | None = None
    if len(order) % 2:
        bye = next((p for p in reversed(order) if p not in byes), order[-1])
        order.remove(bye)
    pairs = _pair(order, frozenset(played))
    if pairs is None:  # every pairing repeats one: fall back to neighbours in standing
        pairs = [(order[i], order[i + 1]) for i in range(0, len(order), 2)]
    return SwissRound(pairs=pairs, bye=bye)
