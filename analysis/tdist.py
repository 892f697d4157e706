"""Student's t distribution: the CDF and its quantiles, for any real degrees of freedom ν > 0, on
numpy arrays (the project has no scipy).

The CDF through the regularized incomplete beta function I_x(a, b) (Abramowitz & Stegun 26.7.1):

    F_ν(t) = 1 − ½ · I_{ν/(ν+t²)}(ν/2, ½)   for t ≥ 0,   F_ν(−t) = 1 − F_ν(t),

I_x(a, b) by its continued fraction (modified Lentz; Press et al., *Numerical Recipes*, §6.4), used
directly where x < (a + 1)/(a + b + 2) and through I_x(a, b) = 1 − I_{1−x}(b, a) elsewhere, where it
converges fast. The quantile t_ν(q) (F_ν(t) = q) by safeguarded Newton steps on the monotone CDF.
"""

from __future__ import annotations

import math

import numpy as np

_TINY = 1e-300
_ITERATIONS = 300  # continued-fraction terms: ample for a, b ≤ 10⁵ at the x where the fraction is used


def _lbeta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lgamma = np.vectorize(math.lgamma, otypes=[float])
    return lgamma(a) + lgamma(b) - lgamma(a + b)


def _beta_fraction(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The continued fraction of I_x(a, b) (Numerical Recipes ``betacf``), element-wise."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = np.ones_like(x)
    d = 1.0 - qab * x / qap
    d = 1.0 / np.where(np.abs(d) < _TINY, _TINY, d)
    h = d.copy()
    for m in range(1, _ITERATIONS + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / np.where(np.abs(d) < _TINY, _TINY, d)
            c = 1.0 + aa / c
            c = np.where(np.abs(c) < _TINY, _TINY, c)
            h = h * d * c
        if np.all(np.abs(d * c - 1.0) < 1e-15):
            break
    return h


def betainc(a, b, x) -> np.ndarray:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0, 0 ≤ x ≤ 1 (broadcast)."""
    a, b, x = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (a, b, x)))
    out = np.where(x <= 0, 0.0, 1.0)
    inner = (x > 0) & (x < 1)
    if not inner.any():
        return out
    a, b, x = a[inner], b[inner], x[inner]
    front = np.exp(a * np.log(x) + b * np.log1p(-x) - _lbeta(a, b))
    direct = x < (a + 1.0) / (a + b + 2.0)
    value = np.where(direct, front * _beta_fraction(x, a, b) / a,
                     1.0 - front * _beta_fraction(1.0 - x, b, a) / b)
    out[inner] = value
    return out


def cdf(t, df) -> np.ndarray:
    """F_ν(t), Student's t CDF with ν = ``df`` degrees of freedom (broadcast)."""
    t, df = np.broadcast_arrays(np.asarray(t, dtype=float), np.asarray(df, dtype=float))
    upper = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return np.where(t >= 0, 1.0 - upper, upper)


def pdf(t, df) -> np.ndarray:
    """The density f_ν(t) = Γ((ν+1)/2) / (√(νπ) Γ(ν/2)) · (1 + t²/ν)^(−(ν+1)/2)."""
    t, df = np.broadcast_arrays(np.asarray(t, dtype=float), np.asarray(df, dtype=float))
    log_norm = -_lbeta(df / 2.0, np.full_like(df, 0.5)) - 0.5 * np.log(df)
    return np.exp(log_norm - (df + 1) / 2 * np.log1p(t * t / df))


def ppf(q, df) -> np.ndarray:
    """t_ν(q): the q-quantile of Student's t with ν = ``df`` (broadcast; 0 < q < 1).

    Newton's method on F_ν(t) = q from t = 0, kept inside a bracket [lo, hi] that bisection narrows
    whenever a Newton step would leave it (safeguarded Newton): 1e-12 relative in a few dozen steps."""
    q, df = np.broadcast_arrays(np.asarray(q, dtype=float), np.asarray(df, dtype=float))
    if np.any((q <= 0) | (q >= 1)) or np.any(df <= 0):
        raise ValueError("need 0 < q < 1 and df > 0")
    upper = np.where(q >= 0.5, q, 1.0 - q)  # solve for the upper half, mirror back
    lo, hi = np.zeros_like(upper), np.full_like(upper, 1e8)
    t = np.ones_like(upper)
    for _ in range(200):
        gap = cdf(t, df) - upper
        lo, hi = np.where(gap < 0, t, lo), np.where(gap > 0, t, hi)
        step = t - gap / np.maximum(pdf(t, df), 1e-300)
        inside = (step > lo) & (step < hi)
        new = np.where(inside, step, 0.5 * (lo + hi))
        if np.all(np.abs(new - t) <= 1e-13 * np.maximum(np.abs(t), 1.0)):
            t = new
            break
        t = new
    return np.where(q >= 0.5, t, -t)
