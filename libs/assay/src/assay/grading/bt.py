"""Bradley–Terry strengths with the Davidson tie term and a Gaussian prior, fitted by MAP (§11.4).

§11.4 makes three decisions that textbook Bradley–Terry does not, and each is
here:

- **Draws need a draw model.** With ties=DAVIDSON, P(i beats j) =
  π_i / (π_i + π_j + ν√(π_i π_j)) and P(draw) = ν√(π_i π_j) / (same), π = exp(θ);
  the tie parameter ν ≥ 0 is fitted alongside the strengths (as log ν). Draws
  are never dropped or split into half wins: with ties=NONE, data holding draws
  is refused.
- **Small groups separate.** A prior θ_i ~ N(0, 1/prior_precision), independent
  for every player, turns "won every comparison" into a finite strength with a
  wide interval. It sits on the raw strengths of all players, the anchor
  included, so the estimates do not depend on which player is the anchor (the
  anchor only moves the origin), and the prior on a delta between two players
  is N(0, 2/prior_precision). With prior_precision = 0 the fit is the plain
  maximum-likelihood one, and data that leaves a strength unbounded (a player
  or group that won, or lost, every comparison with the rest, or players never
  compared with the rest) is refused, naming who, instead of reporting an
  infinity.
- **A strength alone means nothing.** Every strength is reported as a delta
  from the anchor: the mean strength of the anchor player(s) is pinned to 0.
  Standard errors come from the Laplace approximation (the inverse Hessian of
  the negative log posterior, ν included) by the delta method for each
  contrast; a single anchor has strength 0, standard error 0, interval [0, 0].

The fit works on aggregated counts per pair, by damped Newton on a convex
objective with an analytic gradient and Hessian (`bt_posterior`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import assert_never

import numpy as np
from numpy.typing import NDArray

from assay.grading.bt_posterior import FloatArray, PairArrays, Posterior
from assay.kernel.errors import AssayError


class Ties(enum.Enum):
    """How draws enter the model."""

    DAVIDSON = "davidson"
    """Davidson's tie term: a draw is an outcome of its own, with parameter ν."""
    NONE = "none"
    """Plain Bradley–Terry: no draws allowed in the data."""


@dataclass(frozen=True)
class PairCount:
    """The aggregated outcomes of one unordered pair of players.

    Several counts of the same pair, in either order, add up in `fit`.
    """

    a: str
    b: str
    a_wins: float
    b_wins: float
    draws: float = 0.0


@dataclass(frozen=True)
class Strength:
    """One player's strength as a delta from the anchor, with its uncertainty.

    Attributes:
        strength: the MAP strength minus the anchor's mean strength.
        se: its standard error (Laplace approximation, delta method).
        interval: strength ± z·se at the fit's level.
    """

    strength: float
    se: float
    interval: tuple[float, float]


@dataclass(frozen=True)
class BtFit:
    """A fitted Bradley–Terry model.

    Attributes:
        strengths: every player, the anchor(s) included, in the order of the roster.
        anchor: the players whose mean strength is pinned to 0.
        tie: Davidson's ν (0.0 when the data has no draw, inf when it has nothing
            but draws); None when fitted with ties=NONE.
        comparisons: total comparisons, draws included.
        level: the level of every interval, e.g. 0.95.
    """

    strengths: dict[str, Strength]
    anchor: tuple[str, ...]
    tie: float | None
    comparisons: float
    level: float


class BtFitError(AssayError):
    """The data or the arguments do not admit a fit; the message says why."""


def count_rows(rows: Iterable[tuple[str, str, str]]) -> list[PairCount]:
    """Aggregate comparison rows `(a, b, winner)` into one count per unordered pair.

    The winner is named by position — "a", "b" or "draw" — never by player name,
    so a player may be called "a" or "draw" without ambiguity. Rows of (a, b) and
    of (b, a) merge into one count, oriented as the pair first appeared; pairs
    come out in order of first appearance.

    Raises:
        BtFitError: a row compares a player with itself or names another winner
            (the message gives the row's 1-based position).
    """
    found: dict[frozenset[str], list[float]] = {}
    order: dict[frozenset[str], tuple[str, str]] = {}
    for number, (a, b, winner) in enumerate(rows, start=1):
        if a == b:
            raise BtFitError(f"row {number}: {a!r} is compared with itself")
        if winner not in ("a", "b", "draw"):
            raise BtFitError(f"row {number}: winner must be 'a', 'b' or 'draw', not {winner!r}")
        key = frozenset((a, b))
        first_a, _ = order.setdefault(key, (a, b))
        tally = found.setdefault(key, [0.0, 0.0, 0.0])
        if winner == "draw":
            tally[2] += 1
        else:
            tally[0 if (a if winner == "a" else b) == first_a else 1] += 1
    return [PairCount(*order[key], *tally) for key, tally in found.items()]


