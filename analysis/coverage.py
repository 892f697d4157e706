"""How often each candidate accuracy interval covers the truth, by simulation from a model fitted to the
committed runs: the study that chose ``analysis/crossed.py``'s interval.

    python -m analysis.coverage results/cpu     # -> <root>/tables/coverage.md and coverage.csv
        [--replicates 1000] [--boot 500] [--seed 0] [--out DIR]

Ground truth: ``analysis/outcome_model.py`` (per-problem logit difficulty, a method × problem logit for
logra, a logit shift per seed and method, Bernoulli outcomes), fitted by maximum marginal likelihood
to the dense and logra cells of the seed study's configuration (``analysis/seeds.py``) among the root's
runs with seeds below the study's (seeds 0–2 in results/cpu): the study's own seeds never chose its
interval. Each replicate draws fresh problems (n as in the runs), fresh seeds and both methods'
outcomes. The estimands are population means over seeds **and** problems (a paired difference over
seeds × problems: the 500 held-out problems are a sample of the task's): Δ = A_logra − A_dense, and a
cell's accuracy A_dense. Coverage = the share of replicates whose interval holds the
truth; ``fixed`` = the same against the mean over the replicate's own problems (seeds' population only).

Candidates (``CANDIDATES``), for Δ on the paired differences d = x_logra − x_dense (seeds × problems):
``bootstrap`` the percentile bootstrap of ``analysis/bootstrap.py`` (seeds with replacement, the
problems once with replacement, the same draw for both methods); ``studentized`` the bootstrap-t:
t* = (Δ* − Δ̂)/SE*, SE* the crossed standard error (``analysis/crossed.py``) of the resampled data,
interval [Δ̂ − q_{1−α/2}(t*)·SE, Δ̂ − q_{α/2}(t*)·SE] (Davison & Hinkley 1997, §5.2); ``t`` the
t-interval on the per-seed means with the problem component added, ν = m − 1; ``satterthwaite`` the
same variance with Satterthwaite's ν (the variance-components interval of the balanced crossed design,
whose ANOVA estimates are the REML ones where positive). For a cell's accuracy on its 0/1 outcomes:
``bootstrap`` the two-stage bootstrap of ``analysis/bootstrap.py`` (seeds, then each drawn run's
problems), ``t`` and ``satterthwaite``. Bootstraps draw ``--boot`` replicates (the tables use 10,000).

Scenarios: the fitted model, and its seed spread σ_u doubled and halved (σ_u comes from 3 seeds per
method); the bootstraps run in the fitted and the doubled one only (their cost). Choice
(:func:`choose`): of the candidates whose coverage is at least nominal − ``SLACK`` (93 % at 95 %, 96.75 %
at 98.75 %) at every seed count, level and scenario they ran in, the narrowest (median width at 95 %,
summed over the seed counts, fitted scenario) — per quantity, and one for both (the tables use one). Monte Carlo error of a coverage c: √(c(1 − c)/R), 0.7 points at c = 0.95 and
R = 1000.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import bootstrap, crossed, outcome_model, seeds
from analysis.cli import root_cli

SEED_COUNTS = (3, 5, 10, 20)
LEVELS = (0.95, seeds.LEVEL)  # the tables' level and each look's of the seed study
SCENARIOS = {"fitted": 1.0, "seed spread ×2": 2.0, "seed spread ×½": 0.5}  # σ_u factor
BOOT_SCENARIOS = ("fitted", "seed spread ×2")  # where the bootstraps run too (their cost)
SLACK = 0.02  # coverage may fall this far below nominal
REPLICATES, BOOT, SEED = 1000, 500, 0
BATCH = 100  # replicates simulated at once
LABELS = {"bootstrap": "percentile bootstrap (the tables' until now)", "studentized": "studentized bootstrap",
          "t": "t on per-seed means + problem component, ν = m − 1",
          "satterthwaite": "variance components, Satterthwaite ν"}


def _counts(rng: np.random.Generator, size: int, boot: int) -> np.ndarray:
    """(boot, size): how often each of ``size`` items is drawn in ``size`` draws with replacement."""
    idx = rng.integers(0, size, (boot, size)) + size * np.arange(boot)[:, None]
    return np.bincount(idx.ravel(), minlength=boot * size).reshape(boot, size).astype(float)


def resampled(d: np.ndarray, c: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Δ*, SE*) of bootstrap replicates of a paired (m, n) data set ``d``: replicate b draws problem p
    c[b, p] times and seed s w[b, s] times; SE* is ``crossed``'s √V̂ of the resampled data. Problems where
    every seed's d is 0 add 0 to every sum but the problem term's c_p·Δ*², so the sums skip them."""
    d = np.asarray(d, dtype=float)  # float: the products below go through BLAS
    m, n = d.shape
    live = np.flatnonzero((d != 0).any(axis=0))
    c, dl = c[:, live], d[:, live]
    c_zero = n - c.sum(axis=1)  # draws of the all-zero problems
    per_seed = c @ dl.T / n  # (boot, m): each seed's mean on the drawn problems
    star = (w * per_seed).sum(axis=1) / m
    problem_means = w @ dl / m  # (boot, live): each problem's mean over the drawn seeds
    ss_seed = n * (w * (per_seed - star[:, None]) ** 2).sum(axis=1)
    ms_problem = m * ((c * (problem_means - star[:, None]) ** 2).sum(axis=1) + c_zero * star**2) / (n - 1)
    ss_resid = (c * (w @ (dl * dl) - m * problem_means**2)).sum(axis=1) - ss_seed
    ms_seed, ms_resid = ss_seed / (m - 1), ss_resid / ((m - 1) * (n - 1))
    return star, np.sqrt((np.maximum(ms_seed, ms_resid) + np.maximum(ms_problem - ms_resid, 0.0)) / (m * n))


