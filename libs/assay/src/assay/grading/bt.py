"""Bradley-Terry with the Davidson tie term and a Gaussian prior, fitted by MAP (§11.4).

Three details are decisions, not implementation freedom (seed §11.4):

- **Draws need a draw model.** Davidson: with π = exp(θ),
  P(i beats j) = π_i / D, P(draw) = ν√(π_iπ_j) / D, D = π_i + π_j + ν√(π_iπ_j).
  ν is fitted alongside the strengths. Plain Bradley-Terry (`Ties.NONE`) has no
  place for a draw, so draws in its data are an error — splitting them half and
  half would invent comparisons, dropping them would discard the judge's most
  confident statements.
- **Small groups separate.** Every strength has the prior θ ~ N(0, 1/τ), τ =
  `prior_precision`: a player who won everything gets a finite strength and a
  wide interval instead of an infinite one. With τ = 0 the fit is plain maximum
  likelihood and data that separate (a player never lost, or the comparison
  graph falls apart) are refused with the players named.
- **A strength alone means nothing.** The mean strength of the anchor player(s)
  is pinned to zero and every strength is a delta from it, with a standard error
  from the Laplace approximation (the inverse Hessian of the negative log
  posterior, by the delta method for the contrast). The prior is on the raw
  strengths, so which players anchor changes the report, never the fit.

The model is an exponential family in (θ, log ν), so the negative log posterior
is convex; it is minimised by damped Newton steps on aggregated pair counts with
an analytic gradient and Hessian. When the data hold no draw, the maximum of ν
is at zero and ν is fixed there. A weak N(0, 10²) prior on log ν keeps an
all-draw data set finite.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import linalg
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components
from scipy.stats import norm

from assay.kernel.errors import AssayError

Array = npt.NDArray[np.float64]

_TIE_PRIOR_PRECISION = 0.01
_MAX_ITERATIONS = 200
_TOLERANCE = 1e-10


class Ties(enum.Enum):
    """How draws are modelled."""

    DAVIDSON = "davidson"
    NONE = "none"


class BtFitError(AssayError):
    """The data cannot be fitted as asked (the message says why and names the players)."""


@dataclass(frozen=True)
class PairCount:
    """Aggregated outcomes of one pair: `a` won `a_wins`, `b` won `b_wins`, `draws` drawn."""

    a: str
    b: str
    a_wins: float
    b_wins: float
    draws: float = 0.0


@dataclass(frozen=True)
class Strength:
    """One player's strength as a delta from the anchor, its standard error and interval."""

    strength: float
    se: float
    interval: tuple[float, float]


@dataclass(frozen=True)
class BtFit:
    """Every player's strength, the anchor, the tie parameter and what was fitted."""

    strengths: dict[str, Strength]
    anchor: tuple[str, ...]
    tie: float | None
    comparisons: float
    level: float


def count_rows(rows: Iterable[tuple[str, str, str]]) -> list[PairCount]:
    """Aggregate `(a, b, winner)` rows; `winner` is `a`, `b` or `draw` (positions, not names).

    `(a, b)` and `(b, a)` rows are one pair; pairs come out in order of first appearance.

    Raises:
        BtFitError: a winner other than `a`, `b` or `draw`.
    """
    totals: dict[tuple[str, str], list[float]] = {}
    for a, b, winner in rows:
        key, flipped = ((a, b), False) if (b, a) not in totals else ((b, a), True)
        counts = totals.setdefault(key, [0.0, 0.0, 0.0])
        match winner.strip().lower():
            case "a":
                counts[1 if flipped else 0] += 1
            case "b":
                counts[0 if flipped else 1] += 1
            case "draw":
                counts[2] += 1
            case other:
                raise BtFitError(f"winner {other!r} is not a, b or draw")
    return [PairCount(a, b, *outcomes) for (a, b), outcomes in totals.items()]


def _players(counts: Sequence[PairCount], given: Sequence[str] | None) -> list[str]:
    names: list[str] = list(given) if given is not None else []
    if len(set(names)) != len(names):
        raise BtFitError("a player is listed twice")
    seen = set(names)
    for c in counts:
        for name in (c.a, c.b):
            if name not in seen:
                if given is not None:
                    raise BtFitError(f"{name!r} is compared but not among the players")
                seen.add(name)
                names.append(name)
    return names


