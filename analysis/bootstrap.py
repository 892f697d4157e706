"""The bootstrap behind every accuracy interval: resample the seeds, then the held-out problems.

A cell (one task × method variant) has m runs (seeds); run j answered k_j of its n_j held-out
problems correctly (greedy pass@1, ``eval/accuracy`` · ``eval/num_problems``). Its accuracy is the
mean over seeds, â = (1/m) Σ_j k_j / n_j. One bootstrap replicate of â is drawn in two stages
(a hierarchical, "cases at both levels" bootstrap; Davison & Hinkley 1997, §3.8):

1. seeds: draw m runs j*_1 … j*_m uniformly with replacement from the cell's m runs;
2. problems: for each drawn run, draw its n_j problems with replacement from its own 0/1 outcomes.
   The count of correct answers in such a draw is Binomial(n_j, k_j / n_j), so it is drawn as that
   (exactly the same distribution as resampling the outcome vector, which the runs do not log).

â* = (1/m) Σ_i X_i / n_{j*_i} with X_i ~ Binomial(n_{j*_i}, k_{j*_i} / n_{j*_i}). The 95 % interval
is the percentile interval [q_2.5, q_97.5] of B replicates (``N_BOOT``).

A difference between two cells (Δ = a − b, e.g. logra − dense) is bootstrapped one of two ways:

- paired (:func:`paired_difference`), when both cells' runs logged per-problem outcomes of their
  final evaluation (``analysis/outcomes.py``) on the same seeds and problems: with
  d_s = x^a_s − x^b_s ∈ {−1, 0, 1}^n the two runs of seed s compared problem by problem,
  Δ = (1/m) Σ_s (1/n) Σ_p d_s[p], and one replicate draws m seeds s*_1 … s*_m with replacement and,
  once, n problems p*_1 … p*_n with replacement, the same for both methods and every drawn seed:
  Δ* = (1/m) Σ_i (1/n) Σ_j d_{s*_i}[p*_j] (seeds and problems crossed, both resampled: the two-way
  bootstrap of a crossed design; McCullagh 2000, Owen 2007). Problem j is the j-th in id order of each
  seed's problems — the same problem in every run when all evaluated the whole held-out split.
  A problem both methods solve, or both miss, adds nothing to Δ* whichever replicate draws it, so
  the interval reflects only the problems on which they disagree;
- unpaired (:func:`difference_interval`) otherwise: the difference of the two cells' replicates
  above, drawn independently. Cells that evaluate the same problems are positively correlated
  problem by problem; resampling them independently ignores that and widens Δ's interval
  (conservative).

Caveats, stated with every table that uses this: with 3 seeds the seed stage can only spread what
3 values spread (a percentile bootstrap over few seeds is too narrow more often than 5 %); with one
seed it is the problems' interval alone.

Reproducible: each cell's (and each paired difference's) replicates come from
``numpy.random.default_rng([SEED, crc32(key)])``, so an interval depends on its own runs and name
only, not on which other cells are drawn or in what order.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

N_BOOT = 10_000  # replicates per cell
SEED = 0  # the bootstrap's seed (with the cell's name: one generator per cell)
LEVEL = 0.95  # interval coverage


@dataclass(frozen=True)
class Interval:
    """A point estimate and its percentile interval."""

    estimate: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def generator(key: str, seed: int = SEED) -> np.random.Generator:
    """The cell's own generator: seeded by (seed, crc32 of the cell's name)."""
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def replicates(correct, problems, rng: np.random.Generator, n_boot: int = N_BOOT) -> np.ndarray:
    """B bootstrap replicates of the mean accuracy over seeds (module docstring), shape (n_boot,).

    ``correct[j]``, ``problems[j]``: run j's correct answers k_j and problems n_j (k_j ≤ n_j, n_j ≥ 1).
    """
    k = np.asarray(correct, dtype=float)
    n = np.asarray(problems, dtype=np.int64)
    if k.ndim != 1 or k.shape != n.shape or k.size == 0:
        raise ValueError(f"need one (correct, problems) pair per run, got {k.shape} and {n.shape}")
    if (n < 1).any() or (k < 0).any() or (k > n).any():
        raise ValueError(f"need 0 <= correct <= problems and problems >= 1, got correct={k}, problems={n}")
    m = k.size
    seeds = rng.integers(0, m, size=(n_boot, m))  # stage 1: m runs with replacement per replicate
    draws = rng.binomial(n[seeds], k[seeds] / n[seeds])  # stage 2: the problems of each drawn run
    return (draws / n[seeds]).mean(axis=1)


def percentile_interval(estimate: float, reps: np.ndarray, level: float = LEVEL) -> Interval:
    """``estimate`` with the [(1 − level)/2, (1 + level)/2] quantiles of ``reps``."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(reps, [tail, 100 - tail])
    return Interval(float(estimate), float(low), float(high))


def mean_interval(correct, problems, key: str, n_boot: int = N_BOOT, seed: int = SEED) -> tuple[Interval, np.ndarray]:
    """The cell's mean accuracy over seeds with its 95 % interval, and the replicates (for differences)."""
    reps = replicates(correct, problems, generator(key, seed), n_boot)
    estimate = float(np.mean(np.asarray(correct, dtype=float) / np.asarray(problems, dtype=float)))
    return percentile_interval(estimate, reps), reps


def difference_interval(a: tuple[Interval, np.ndarray], b: tuple[Interval, np.ndarray]) -> Interval:
    """a − b (estimate and replicates of :func:`mean_interval`) with its 95 % percentile interval."""
    return percentile_interval(a[0].estimate - b[0].estimate, a[1] - b[1])


def paired_difference(diffs, key: str, n_boot: int = N_BOOT, seed: int = SEED) -> Interval:
    """Δ = mean over seeds and problems of ``diffs`` with its paired 95 % interval (module docstring).

    ``diffs[s, p]`` = x^a − x^b ∈ {−1, 0, 1} for seed s (row) and problem p (column), e.g.
    ``outcomes.pair``'s."""
    d = np.asarray(diffs, dtype=float)
    if d.ndim != 2 or 0 in d.shape:
        raise ValueError(f"need a (seeds, problems) array of differences, got shape {d.shape}")
    if not np.isin(d, (-1.0, 0.0, 1.0)).all():
        raise ValueError("differences of 0/1 outcomes must be -1, 0 or 1")
    m, n = d.shape
    rng = generator(key, seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)  # problems: how often each is drawn, once per replicate
    per_seed = counts @ d.T / n  # (n_boot, m): every seed's Δ on the replicate's problems
    seeds = rng.integers(0, m, size=(n_boot, m))  # seeds with replacement, the same for both methods
    reps = np.take_along_axis(per_seed, seeds, axis=1).mean(axis=1)
    return percentile_interval(float(d.mean()), reps)
