"""Intervals for a mean over seeds × problems: a cell's accuracy and the paired difference of two cells.

Data y[s, p] for seeds s = 1..m and problems p = 1..n, every seed evaluated on the same n problems: a
cell's 0/1 outcomes (greedy pass@1 per problem), or for a paired difference of two cells run on the
same seeds d[s, p] = x^a[s, p] − x^b[s, p] ∈ {−1, 0, 1}. The two-way random-effects model of a
crossed design (seeds and problems both sampled; Searle, Casella & McCulloch 1992, §4.6):

    y[s, p] = μ + S_s + P_p + R_sp,   S ~ (0, σ²_S), P ~ (0, σ²_P), R ~ (0, σ²_R), independent.

The estimand is μ: the mean over the population of training seeds **and** the population of problems
of the task (the 500 held-out problems are a sample of the generator's problems). The estimate
ȳ = (1/mn) Σ_sp y[s, p] has Var(ȳ) = σ²_S/m + σ²_P/n + σ²_R/(mn). With the ANOVA mean squares

    MS_S = n/(m−1) · Σ_s (ȳ_s· − ȳ)²,   MS_P = m/(n−1) · Σ_p (ȳ_·p − ȳ)²,
    MS_R = Σ_sp (y[s, p] − ȳ_s· − ȳ_·p + ȳ)² / ((m−1)(n−1)),

E[MS_S] = σ²_R + n σ²_S, E[MS_P] = σ²_R + m σ²_P, E[MS_R] = σ²_R. With each variance component
estimated from them and clipped at 0 (Searle, Casella & McCulloch 1992, §4.8),

    V̂ = σ̂²_S/m + σ̂²_P/n + σ̂²_R/(mn) = (max(MS_S, MS_R) + max(0, MS_P − MS_R)) / (mn)
       = s²_seed/m + σ̂²_P/n   where MS_S ≥ MS_R (s²_seed = MS_S/n, the variance of the per-seed means ȳ_s·),

unbiased for Var(ȳ) where neither clip acts (a clip only widens it; the first keeps V̂ at least the
residual noise σ̂²_R/(mn) when the seeds' means happen to agree): the t-interval on the per-seed means
with the problem component added. The interval is ȳ ± t_ν(1 − α/2) · √V̂ with ν = m − 1 (the
seed term's degrees of freedom: ``DF``; ``satterthwaite`` gives Satterthwaite's 1946 ν for
(MS_S + MS_P − MS_R)/(mn), the variance-components interval). ``analysis/coverage.py`` measures the
coverage of both, and of the bootstraps, by simulation; results/cpu/tables/coverage.md holds it.

Where the per-problem outcomes are absent, a cell's interval comes from its per-seed accuracies alone
(:func:`from_counts`): V̂ = s²_seed/m + p̄(1 − p̄)/n̄, the problem term bounded by the binomial
variance (σ²_P ≤ p(1 − p): conservative). Two cells without a pairing differ by :func:`difference`:
V̂_a + V̂_b, ν = min(ν_a, ν_b) (conservative: cells on the same problems are positively correlated).
One seed gives no interval (NaN): the seed component cannot be estimated from one value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis import tdist

LEVEL = 0.95  # the tables' coverage
DF = "seeds"  # ν = m − 1; the coverage study's choice (results/cpu/tables/coverage.md)
DF_RULES = ("seeds", "satterthwaite")


@dataclass(frozen=True)
class Interval:
    """A point estimate, its interval at ``level``, the standard error √V̂ and the t's degrees of
    freedom ν (NaN bounds with one seed)."""

    estimate: float
    low: float
    high: float
    se: float = math.nan
    df: float = math.nan
    level: float = LEVEL

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def clipped(self, low: float, high: float) -> "Interval":
        """The interval cut to the values the estimand can take (an accuracy lies in [0, 1], a difference
        of two in [−1, 1]): its coverage is unchanged."""
        return Interval(self.estimate, max(self.low, low), min(self.high, high), self.se, self.df, self.level)


def mean_squares(y) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(MS_S, MS_P, MS_R) of a (..., seeds, problems) array (module docstring; leading axes are
    independent data sets); m ≥ 2 and n ≥ 2."""
    y = np.asarray(y, dtype=float)
    m, n = y.shape[-2:]
    if m < 2 or n < 2:
        raise ValueError(f"need at least 2 seeds and 2 problems, got {y.shape}")
    seed_means, problem_means = y.mean(axis=-1), y.mean(axis=-2)
    grand = seed_means.mean(axis=-1)
    ms_seed = n * ((seed_means - grand[..., None]) ** 2).sum(axis=-1) / (m - 1)
    ms_problem = m * ((problem_means - grand[..., None]) ** 2).sum(axis=-1) / (n - 1)
    resid = y - seed_means[..., :, None] - problem_means[..., None, :] + grand[..., None, None]
    ms_resid = (resid**2).sum(axis=(-2, -1)) / ((m - 1) * (n - 1))
    return ms_seed, ms_problem, ms_resid