def _check_identified(
    n: int,
    index_i: npt.NDArray[np.intp],
    index_j: npt.NDArray[np.intp],
    won: Array,
    lost: Array,
    drawn: Array,
    names: list[str],
) -> None:
    """Zermelo's condition for the maximum-likelihood fit: every player can be reached from
    every other by a chain of 'beat or drew' — else some strength runs off to infinity."""
    beats_i = (won + drawn) > 0
    beats_j = (lost + drawn) > 0
    rows = np.concatenate([index_i[beats_i], index_j[beats_j]]).astype(int)
    cols = np.concatenate([index_j[beats_i], index_i[beats_j]]).astype(int)
    graph = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    parts, labels = connected_components(graph, directed=True, connection="strong")
    if parts > 1:
        groups: dict[int, list[str]] = {}
        for name, label in zip(names, labels, strict=True):
            groups.setdefault(int(label), []).append(name)
        smallest = min(groups.values(), key=len)
        raise BtFitError(
            "the data separate without a prior (prior_precision 0): "
            f"{', '.join(sorted(smallest)[:5])} never lost to, or never beat, the rest; "
            "use a prior precision > 0"
        )


def fit(
    counts: Sequence[PairCount],
    *,
    anchor: str | Sequence[str] | None = None,
    prior_precision: float = 1.0,
    ties: Ties = Ties.DAVIDSON,
    level: float = 0.95,
    players: Sequence[str] | None = None,
) -> BtFit:
    """Fit strengths to aggregated pair counts; see the module docstring for the model.

    `players` lists everyone (players with no comparison get the prior alone);
    by default the players are those compared, in order of first appearance.
    `anchor` defaults to the first player.

    Raises:
        BtFitError: draws with `Ties.NONE`; a negative or non-finite count; a pair of a
            player with itself; an unknown anchor; a prior precision that is negative
            or not finite; no players; or separated data with a prior precision of 0.
    """
    if not math.isfinite(prior_precision) or prior_precision < 0:
        raise BtFitError(f"prior precision must be finite and >= 0, not {prior_precision}")
    if not 0 < level < 1:
        raise BtFitError(f"interval level must be in (0, 1), not {level}")
    for c in counts:
        if c.a == c.b:
            raise BtFitError(f"{c.a!r} is paired with itself")
        values = (c.a_wins, c.b_wins, c.draws)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise BtFitError(f"counts of {c.a!r} vs {c.b!r} must be finite and >= 0: {values}")
    names = _players(counts, players)
    if not names:
        raise BtFitError("no players to fit")
    anchors = (
        (names[0],) if anchor is None else (anchor,) if isinstance(anchor, str) else tuple(anchor)
    )
    unknown = [a for a in anchors if a not in names]
    if not anchors or unknown:
        raise BtFitError(f"anchor {', '.join(map(repr, unknown)) or '(none)'} is not a player")
    position = {name: k for k, name in enumerate(names)}
    n = len(names)
    index_i = np.array([position[c.a] for c in counts], dtype=np.intp)
    index_j = np.array([position[c.b] for c in counts], dtype=np.intp)
    won = np.array([c.a_wins for c in counts], dtype=np.float64)
    lost = np.array([c.b_wins for c in counts], dtype=np.float64)
    drawn = np.array([c.draws for c in counts], dtype=np.float64)
    if ties is Ties.NONE and drawn.sum() > 0:
        raise BtFitError(
            "the data hold draws, which plain Bradley-Terry cannot represent; "
            "use the Davidson tie model"
        )
    if prior_precision == 0:
        _check_identified(n, index_i, index_j, won, lost, drawn, names)
    free_tie = ties is Ties.DAVIDSON and drawn.sum() > 0
    theta, log_nu, hessian = _newton(
        n, index_i, index_j, won, lost, drawn, prior_precision, free_tie
    )
    pinned = 0 if prior_precision == 0 else None  # without a prior, θ_0 = 0 identifies the fit
    covariance = _covariance(hessian, n, pinned)
    contrast = np.zeros((n, n))
    contrast[np.arange(n), np.arange(n)] = 1.0
    anchor_index = [position[a] for a in anchors]
    contrast[:, anchor_index] -= 1.0 / len(anchor_index)
    deltas = contrast @ theta
    variances = np.einsum("ij,jk,ik->i", contrast, covariance, contrast)
    z = float(norm.ppf(0.5 + level / 2))
    strengths = {}
    for k, name in enumerate(names):
        delta = float(deltas[k])
        se = math.sqrt(max(float(variances[k]), 0.0))
        if len(anchors) == 1 and name == anchors[0]:
            delta, se = 0.0, 0.0
        strengths[name] = Strength(delta, se, (delta - z * se, delta + z * se))
    return BtFit(
        strengths=strengths,
        anchor=anchors,
        tie=(math.exp(log_nu) if free_tie else 0.0) if ties is Ties.DAVIDSON else None,
        comparisons=float(won.sum() + lost.sum() + drawn.sum()),
        level=level,
    )