def boot_difference(d: np.ndarray, rng: np.random.Generator, levels, boot: int) -> dict[str, dict]:
    """The percentile and the studentized bootstrap of one (m, n) paired data set, from one set of draws
    (module docstring): ``{name: {level: (low, high)}}``."""
    m, n = d.shape
    star, se_star = resampled(d, _counts(rng, n, boot), _counts(rng, m, boot))
    estimate, variance, _ = crossed.components(d)
    se = float(np.sqrt(variance))
    with np.errstate(divide="ignore", invalid="ignore"):
        t_star = np.nan_to_num((star - estimate) / se_star, nan=0.0)
    out = {"bootstrap": {}, "studentized": {}}
    for level in levels:
        tail = 100 * (1 - level) / 2
        lo, hi = np.percentile(star, [tail, 100 - tail])
        out["bootstrap"][level] = (lo, hi)
        q_lo, q_hi = np.percentile(t_star, [tail, 100 - tail])
        out["studentized"][level] = (estimate - q_hi * se, estimate - q_lo * se)
    return out


def boot_cell(y: np.ndarray, rng: np.random.Generator, levels, boot: int) -> dict[str, dict]:
    """The tables' two-stage bootstrap of a cell (``bootstrap.replicates``) on one (m, n) outcome set."""
    m, n = y.shape
    reps = bootstrap.replicates(y.sum(axis=1), np.full(m, n), rng, boot)
    return {"bootstrap": {lv: tuple(np.percentile(reps, [50 * (1 - lv), 100 - 50 * (1 - lv)])) for lv in levels}}


@functools.lru_cache(maxsize=None)
def _quantile_grid(level: float) -> tuple[np.ndarray, np.ndarray]:
    """t_ν((1 + level)/2) on a grid of log ν from 1 to 10⁶ (interpolated: error below 1e-5 relative)."""
    from analysis import tdist

    log_nu = np.linspace(0.0, 6.0, 601)
    return log_nu, tdist.ppf(np.full(log_nu.shape, (1 + level) / 2), 10.0**log_nu)


def t_family(stack: np.ndarray, levels) -> dict[str, dict]:
    """``t`` and ``satterthwaite`` (``analysis/crossed.py``) on a (replicates, m, n) stack at once."""
    out = {}
    for name, rule in (("t", "seeds"), ("satterthwaite", "satterthwaite")):
        estimate, variance, nu = crossed.components(stack, rule)
        out[name] = {}
        for lv in levels:
            half = np.interp(np.log10(nu), *_quantile_grid(lv)) * np.sqrt(variance)
            out[name][lv] = (estimate - half, estimate + half)
    return out


# quantity -> (the data of a replicate, the per-replicate bootstrap, the truths' keys)
CANDIDATES = {
    "difference": (lambda sim: sim["other"].astype(np.int16) - sim["ref"], boot_difference, "fixed_difference"),
    "accuracy": (lambda sim: sim["ref"].astype(np.int16), boot_cell, "fixed_accuracy"),
}


