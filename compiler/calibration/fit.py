"""Least-squares fits of measured times, the one place the calibration fits a line.

Every calibrated figure is a straight line through timings: a collective's `alpha + beta * bytes`,
an op class's `call + units * per_unit`, the optimizer's `tensors * per_tensor + elements *
per_element`, a GPU's `(F + h) / (peak * e)`. Timings span decades, so the fits weigh each point by
`1 / t^2`: they minimise relative errors, small and large measurements alike. Costs are never
negative, so `fit_nonnegative` keeps both coefficients >= 0 (exactly: the constrained optimum of
a convex two-parameter problem lies on the boundary when the free one does not).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardc.calibration.profile import AlphaBeta


def fit_linear(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None, *,
               intercept: bool = True) -> tuple[float, float]:
    """(intercept, slope) minimising `sum(w * (intercept + slope * x - y) ** 2)` (`numpy.linalg.lstsq`
    on rows scaled by `sqrt(w)`; unit weights by default). `intercept=False` fits a line through
    the origin (intercept 0). Raises ValueError when the points do not determine the line (fewer
    distinct x than coefficients, or all x zero through the origin)."""
    if len(xs) != len(ys) or not xs or (weights is not None and len(weights) != len(ys)):
        raise ValueError("fit_linear needs matching, non-empty samples")
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    root = np.sqrt(np.asarray(weights, dtype=float)) if weights is not None else np.ones_like(x)
    columns = [np.ones_like(x), x] if intercept else [x]
    design = np.stack(columns, axis=1) * root[:, None]
    # Columns scaled to unit length: x in FLOPs or bytes is 1e9 times the constant column, and the
    # rank test must not take that spread for a dependence.
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    solution, _, rank, _ = np.linalg.lstsq(design / norms, y * root, rcond=None)
    if rank < len(columns):
        raise ValueError("the points do not determine a line (too few distinct x)")
    solution = solution / norms
    return (float(solution[0]), float(solution[1])) if intercept else (0.0, float(solution[0]))


def fit_nonnegative(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None
                    ) -> tuple[float, float]:
    """`fit_linear` with intercept and slope >= 0: the free fit when both come out >= 0, else the
    better (in the same weighted error) of the best line through the origin (slope >= 0) and the
    best constant (the weighted mean)."""
    try:
        free = fit_linear(xs, ys, weights)
        if free[0] >= 0 and free[1] >= 0:
            return free
    except ValueError:
        pass
    w = np.asarray(weights, dtype=float) if weights is not None else np.ones(len(xs))
    try:
        through_origin = (0.0, max(fit_linear(xs, ys, weights, intercept=False)[1], 0.0))
    except ValueError:  # every x is zero: no slope to fit
        through_origin = (0.0, 0.0)
    constant = (float(np.average(np.asarray(ys, dtype=float), weights=w)), 0.0)
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    error = lambda line: float(np.sum(w * (line[0] + line[1] * x - y) ** 2))  # noqa: E731
    return min((through_origin, constant), key=error)


def fit_affine(xs: Sequence[float], ts: Sequence[float], scale: Sequence[float] | None = None) -> AlphaBeta:
    """`t = alpha + beta * x` in relative error (points span decades), alpha, beta >= 0. The error
    is relative to `scale` when given (e.g. the raw measurement a difference came from)."""
    if len(xs) != len(ts) or not xs or (scale is not None and len(scale) != len(ts)):
        raise ValueError("fit_affine needs matching, non-empty samples")
    alpha, beta = fit_nonnegative(xs, ts, [1.0 / (t * t) for t in (scale if scale is not None else ts)])
    return AlphaBeta(alpha, beta)


def fit_two_terms(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) >= 0 of `t = a * x + b * y` over (x, y, t) samples with x > 0, in relative error.

    Divided by x it is a line, `t / x = a + b * (y / x)`, and its relative error
    `((a x + b y - t) / t) ** 2` is that line's squared error weighted `(x / t) ** 2`."""
    return fit_nonnegative([y / x for x, y, _ in samples], [t / x for x, _, t in samples],
                           [(x / t) ** 2 for x, _, t in samples])


def fit_three_terms(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(c, a, b) >= 0 of `t = c + a * x + b * y` over (x, y, t) samples, in relative error (rows
    weighted `1 / t`): the free least-squares fit when every coefficient comes out >= 0, else the
    best, in the same error, of the fits with the negative ones held at 0 (the constrained optimum
    of a convex problem lies on that boundary)."""
    if len(samples) < 3:
        raise ValueError("fit_three_terms needs at least three samples")
    x = np.asarray([(1.0, a, b) for a, b, _ in samples], dtype=float)
    t = np.asarray([s[2] for s in samples], dtype=float)
    rows, target = x / t[:, None], np.ones_like(t)
    best: tuple[float, np.ndarray] | None = None
    for keep in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
        cols = list(keep)
        design = rows[:, cols]
        norms = np.linalg.norm(design, axis=0)
        norms[norms == 0] = 1.0
        solution, _, rank, _ = np.linalg.lstsq(design / norms, target, rcond=None)
        if rank < len(cols):
            continue
        coef = np.zeros(3)
        coef[cols] = solution / norms
        if (coef < 0).any():
            continue
        error = float(np.sum((rows @ coef - target) ** 2))
        if best is None or error < best[0]:
            best = (error, coef)
            if len(cols) == 3:  # the free fit is non-negative: it is the optimum
                break
    if best is None:
        return 0.0, 0.0, 0.0
    return float(best[1][0]), float(best[1][1]), float(best[1][2])