def fit(
    counts: Sequence[PairCount],
    *,
    anchor: str | Sequence[str] | None = None,
    prior_precision: float = 1.0,
    ties: Ties = Ties.DAVIDSON,
    level: float = 0.95,
    players: Sequence[str] | None = None,
) -> BtFit:
    """Fit strengths (and ν) to pair counts; report each as a delta from the anchor.

    Args:
        counts: aggregated outcomes per pair (see `count_rows`).
        anchor: the player, or players, whose mean strength is 0. Default: the
            first player of the roster.
        prior_precision: precision of the N(0, 1/prior_precision) prior on every
            raw strength; 0 for the maximum-likelihood fit.
        ties: whether draws are modelled (Davidson) or refused (none).
        level: the level of the intervals, in (0, 1).
        players: the roster, in order; it may hold players without comparisons.
            Default: players in order of first appearance in `counts`.

    Raises:
        BtFitError: a count pairs a player with itself, is negative or not finite,
            or names a player outside `players`; `players` repeats a name; an
            anchor is not a player; prior_precision is negative or not finite;
            level is outside (0, 1); ties=NONE with draws in the data; or, with
            prior_precision = 0, a strength the data leaves unbounded.
    """
    if not (math.isfinite(prior_precision) and prior_precision >= 0):
        raise BtFitError(f"prior_precision must be finite and >= 0, not {prior_precision}")
    if not 0 < level < 1:
        raise BtFitError(f"level must lie in (0, 1), not {level}")
    roster = _roster(counts, players)
    anchors = _anchors(anchor, roster)
    index = {name: i for i, name in enumerate(roster)}
    pairs = _pair_arrays(counts, index)
    draws, decisive = float(pairs.draws.sum()), float((pairs.a_wins + pairs.b_wins).sum())
    if ties is Ties.NONE and draws > 0:
        raise BtFitError(
            f"the data holds {draws:g} draws and ties=none has no draw term; fit with "
            "ties=davidson (dropping draws or splitting them into half wins misstates "
            "the evidence, §11.4)"
        )
    only_draws = draws > 0 and decisive == 0
    if only_draws:
        # (ties=DAVIDSON: NONE refused the draws above.) ν's estimate is infinite, and
        # the likelihood is then flat in the strengths: they are the prior's alone.
        if prior_precision == 0:
            raise BtFitError(
                "every comparison is a draw: with prior_precision=0 the strengths are "
                "not identified; set prior_precision > 0"
            )
        pairs = pairs.without_outcomes()
    if prior_precision == 0:
        _check_bounded(pairs, roster)
    fit_tie = ties is Ties.DAVIDSON and draws > 0 and not only_draws
    try:
        solution = Posterior(pairs, len(roster), prior_precision, fit_tie).solve()
    except (ArithmeticError, np.linalg.LinAlgError) as exc:
        raise BtFitError(f"the fit failed: {exc}") from exc
    tie: float | None
    match ties:
        case Ties.NONE:
            tie = None
        case Ties.DAVIDSON if solution.log_nu is not None:
            tie = math.exp(solution.log_nu)
        case Ties.DAVIDSON:  # no draw at all, or nothing but draws
            tie = math.inf if only_draws else 0.0
        case _:
            assert_never(ties)
    return BtFit(
        strengths=_contrasts(solution.theta, solution.covariance, roster, anchors, level),
        anchor=anchors,
        tie=tie,
        comparisons=draws + decisive,
        level=level,
    )


def _roster(counts: Sequence[PairCount], players: Sequence[str] | None) -> list[str]:
    """Players in order: `players` as given, else by first appearance in the counts."""
    if players is None:
        roster = list(dict.fromkeys(name for c in counts for name in (c.a, c.b)))
    else:
        roster = _listed(counts, players)
    if not roster:
        raise BtFitError("there are no players to fit")
    return roster


def _listed(counts: Sequence[PairCount], players: Sequence[str]) -> list[str]:
    """`players`, once checked: no repeats, and every player of the counts among them."""
    roster = list(players)
    if len(set(roster)) != len(roster):
        repeated = sorted({p for p in roster if roster.count(p) > 1})
        raise BtFitError(f"players lists {', '.join(map(repr, repeated))} more than once")
    known = set(roster)
    for c in counts:
        for name in (c.a, c.b):
            if name not in known:
                raise BtFitError(f"the counts name {name!r}, who is not among players")
    return roster