def components(y, df: str = DF) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ȳ, V̂, ν) of a (..., seeds, problems) array: the mean, its variance estimate
    (max(MS_S, MS_R) + max(0, MS_P − MS_R))/(mn) and the degrees of freedom by ``df`` (``DF_RULES``;
    Satterthwaite's ν is that of MS_S + MS_P − MS_R)."""
    if df not in DF_RULES:
        raise ValueError(f"df must be one of {DF_RULES}, got {df!r}")
    y = np.asarray(y, dtype=float)
    m, n = y.shape[-2:]
    ms_seed, ms_problem, ms_resid = mean_squares(y)
    problem = np.maximum(ms_problem - ms_resid, 0.0)
    variance = (np.maximum(ms_seed, ms_resid) + problem) / (m * n)
    if df == "seeds":
        nu = np.full_like(variance, m - 1.0)
    else:  # Satterthwaite (1946) for the linear combination of independent mean squares
        parts = ms_seed**2 / (m - 1) + ms_problem**2 / (n - 1) + ms_resid**2 / ((m - 1) * (n - 1))
        nu = np.where(parts > 0, (ms_seed + problem) ** 2 / np.where(parts > 0, parts, 1.0), m - 1.0)
    return y.mean(axis=(-2, -1)), variance, nu


def t_interval(estimate: float, variance: float, df: float, level: float = LEVEL) -> Interval:
    """estimate ± t_ν((1 + level)/2) · √variance."""
    if not (df > 0) or not math.isfinite(variance):
        return Interval(estimate, math.nan, math.nan, math.nan, df, level)
    se = math.sqrt(max(variance, 0.0))
    half = float(tdist.ppf((1 + level) / 2, df)) * se
    return Interval(estimate, estimate - half, estimate + half, se, df, level)


def interval(y, level: float = LEVEL, df: str = DF) -> Interval:
    """The mean of ``y`` (seeds × problems) with the crossed-design t-interval of the module docstring."""
    y = np.asarray(y, dtype=float)
    if y.ndim != 2 or 0 in y.shape:
        raise ValueError(f"need a (seeds, problems) array, got shape {y.shape}")
    if y.shape[0] < 2:
        return Interval(float(y.mean()), math.nan, math.nan, level=level)
    estimate, variance, nu = components(y, df)
    return t_interval(float(estimate), float(variance), float(nu), level)


def from_counts(correct, problems, level: float = LEVEL) -> Interval:
    """A cell's mean accuracy from its runs' counts alone (k_s correct of n_s): V̂ = s²/m + p̄(1 − p̄)/n̄,
    ν = m − 1."""
    k, n = np.asarray(correct, dtype=float), np.asarray(problems, dtype=float)
    if k.ndim != 1 or k.shape != n.shape or k.size == 0 or (n < 1).any() or (k < 0).any() or (k > n).any():
        raise ValueError(f"need one (correct <= problems) pair per run, got {k} and {n}")
    acc = k / n
    estimate = float(acc.mean())
    if acc.size < 2:
        return Interval(estimate, math.nan, math.nan, level=level)
    variance = acc.var(ddof=1) / acc.size + estimate * (1 - estimate) / n.mean()
    return t_interval(estimate, float(variance), float(acc.size - 1), level)


def difference(a: Interval, b: Interval, level: float = LEVEL) -> Interval:
    """a − b of two cells' intervals computed apart: V̂ = se_a² + se_b², ν = min(ν_a, ν_b)."""
    return t_interval(a.estimate - b.estimate, a.se**2 + b.se**2, min(a.df, b.df), level)
