"""The accuracy intervals and the study that chose them: Student's t (analysis/tdist.py), the crossed
seeds × problems t-interval (analysis/crossed.py), the outcome model (analysis/outcome_model.py) and the
coverage simulation (analysis/coverage.py), run small on synthetic data.

Expected values come from closed forms (t with 1 and 2 degrees of freedom), hand-worked mean squares,
printed t tables, and Gaussian data with known variance components — not from the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import bootstrap, coverage, crossed, outcome_model, tdist
from analysis.coverage_table import USED, markdown

pytestmark = pytest.mark.unit

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


# ---- Student's t -----------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0.6, 0.975, 0.99375, 0.999])
def test_t_quantiles_match_the_closed_forms_for_one_and_two_degrees_of_freedom(q):
    # ν = 1 (Cauchy): tan(π(q − ½)); ν = 2: (2q − 1)/√(2q(1 − q))
    assert tdist.ppf(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-9)
    assert tdist.ppf(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-9)
    assert tdist.ppf(1 - q, 2) == pytest.approx(-tdist.ppf(q, 2), rel=1e-12)


def test_t_quantiles_match_printed_tables():
    # two-sided 95 % critical values (any t table): ν = 4, 9, 19, 30 and the normal limit
    got = tdist.ppf(np.full(5, 0.975), [4, 9, 19, 30, 1e7])
    assert got == pytest.approx([2.776445, 2.262157, 2.093024, 2.042272, 1.959964], abs=2e-6)
    assert tdist.cdf(tdist.ppf(0.9, 3.5), 3.5) == pytest.approx(0.9, abs=1e-12)  # non-integer ν


# ---- the crossed interval --------------------------------------------------------------------------
def test_mean_squares_by_hand():
    # y = [[1, 0, 1], [0, 0, 1]]: seed means 2/3, 1/3; problem means 1/2, 0, 1; grand 1/2
    # MS_S = 3·((1/6)² + (1/6)²)/1 = 1/6; MS_P = 2·(0 + 1/4 + 1/4)/2 = 1/2
    # residuals y − ȳ_s − ȳ_p + ȳ: ±1/3 in the first column, ±1/6 in the others: MS_R = (2/9 + 4/36)/2 = 1/6
    ms = crossed.mean_squares(np.array([[1, 0, 1], [0, 0, 1]]))
    assert ms == pytest.approx((1 / 6, 1 / 2, 1 / 6))
    est, var, nu = crossed.components(np.array([[1, 0, 1], [0, 0, 1]]))
    assert (est, nu) == (pytest.approx(0.5), 1.0)
    assert var == pytest.approx((1 / 6 + 1 / 2 - 1 / 6) / 6)  # (MS_S + MS_P − MS_R)/(mn)


def gaussian_crossed(rng, reps, m, n, s_seed, s_problem, s_resid):
    return (rng.normal(0, s_seed, (reps, m, 1)) + rng.normal(0, s_problem, (reps, 1, n))
            + rng.normal(0, s_resid, (reps, m, n)))


@pytest.mark.parametrize("m", [3, 8])
def test_crossed_variance_is_unbiased_and_the_interval_covers(m):
    """Gaussian seeds × problems data, n = 200: Var(ȳ) = σ_S²/m + σ_P²/n + σ_R²/(mn). The mean of V̂
    over 3000 data sets matches it. Where the seeds dominate (σ_S = 0.2, σ_P = 0.1, σ_R = 0.3) the 95 %
    interval holds μ = 0 in 95 % ± 1.5 of them under either degrees-of-freedom rule; where the problems
    carry as much (σ_S = 0.05, σ_P = 0.4) ν = m − 1 over-covers (conservative), never under."""
    rng = np.random.default_rng(m)
    n = 200
    for sd, seeds_dominate in (((0.2, 0.1, 0.3), True), ((0.05, 0.4, 0.3), False)):
        y = gaussian_crossed(rng, 3000, m, n, *sd)
        truth = sd[0] ** 2 / m + sd[1] ** 2 / n + sd[2] ** 2 / (m * n)
        for rule in crossed.DF_RULES:
            est, var, nu = crossed.components(y, rule)
            assert var.mean() == pytest.approx(truth, rel=0.05)
            covered = np.mean(np.abs(est) <= tdist.ppf(0.975, nu) * np.sqrt(var))
            if seeds_dominate:
                assert covered == pytest.approx(0.95, abs=0.015), (sd, rule)
            elif rule == "seeds":
                assert covered >= 0.95, sd
    one = crossed.interval(y[0])  # the scalar path agrees with the batched one
    assert one.se**2 == pytest.approx(crossed.components(y[0])[1]) and one.df == m - 1


def test_without_the_problem_component_the_interval_is_too_narrow():
    """The same data where the problems carry most of the variance: the per-seed t-interval alone
    (the problem term dropped) covers far less than 95 % — the term is needed."""
    rng = np.random.default_rng(1)
    y = gaussian_crossed(rng, 2000, 5, 100, 0.01, 0.5, 0.2)
    est, var, nu = crossed.components(y)
    seed_only = y.mean(axis=2).var(axis=1, ddof=1) / 5
    assert np.mean(np.abs(est) <= tdist.ppf(0.975, nu) * np.sqrt(seed_only)) < 0.5
    assert np.mean(np.abs(est) <= tdist.ppf(0.975, nu) * np.sqrt(var)) > 0.93


def test_one_seed_has_no_interval_and_counts_fall_back_conservatively():
    assert math.isnan(crossed.interval(np.ones((1, 5))).low)
    assert math.isnan(crossed.from_counts([300], [500]).high)
    # accuracies 0.6, 0.62, 0.64: s² = 0.0004, p̄ = 0.62 -> V̂ = 0.0004/3 + 0.62·0.38/500, ν = 2
    got = crossed.from_counts([300, 310, 320], [500] * 3)
    assert got.se**2 == pytest.approx(0.0004 / 3 + 0.62 * 0.38 / 500) and got.df == 2
    diff = crossed.difference(got, crossed.from_counts([250, 250, 260, 270], [500] * 4))
    assert diff.df == 2 and diff.se > got.se and diff.estimate == pytest.approx(0.62 - 0.5150)


# ---- the outcome model -----------------------------------------------------------------------------
MODEL = outcome_model.OutcomeModel(alpha_ref=1.5, alpha_other=1.2, sigma_seed=0.3, sigma_problem=2.0,
                                   sigma_method_problem=0.5)


def test_population_truth_matches_the_simulated_mean():
    sim = MODEL.simulate(np.random.default_rng(0), seeds=20, problems=400, replicates=30)
    assert sim["ref"].mean() == pytest.approx(MODEL.accuracy(False), abs=0.01)
    assert (sim["other"].mean() - sim["ref"].mean()) == pytest.approx(MODEL.difference(), abs=0.01)
    assert sim["fixed_difference"].mean() == pytest.approx(MODEL.difference(), abs=0.01)


def test_fit_recovers_the_problem_parameters():
    sim = MODEL.simulate(np.random.default_rng(3), seeds=4, problems=800, replicates=1)
    got = outcome_model.fit(sim["ref"][0], sim["other"][0], nodes=12)
    assert got.sigma_problem == pytest.approx(2.0, rel=0.2)
    assert got.sigma_method_problem == pytest.approx(0.5, abs=0.3)
    assert got.difference() == pytest.approx(sim["other"].mean() - sim["ref"].mean(), abs=0.02)


# ---- the study -------------------------------------------------------------------------------------
def test_resampled_statistics_of_the_identity_draw_are_the_data_s():
    d = (MODEL.simulate(np.random.default_rng(2), 4, 60, 1)["other"][0].astype(int)
         - MODEL.simulate(np.random.default_rng(3), 4, 60, 1)["ref"][0])
    star, se = coverage.resampled(d, np.ones((1, 60)), np.ones((1, 4)))
    est, var, _ = crossed.components(d)
    assert star[0] == pytest.approx(est) and se[0] == pytest.approx(math.sqrt(var))


def test_the_study_s_percentile_bootstrap_is_the_tables_bootstrap():
    rng = np.random.default_rng(4)
    sim = MODEL.simulate(rng, 4, 300, 1)
    d = sim["other"][0].astype(int) - sim["ref"][0]
    mine = coverage.boot_difference(d, rng, (0.95,), 4000)["bootstrap"][0.95]
    theirs = bootstrap.paired_difference(d, key="x", n_boot=4000)
    assert mine == pytest.approx((theirs.low, theirs.high), abs=0.006)


def test_a_small_study_runs_and_its_rule_picks_a_covering_interval():
    rows = coverage.simulate(MODEL, problems=80, replicates=40, boot=60, seed_counts=(3, 5), log=lambda s: None)
    assert set(rows["interval"]) == {"t", "satterthwaite", "bootstrap", "studentized"}
    # levels × seed counts × candidates: 4 for Δ + 3 for a cell where the bootstraps run (2 scenarios), 2 + 2 else
    assert len(rows) == 2 * 2 * (7 + 7 + 4)
    assert rows["coverage"].between(0, 1).all() and (rows["replicates"] == 40).all()
    t = rows[(rows["interval"] == "t") & (rows["scenario"] == "fitted")]
    assert t["coverage"].min() > 0.8
    assert "**Choice**" in markdown(rows, MODEL, ["a", "b"], "python -m analysis.coverage x", "abc-dirty")


def test_choose_takes_the_narrowest_that_covers_everywhere():
    def rows(name, cover, width):
        return [{"scenario": "fitted", "quantity": q, "interval": name, "seeds": m, "level": lv, "coverage": cover,
                 "median_width_pp": width} for q in ("difference", "accuracy") for m in (3, 5)
                for lv in coverage.LEVELS]
    table = pd.DataFrame(rows("narrow_but_short", 0.90, 1.0) + rows("wide", 0.999, 9.0) + rows("middle", 0.99, 5.0))
    assert coverage.choose(table) == "middle"
    table.loc[(table["interval"] == "middle") & (table["seeds"] == 5), "coverage"] = 0.92
    assert coverage.choose(table) == "wide"


def test_the_tables_use_the_interval_the_committed_study_chose():
    path = REPO / "results" / "cpu" / "tables" / "coverage.csv"
    rows = pd.read_csv(path)
    assert coverage.choose(rows) == USED[crossed.DF], f"{path} chose another interval than analysis/crossed.py DF"
    sha = rows["git_sha"].iloc[0]
    assert len(sha.removesuffix("-dirty")) == 40  # the full sha, its -dirty marker kept
