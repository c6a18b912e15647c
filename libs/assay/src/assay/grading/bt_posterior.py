"""The Bradley–Terry–Davidson negative log posterior and its Newton solve (§11.4).

The numerical core of `assay.grading.bt`, apart from its API and its checks.
Over x = (θ_1..θ_K[, log ν]) and the aggregated counts of each pair (i, j):

    -log p(x) = -Σ [w_i θ_i + w_j θ_j + d (log ν + (θ_i + θ_j)/2) - n log D]
                + λ/2 Σ θ_k² + GAUGE/2 (Σ θ_k)²,
    D = e^θ_i + e^θ_j + ν e^((θ_i + θ_j)/2),  n = w_i + w_j + d.

Each term is linear minus a log-sum-exp of linear functions, so the whole is
convex in x, and a damped Newton method from θ = 0 converges. Gradient and
Hessian are analytic and vectorised over the pairs; the Hessian is assembled
with one `bincount`, which keeps a fit of 100 players and 4,950 pairs to a few
milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

GAUGE = 1.0
"""Curvature added along "every strength up by the same amount", the one direction the
likelihood cannot see; it fixes the mean raw strength at 0 and changes no contrast."""

MAX_NEWTON_STEPS = 200
"""Newton steps before the fit gives up; a convex fit converges in a few dozen at most."""

CONVERGED = 1e-10
"""Newton decrement (g·H⁻¹g) below which one more full step reaches the optimum."""

ARMIJO = 1e-4
"""Share of the predicted decrease a damped Newton step must achieve."""

HALVINGS = 40
"""How often a Newton step may be halved before the fit is declared stalled."""


@dataclass(frozen=True)
class PairArrays:
    """Aggregated counts as arrays over pairs: player indices and outcome counts."""

    i: IntArray
    j: IntArray
    a_wins: FloatArray
    b_wins: FloatArray
    draws: FloatArray

    def without_outcomes(self) -> PairArrays:
        """No pairs at all: a likelihood that says nothing."""
        index, count = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return PairArrays(index, index, count, count, count)


@dataclass(frozen=True)
class Solution:
    """The MAP point and the Laplace approximation around it.

    Attributes:
        theta: the raw strengths, mean 0.
        covariance: their covariance, the θ block of the inverse Hessian (ν integrated).
        log_nu: log ν when the tie parameter was fitted, else None.
    """

    theta: FloatArray
    covariance: FloatArray
    log_nu: float | None


class Posterior:
    """The negative log posterior of K strengths (and log ν when `fit_tie`) given pair counts."""

    def __init__(self, pairs: PairArrays, k: int, precision: float, fit_tie: bool) -> None:
        self.pairs = pairs
        self.k = k
        self.precision = precision
        self.fit_tie = fit_tie
        self.size = k + 1 if fit_tie else k
        self.n = pairs.a_wins + pairs.b_wins + pairs.draws

    def solve(self) -> Solution:
        """The MAP point by damped Newton, and the covariance of the strengths there.

        Raises:
            np.linalg.LinAlgError: the Hessian is numerically not positive definite.
            ArithmeticError: Newton stalled or did not converge.
        """
        import scipy.linalg  # here, not at the top: only a stage that fits pays its memory

        x = self._start()
        for _ in range(MAX_NEWTON_STEPS):
            grad, hess = self.derivatives(x)
            step = -scipy.linalg.cho_solve(scipy.linalg.cho_factor(hess), grad)
            if float(-grad @ step) < CONVERGED:
                x = x + step
                break
            x = self._line_search(x, step, grad)
        else:
            raise ArithmeticError(f"Newton did not converge in {MAX_NEWTON_STEPS} steps")
        _, hess = self.derivatives(x)
        inverse = scipy.linalg.cho_solve(scipy.linalg.cho_factor(hess), np.eye(self.size))
        return Solution(
            theta=x[: self.k],
            covariance=inverse[: self.k, : self.k],
            log_nu=float(x[self.k]) if self.fit_tie else None,
        )

    def value(self, x: FloatArray) -> float:
        """The negative log posterior at x (up to a constant)."""
        p = self.pairs
        ti, tj, td, log_d = self._log_terms(x)
        draw = p.draws * td if self.fit_tie else 0.0
        loglik = float(np.sum(p.a_wins * ti + p.b_wins * tj + draw - self.n * log_d))
        theta = x[: self.k]
        return -loglik + float(self.precision / 2 * theta @ theta + GAUGE / 2 * theta.sum() ** 2)

    def derivatives(self, x: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Gradient and Hessian of the negative log posterior at x."""
        p, k, size = self.pairs, self.k, self.size
        ti, tj, td, log_d = self._log_terms(x)
        pi, pj, pd = np.exp(ti - log_d), np.exp(tj - log_d), np.exp(td - log_d)
        n = self.n
        # The expected outcome: a draw counts half to each side's strength.
        mi, mj = pi + pd / 2, pj + pd / 2
        grad = np.zeros(size)
        grad[:k] = np.bincount(p.i, n * mi - p.a_wins - p.draws / 2, minlength=k)
        grad[:k] += np.bincount(p.j, n * mj - p.b_wins - p.draws / 2, minlength=k)
        # The Hessian is n times the outcome's covariance, entry by entry.
        rows = [p.i, p.j, p.i, p.j]
        cols = [p.i, p.j, p.j, p.i]
        cross = n * (pd / 4 - mi * mj)
        vals = [n * (pi + pd / 4 - mi**2), n * (pj + pd / 4 - mj**2), cross, cross]
        if self.fit_tie:
            grad[k] = float(np.sum(n * pd - p.draws))
            tie_i, tie_j = n * pd * (0.5 - mi), n * pd * (0.5 - mj)
            at_k = np.full_like(p.i, k)
            rows += [p.i, at_k, p.j, at_k, at_k[:1]]
            cols += [at_k, p.i, at_k, p.j, at_k[:1]]
            vals += [tie_i, tie_i, tie_j, tie_j, np.array([np.sum(n * pd * (1 - pd))])]
        flat = np.concatenate(rows) * size + np.concatenate(cols)
        weights = np.concatenate(vals)
        hess = np.bincount(flat, weights, minlength=size * size).astype(np.float64)
        hess = hess.reshape(size, size)
        theta = x[:k]
        grad[:k] += self.precision * theta + GAUGE * theta.sum()
        hess[:k, :k] += GAUGE
        hess[np.arange(k), np.arange(k)] += self.precision
        return grad, hess

    def _start(self) -> FloatArray:
        x = np.zeros(self.size)
        if self.fit_tie:
            # Equal strengths give P(draw) = ν / (2 + ν): start from the observed draw rate.
            rate = float(self.pairs.draws.sum() / self.n.sum())
            x[self.k] = math.log(2 * rate / (1 - rate))
        return x

    def _log_terms(self, x: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Per pair: θ_i, θ_j, the draw term's log weight, and log D."""
        ti, tj = x[self.pairs.i], x[self.pairs.j]
        if self.fit_tie:
            td = x[self.k] + (ti + tj) / 2
            log_d = np.logaddexp(np.logaddexp(ti, tj), td)
        else:
            td = np.full_like(ti, -np.inf)
            log_d = np.logaddexp(ti, tj)
        return ti, tj, td, log_d

    def _line_search(self, x: FloatArray, step: FloatArray, grad: FloatArray) -> FloatArray:
        """The longest of step, step/2, step/4… that decreases the objective enough (Armijo).

        Raises:
            ArithmeticError: no halving of the step down to 2^-HALVINGS does.
        """
        here, slope, t = self.value(x), float(grad @ step), 1.0
        for _ in range(HALVINGS):
            moved = x + t * step
            if self.value(moved) <= here + ARMIJO * t * slope:
                return moved
            t /= 2
        raise ArithmeticError("Newton stalled: no damped step decreases the objective")
