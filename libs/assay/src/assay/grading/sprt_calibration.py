"""Exact operating characteristics of the sequential test, and its calibrated boundaries (§11.3).

The test of §11.3 walks a log-likelihood ratio over decisive comparisons: a win
adds `log(p1/p0)`, a loss adds `log((1-p1)/(1-p0))`, and the walk stops at the
first state on or beyond a boundary. Wald's boundaries `log((1-β)/α)` and
`log(β/(1-α))` assume the walk stops exactly on them; on the wins/losses
lattice it overshoots, so the real error rates sit below α and β and every
decision spends comparisons it did not need. §11.3 exists to make close
decisions cost less, so the boundaries are calibrated instead: the exact error
rates and expected sample sizes come from dynamic programming over (wins,
losses), and the boundaries chosen are the narrowest pair whose exact false
accept at p0 is at most α and exact false reject at p1 at most β, narrowest in
the sense of the smaller worst-case expected sample size at p0 and p1.

Only the continuing states of one step are held, a band a few states wide
between the two boundaries, so a whole test costs a few hundred vector
operations; many boundary pairs are evaluated at once along a batch axis.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # numpy is imported by the functions that compute: a process that only reads a
    # policy's settings (every stage's, every command's) does not load it.
    import numpy as np
    from numpy.typing import NDArray

    FloatArray = NDArray[np.float64]

HORIZON = 100_000
"""Decisive comparisons after which the exact walk is cut off; what is left is undecided."""

TAIL = 1e-12
"""Probability of still continuing below which the exact walk stops: the remainder is noise."""

CANDIDATES = 64
"""Lattice states per boundary that calibration considers: the likeliest under Wald."""

QUANTILES = (0.5, 0.9, 0.99)
"""Levels of the sample-size quantiles reported with every operating characteristic."""


@dataclass(frozen=True)
class Steps:
    """How one decisive comparison moves the log-likelihood ratio of H1 (p1) over H0 (p0)."""

    win: float
    loss: float

    @classmethod
    def of(cls, p0: float, p1: float) -> Steps:
        """The steps of the test of win rate p0 against p1 (0 < p0 < p1 < 1)."""
        return cls(win=math.log(p1 / p0), loss=math.log((1 - p1) / (1 - p0)))

    def llr(self, wins: NDArray[np.int64], losses: NDArray[np.int64]) -> FloatArray:
        """The ratio at these states, with the same float operations as `sprt.llr`."""
        return wins * self.win + losses * self.loss


@dataclass(frozen=True)
class LatticeOc:
    """Exact operating characteristics of boundary pairs (axis 0) at win rates (axis 1).

    Attributes:
        accept: probability of stopping on the upper boundary.
        reject: probability of stopping on the lower boundary.
        undecided: probability of still continuing at the cut-off.
        mean_n: expected decisive comparisons to stop (the undecided count at the cut-off).
        quantiles: smallest n by which each level of `QUANTILES` of the tests have stopped
            (leading axis: the level; the cut-off when never reached).
        stop_n: the last step computed.
    """

    accept: FloatArray
    reject: FloatArray
    undecided: FloatArray
    mean_n: FloatArray
    quantiles: NDArray[np.int64]
    stop_n: int


@dataclass(frozen=True)
class _Step:
    """One step of the walk: the states after n comparisons, before absorption.

    `probs` has axes (test, win rate, state) and `ratio` is each state's
    log-likelihood ratio; `accepting` and `rejecting` mark, per test, the states on
    or beyond its boundaries.
    """

    n: int
    ratio: FloatArray
    probs: FloatArray
    accepting: NDArray[np.bool_]
    rejecting: NDArray[np.bool_]


def _walk(
    steps: Steps, upper: FloatArray, lower: FloatArray, win_rates: FloatArray, horizon: int
) -> Iterator[_Step]:
    """The tests `(upper[i], lower[i])` at each win rate, one comparison at a time.

    A state stops with accept when its ratio is >= upper and with reject when it
    is <= lower, exactly as `sprt.evaluate` decides. Only a window of states that
    can still be continuing is held. The walk ends when less than `TAIL` of every
    test is still continuing, or at `horizon` comparisons.
    """
    import numpy as np

    d = steps.win - steps.loss
    floor_lower = float(lower.min())
    # Window of k (wins) that can hold a continuing state of any test at step n:
    # k*d + n*loss lies strictly between the lowest lower and the highest upper.
    width = math.ceil((float(upper.max()) - floor_lower) / d) + 2
    cont = np.zeros((len(upper), len(win_rates), width))
    cont[..., 0] = 1.0
    base = 0  # k of cont[..., 0]
    win = win_rates[None, :, None]
    up, low = upper[:, None, None], lower[:, None, None]
    for n in range(1, horizon + 1):
        nxt = np.zeros((*cont.shape[:2], width + 1))
        nxt[..., :-1] += cont * (1 - win)
        nxt[..., 1:] += cont * win
        k = base + np.arange(width + 1)
        ratio = steps.llr(k, n - k)
        step = _Step(n, ratio, nxt, ratio >= up, ratio <= low)
        yield step
        nxt = np.where(step.accepting | step.rejecting, 0.0, nxt)
        # The window moves up by at most one win per step; what falls out was absorbed.
        shift = max(0, math.floor((floor_lower - n * steps.loss) / d)) - base
        cont = nxt[..., shift : shift + width]
        base += shift
        if float(cont.sum(axis=-1).max()) < TAIL:
            return


def lattice_oc(
    steps: Steps,
    upper: FloatArray,
    lower: FloatArray,
    win_rates: FloatArray,
    *,
    horizon: int = HORIZON,
) -> LatticeOc:
    """Exact operating characteristics of the tests `(upper[i], lower[i])` at each win rate.

    Decisions are those of `sprt.evaluate` on decisive comparisons; the walk is
    cut off once less than `TAIL` of every test is continuing, or at `horizon`.
    """
    import numpy as np

    shape = (len(upper), len(win_rates))
    accept, reject, mean_n = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    stopped = np.zeros(shape)
    quantiles = np.full((len(QUANTILES), *shape), horizon, dtype=np.int64)
    levels = np.array(QUANTILES)[:, None, None]
    last = None
    for step in _walk(steps, upper, lower, win_rates, horizon):
        last, n = step, step.n
        took = np.where(step.accepting, step.probs, 0.0).sum(axis=-1)
        dropped = np.where(step.rejecting, step.probs, 0.0).sum(axis=-1)
        accept += took
        reject += dropped
        mean_n += n * (took + dropped)
        stopped += took + dropped
        quantiles = np.where((quantiles == horizon) & (stopped >= levels), n, quantiles)
    if last is None:
        raise ValueError("the horizon must be at least one comparison")
    undecided = np.where(last.accepting | last.rejecting, 0.0, last.probs).sum(axis=-1)
    return LatticeOc(
        accept=accept,
        reject=reject,
        undecided=undecided,
        mean_n=mean_n + last.n * undecided,
        quantiles=quantiles,
        stop_n=last.n,
    )


def _candidates(
    steps: Steps, wald_upper: float, wald_lower: float, p0: float, p1: float
) -> tuple[FloatArray, FloatArray]:
    """Lattice ratios that could serve as narrower boundaries, widest first.

    A boundary matters only through the lattice states it admits, so the
    candidates are the ratios of states that continue under Wald and lie within
    one step of a Wald boundary (the overshoot is at most one step): the
    `CANDIDATES` likeliest at p0 or p1 on each side. Wald's own boundary leads
    each list.
    """
    import numpy as np

    values, reach = [], []
    for step in _walk(
        steps, np.array([wald_upper]), np.array([wald_lower]), np.array([p0, p1]), HORIZON
    ):
        live = ~(step.accepting[0, 0] | step.rejecting[0, 0])
        values.append(step.ratio[live])
        reach.append(step.probs[0][:, live].max(axis=0))
    ratios, probs = np.concatenate(values), np.concatenate(reach)

    def likeliest(window: NDArray[np.bool_], descending: bool) -> FloatArray:
        chosen = np.flatnonzero(window & (probs > 0))
        chosen = chosen[np.argsort(-probs[chosen], kind="stable")[:CANDIDATES]]
        picked = np.unique(ratios[chosen])
        return picked[::-1] if descending else picked

    uppers = likeliest(ratios >= wald_upper - steps.win, True)
    lowers = likeliest(ratios <= wald_lower - steps.loss, False)
    return np.concatenate([[wald_upper], uppers]), np.concatenate([[wald_lower], lowers])


def _gap_middle(steps: Steps, value: float, below: bool, last_n: int) -> float:
    """The middle of the gap between a lattice ratio and its nearest lattice neighbour.

    Any boundary in that gap admits the same states up to `last_n` comparisons;
    the middle keeps a one-ulp difference in how a caller sums the ratio from
    flipping a decision.
    """
    import numpy as np

    n = np.arange(1, last_n + 1)
    d = steps.win - steps.loss
    k = np.floor((value - n * steps.loss) / d).astype(np.int64)
    near = np.concatenate([k - 1, k, k + 1])
    nn = np.concatenate([n, n, n])
    ok = (near >= 0) & (near <= nn)
    ratios = steps.llr(near[ok], nn[ok] - near[ok])
    if below:
        neighbour = float(ratios[ratios < value].max())
    else:
        neighbour = float(ratios[ratios > value].min())
    return (value + neighbour) / 2


@functools.cache
def calibrate(p0: float, p1: float, alpha: float, beta: float) -> tuple[float, float]:
    """The calibrated (upper, lower) boundaries of the test of p0 against p1.

    Among the candidate boundary pairs (see `_candidates`), those whose exact
    false accept at p0 is <= alpha and exact false reject at p1 is <= beta, the
    one with the smallest larger expected sample size at p0 and p1. For each
    upper boundary the best lower one is the highest that keeps the false
    reject within beta (raising the lower boundary only shortens tests and adds
    rejects), found by a bisection run on every upper boundary at once. Wald's
    pair when no candidate qualifies. Cached: a policy calibrates once per process.
    """
    import numpy as np

    steps = Steps.of(p0, p1)
    wald_upper = math.log((1 - beta) / alpha)
    wald_lower = math.log(beta / (1 - alpha))
    uppers, lowers = _candidates(steps, wald_upper, wald_lower, p0, p1)
    at_p1 = np.array([p1])
    # lo: highest lower index known to keep the false reject within beta; hi: lowest known not to.
    lo = np.zeros(len(uppers), dtype=np.int64)
    hi = np.full(len(uppers), len(lowers), dtype=np.int64)
    usable = lattice_oc(steps, uppers, lowers[lo], at_p1).reject[:, 0] <= beta
    while bool(np.any(usable & (hi - lo > 1))):
        mid = (lo + hi) // 2
        fine = lattice_oc(steps, uppers, lowers[np.minimum(mid, len(lowers) - 1)], at_p1)
        within = fine.reject[:, 0] <= beta
        searching = usable & (hi - lo > 1)
        lo = np.where(searching & within, mid, lo)
        hi = np.where(searching & ~within, mid, hi)
    oc = lattice_oc(steps, uppers, lowers[lo], np.array([p0, p1]))
    feasible = usable & (oc.accept[:, 0] <= alpha) & (oc.reject[:, 1] <= beta)
    if not bool(feasible.any()):
        return wald_upper, wald_lower
    cost = np.where(feasible, oc.mean_n.max(axis=1), np.inf)
    best = int(np.argmin(cost))  # first of equals: the widest
    upper, lower = float(uppers[best]), float(lowers[lo[best]])
    last_n = oc.stop_n
    return (
        wald_upper if best == 0 else _gap_middle(steps, upper, True, last_n),
        wald_lower if lo[best] == 0 else _gap_middle(steps, lower, False, last_n),
    )


def fixed_n(p0: float, p1: float, alpha: float, beta: float) -> int:
    """Smallest n of an exact one-sided binomial test of p0 against p1: size alpha, power 1-beta.

    The test rejects H0 when wins >= c; for each n, c is the smallest cut-off with
    P(wins >= c | p0) <= alpha, and n qualifies when P(wins >= c | p1) >= 1 - beta.
    This is the fixed-sample design the sequential test is measured against.

    Raises:
        ValueError: the parameters are outside 0 < p0 < p1 < 1, 0 < alpha, beta < 1.
    """
    import numpy as np

    # Imported here: scipy.stats takes about a second to import, and every process
    # that evaluates the sequential test imports this module.
    from scipy import stats

    if not (0 < p0 < p1 < 1 and 0 < alpha < 1 and 0 < beta < 1):
        raise ValueError("fixed_n needs 0 < p0 < p1 < 1 and alpha, beta in (0, 1)")
    z = NormalDist().inv_cdf
    spread = z(1 - alpha) * math.sqrt(p0 * (1 - p0)) + z(1 - beta) * math.sqrt(p1 * (1 - p1))
    approx = max(1, math.ceil((spread / (p1 - p0)) ** 2))
    n = np.arange(1, 4 * approx + 64)
    cut = stats.binom.ppf(1 - alpha, n, p0) + 1
    size = stats.binom.sf(cut - 1, n, p0)
    power = stats.binom.sf(cut - 1, n, p1)
    ok = np.flatnonzero((size <= alpha) & (power >= 1 - beta))
    return int(n[ok[0]])