def simulate(model: outcome_model.OutcomeModel, problems: int, replicates: int = REPLICATES, boot: int = BOOT,
             seed: int = SEED, seed_counts=SEED_COUNTS, log=print) -> pd.DataFrame:
    """Coverage rows: per scenario, quantity, candidate, seed count and level (module docstring)."""
    rows = []
    for s_i, (scenario, factor) in enumerate(SCENARIOS.items()):
        truth = model.scaled(factor)
        population = {"difference": truth.difference(), "accuracy": truth.accuracy(False)}
        for m in seed_counts:
            started = time.time()
            rng = np.random.default_rng([seed, s_i, m])
            found = defaultdict(lambda: defaultdict(list))  # (quantity, name) -> level -> [(lo, hi, fixed)]
            for start in range(0, replicates, BATCH):
                sim = truth.simulate(rng, m, problems, min(BATCH, replicates - start))
                for quantity, (data, boot_fn, fixed_key) in CANDIDATES.items():
                    stack, fixed = data(sim), sim[fixed_key]
                    for name, by_level in t_family(stack, LEVELS).items():
                        for lv, (lo, hi) in by_level.items():
                            found[(quantity, name)][lv] += list(zip(lo, hi, fixed))
                    if scenario not in BOOT_SCENARIOS:
                        continue
                    for i in range(len(stack)):
                        for name, by_level in boot_fn(stack[i], rng, LEVELS, boot).items():
                            for lv, (lo, hi) in by_level.items():
                                found[(quantity, name)][lv].append((lo, hi, fixed[i]))
            for (quantity, name), by_level in found.items():
                for lv, got in by_level.items():
                    lo, hi, fixed = map(np.asarray, zip(*got))
                    truth_pop = population[quantity]
                    rows.append({"scenario": scenario, "quantity": quantity, "interval": name, "seeds": m,
                                 "level": lv, "coverage": float(np.mean((lo <= truth_pop) & (truth_pop <= hi))),
                                 "coverage_fixed": float(np.mean((lo <= fixed) & (fixed <= hi))),
                                 "median_width_pp": float(100 * np.median(hi - lo)), "replicates": len(lo),
                                 "boot": boot if name in ("bootstrap", "studentized") else 0})
            log(f"[coverage] {scenario}, {m} seeds: {time.time() - started:.0f} s")
    table = pd.DataFrame(rows)
    table.attrs["problems"] = problems
    return table


def choose(rows: pd.DataFrame, quantities=tuple(CANDIDATES)) -> str | None:
    """The interval chosen for every one of ``quantities`` by the rule of the module docstring (a
    candidate must pass for each), or None if none passes."""
    of = rows[rows["quantity"].isin(quantities)]
    passing = [name for name, g in of.groupby("interval")
               if set(g["quantity"]) == set(quantities) and (g["coverage"] >= g["level"] - SLACK - 1e-12).all()]
    if not passing:
        return None
    fitted = of[(of["scenario"] == "fitted") & (of["level"] == LEVELS[0])]
    return min(passing, key=lambda name: fitted[fitted["interval"] == name]["median_width_pp"].sum())


def fit_data(root: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The reference's and the method's outcomes (seeds × problems, problems in id order) of the study's
    configuration among the root's runs with seeds below the study's; and the runs used."""
    from analysis.accuracy import per_run_accuracy
    from analysis.load import load_runs

    runs = load_runs(root)
    members = seeds.membership(runs)
    _, grid = seeds.study_configs()
    used = members[members["matches"] & members["done"] & (members["seed"] < min(grid))]
    per, dirs = per_run_accuracy(runs), runs.drop_duplicates("run").set_index("run")["run_dir"]
    arrays = {}
    for method in (seeds.REFERENCE, seeds.METHOD):
        rows = []
        for run in used[used["method"] == method].sort_values("seed")["run"]:
            r = per.loc[run]
            found = outcomes_of(dirs[run], int(r["end_step"]))
            rows.append([found[i] for i in sorted(found)])
        if len(rows) < 2:
            raise SystemExit(f"{root}: fewer than 2 done {method} runs of the study's configuration below seed {min(grid)}")
        arrays[method] = np.array(rows, dtype=np.int8)
    return arrays[seeds.REFERENCE], arrays[seeds.METHOD], sorted(used["run"])


def outcomes_of(run_dir, step: int) -> dict[str, int]:
    from analysis.outcomes import read_step

    found = read_step(run_dir, step)
    if found is None:
        raise SystemExit(f"{run_dir}: no per-problem outcomes at step {step}")
    return found


def main(argv=None) -> int:
    from analysis.coverage_table import write

    args = root_cli("python -m analysis.coverage", __doc__, argv, extra=[
        ("--replicates", {"type": int, "default": REPLICATES, "help": "simulated data sets per cell of the table"}),
        ("--boot", {"type": int, "default": BOOT, "help": "bootstrap replicates per data set"}),
        ("--seed", {"type": int, "default": SEED, "help": "the simulation's seed"}),
        ("--out", {"type": Path, "help": "write coverage.md and coverage.csv here instead of <root>/tables"})])
    from experiments.common.provenance import git_sha

    sha = git_sha()  # of the code that runs, taken before it runs
    ref, other, used = fit_data(args.root)
    model = outcome_model.fit(ref, other)
    print(f"[coverage] fitted to {len(used)} runs: {model}")
    rows = simulate(model, ref.shape[1], args.replicates, args.boot, args.seed)
    command = "python -m analysis.coverage " + " ".join(sys.argv[1:] if argv is None else argv)
    for path in write(args.out or args.root / "tables", rows, model, used, command, sha):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