def _anchors(anchor: str | Sequence[str] | None, roster: list[str]) -> tuple[str, ...]:
    chosen = (roster[0],) if anchor is None else (anchor,) if isinstance(anchor, str) else anchor
    anchors = tuple(dict.fromkeys(chosen))
    if not anchors:
        raise BtFitError("the anchor names no player")
    known = set(roster)
    for name in anchors:
        if name not in known:
            raise BtFitError(f"unknown anchor {name!r}: not among the players")
    return anchors


def _pair_arrays(counts: Sequence[PairCount], index: dict[str, int]) -> PairArrays:
    """The counts as arrays, once each is checked."""
    for c in counts:
        if c.a == c.b:
            raise BtFitError(f"a count pairs {c.a!r} with itself")
        for what, value in (("a_wins", c.a_wins), ("b_wins", c.b_wins), ("draws", c.draws)):
            if not (math.isfinite(value) and value >= 0):
                raise BtFitError(
                    f"the count of {c.a!r} against {c.b!r} has {what} = {value}; "
                    "counts must be finite and >= 0"
                )
    return PairArrays(
        i=np.array([index[c.a] for c in counts], dtype=np.int64),
        j=np.array([index[c.b] for c in counts], dtype=np.int64),
        a_wins=np.array([c.a_wins for c in counts], dtype=np.float64),
        b_wins=np.array([c.b_wins for c in counts], dtype=np.float64),
        draws=np.array([c.draws for c in counts], dtype=np.float64),
    )


def _check_bounded(pairs: PairArrays, roster: list[str]) -> None:
    """Refuse data whose maximum-likelihood strengths are not all finite.

    The estimate exists exactly when the "beat or drew with" graph is strongly
    connected: otherwise some group beat, or drew with, nobody outside it (its
    strength runs to minus infinity, the rest's to plus infinity), or was never
    compared with the rest at all.
    """
    # Imported here, not at the top: a stage that never fits Bradley-Terry (pairwise
    # grading) should not carry scipy.sparse's resident memory.
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    k = len(roster)
    forward = (pairs.a_wins > 0) | (pairs.draws > 0)  # a beat or drew with b
    backward = (pairs.b_wins > 0) | (pairs.draws > 0)
    src = np.concatenate([pairs.i[forward], pairs.j[backward]])
    dst = np.concatenate([pairs.j[forward], pairs.i[backward]])
    graph = coo_matrix((np.ones(len(src)), (src, dst)), shape=(k, k)).tocsr()
    groups, weak = connected_components(graph, directed=True, connection="weak")
    if groups > 1:
        parts = "; ".join(_names(roster, weak == g) for g in range(groups))
        raise BtFitError(
            f"with prior_precision=0 the strengths are not comparable: the players fall "
            f"into {groups} groups never compared with each other ({parts}); set "
            "prior_precision > 0 or compare across the groups"
        )
    groups, strong = connected_components(graph, directed=True, connection="strong")
    if groups > 1:
        # A group nobody outside it beat or drew with won all its outside comparisons.
        beaten = set(strong[dst[strong[src] != strong[dst]]].tolist())
        top = next(g for g in range(groups) if g not in beaten)
        who = _names(roster, strong == top)
        raise BtFitError(
            f"with prior_precision=0 the maximum-likelihood strengths are infinite: "
            f"{who} won every comparison against the other players; set prior_precision > 0"
        )


def _names(roster: list[str], members: NDArray[np.bool_]) -> str:
    names = [roster[i] for i in np.flatnonzero(members)]
    shown = ", ".join(map(repr, names[:5]))
    return shown if len(names) <= 5 else f"{shown} and {len(names) - 5} more"


def _contrasts(
    theta: FloatArray,
    covariance: FloatArray,
    roster: list[str],
    anchors: tuple[str, ...],
    level: float,
) -> dict[str, Strength]:
    """Each strength minus the anchors' mean, with its delta-method standard error."""
    index = {name: i for i, name in enumerate(roster)}
    weights = np.zeros(len(roster))
    weights[[index[a] for a in anchors]] = 1 / len(anchors)
    contrast = np.eye(len(roster)) - weights  # row i: e_i - anchor weights
    if len(anchors) == 1:
        contrast[index[anchors[0]]] = 0.0  # exactly: the anchor minus itself
    values = contrast @ theta
    variances = np.einsum("ij,jk,ik->i", contrast, covariance, contrast)
    z = NormalDist().inv_cdf((1 + level) / 2)
    out = {}
    for name, value, variance in zip(roster, values.tolist(), variances.tolist(), strict=True):
        se = math.sqrt(max(variance, 0.0))
        out[name] = Strength(strength=value, se=se, interval=(value - z * se, value + z * se))
    return out