def _newton(
    n: int,
    index_i: npt.NDArray[np.intp],
    index_j: npt.NDArray[np.intp],
    won: Array,
    lost: Array,
    drawn: Array,
    tau: float,
    free_tie: bool,
) -> tuple[Array, float, Array]:
    """Minimise the negative log posterior; return θ, log ν and the Hessian at the optimum.

    The parameters are θ (n), then log ν when it is free. Without a prior, θ_0 is held
    at zero (its row and column are dropped from the step).
    """
    total = won + lost + drawn
    size = n + int(free_tie)
    keep = np.ones(size, dtype=bool)
    if tau == 0:
        keep[0] = False
    params = np.zeros(size)

    def evaluate(p: Array) -> tuple[float, Array, Array]:
        theta = p[:n]
        log_nu = p[n] if free_tie else -np.inf
        half = (theta[index_i] - theta[index_j]) / 2
        log_d = np.logaddexp(np.logaddexp(half, -half), log_nu)
        p_i, p_j = np.exp(half - log_d), np.exp(-half - log_d)
        value = -float(((won - lost) * half).sum() - (total * log_d).sum())
        # Score and information of d = θ_i - θ_j, whose statistic is ±1/2 (0 for a draw).
        g_d = (won - lost) / 2 - total * (p_i - p_j) / 2
        h_dd = total * ((p_i + p_j) / 4 - (p_i - p_j) ** 2 / 4)
        grad = np.zeros(size)
        grad[:n] -= np.bincount(index_i, g_d, n) - np.bincount(index_j, g_d, n)
        hess = np.zeros((size, size))
        diag = np.bincount(index_i, h_dd, n) + np.bincount(index_j, h_dd, n)
        off = np.bincount(index_i * n + index_j, h_dd, n * n).reshape(n, n)
        hess[:n, :n] = np.diag(diag) - off - off.T
        if free_tie:
            p_t = np.exp(log_nu - log_d)
            value -= float(drawn.sum() * log_nu)
            value += _TIE_PRIOR_PRECISION * log_nu**2 / 2
            g_l = drawn - total * p_t
            grad[n] = -float(g_l.sum()) + _TIE_PRIOR_PRECISION * log_nu
            h_dl = total * p_t * (p_i - p_j) / 2  # -Cov(statistic of d, draw indicator)
            cross = np.bincount(index_i, h_dl, n) - np.bincount(index_j, h_dl, n)
            hess[:n, n] = hess[n, :n] = -cross
            hess[n, n] = float((total * p_t * (1 - p_t)).sum()) + _TIE_PRIOR_PRECISION
        value += tau * float(theta @ theta) / 2
        grad[:n] += tau * theta
        hess[:n, :n] += tau * np.eye(n)
        return value, grad, hess

    value, grad, hess = evaluate(params)
    for _ in range(_MAX_ITERATIONS):
        sub = hess[np.ix_(keep, keep)]
        try:
            step_sub = linalg.solve(sub, -grad[keep], assume_a="pos")
        except (linalg.LinAlgError, ValueError):
            step_sub = linalg.lstsq(sub, -grad[keep])[0]
        step = np.zeros(size)
        step[keep] = step_sub
        decrement = float(-grad @ step)
        if decrement / 2 < _TOLERANCE:
            break
        scale = 1.0
        while True:
            candidate = params + scale * step
            new_value, new_grad, new_hess = evaluate(candidate)
            if new_value <= value - 0.25 * scale * decrement or scale < 1e-8:
                break
            scale /= 2
        params, value, grad, hess = candidate, new_value, new_grad, new_hess
    return params[:n], float(params[n]) if free_tie else -math.inf, hess


def _covariance(hessian: Array, n: int, pinned: int | None) -> Array:
    """The covariance of θ: the θ block of the inverse Hessian (pinned row and column 0)."""
    keep = np.ones(len(hessian), dtype=bool)
    if pinned is not None:
        keep[pinned] = False
    inverse = np.zeros_like(hessian)
    sub = hessian[np.ix_(keep, keep)]
    inverse[np.ix_(keep, keep)] = linalg.pinvh(sub)
    return inverse[:n, :n]
