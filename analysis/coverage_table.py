"""The coverage study's files: ``tables/coverage.csv`` (one row per scenario × quantity × interval × seed
count × level, with the git sha and the command that made it) and ``tables/coverage.md`` (the fitted
model, coverage per seed count at both levels, the widths, the sensitivity scenarios and the choice).
See ``analysis/coverage.py`` for what the numbers are."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import coverage, crossed
from analysis.outcome_model import OutcomeModel

USED = {"seeds": "t", "satterthwaite": "satterthwaite"}  # crossed.DF -> the candidate it is
QUANTITIES = {"difference": "Δ = logra − dense, paired over seeds × problems",
              "accuracy": "a cell's accuracy (dense)"}


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def _grid(rows: pd.DataFrame, value: str, fmt) -> list[str]:
    """Markdown lines: one row per (interval, level), one column per seed count."""
    counts = sorted(rows["seeds"].unique())
    lines = ["| interval | level | " + " | ".join(f"{m} seeds" for m in counts) + " |",
             "|---|---|" + "---:|" * len(counts)]
    for (name, level), g in rows.groupby(["interval", "level"], sort=False):
        by = g.set_index("seeds")[value]
        lines.append(f"| {coverage.LABELS[name]} | {100 * level:.2f} % | " + " | ".join(fmt(by[m]) for m in counts) + " |")
    return lines


def markdown(rows: pd.DataFrame, model: OutcomeModel, used: list[str], command: str, sha: str) -> str:
    fitted = rows[rows["scenario"] == "fitted"]
    reps = int(rows["replicates"].max())
    boot = int(rows["boot"].max())
    lines = ["# Coverage of the accuracy intervals over seeds × problems, by simulation", "",
             f"`{command}` at git sha {sha}: {reps:,} simulated data sets per row, {boot:,} bootstrap replicates "
             f"per data set (bootstrap rows only), {int(rows.attrs.get('problems', 500))} problems per run; the "
             f"model (analysis/outcome_model.py) fitted to {len(used)} runs: {', '.join(used)}.", "",
             f"Fitted: α_dense {model.alpha_ref:.3f}, α_logra {model.alpha_other:.3f} (logit of a median problem), "
             f"seed spread σ_u {model.sigma_seed:.3f}, problem difficulty σ_a {model.sigma_problem:.3f}, method × "
             f"problem σ_c {model.sigma_method_problem:.3f}; population truth A_dense {_pct(model.accuracy(False))} %, "
             f"A_logra {_pct(model.accuracy(True))} %, Δ {100 * model.difference():+.2f} points.", ""]
    for quantity, title in QUANTITIES.items():
        of = fitted[fitted["quantity"] == quantity]
        lines += [f"**{title}: coverage (%) of the population value, fitted model**", ""]
        lines += _grid(of, "coverage", _pct) + [""]
        lines += [f"Median width (points), same rows:", ""] + _grid(of, "median_width_pp", lambda v: f"{v:.1f}") + [""]
        lines += [f"Coverage (%) of the mean over the replicate's own problems (seeds' population only):", ""]
        lines += _grid(of, "coverage_fixed", _pct) + [""]
    for scenario in [s for s in coverage.SCENARIOS if s != "fitted"]:
        of = rows[rows["scenario"] == scenario]
        lines += [f"**Sensitivity, {scenario} (σ_u {coverage.SCENARIOS[scenario]:g} × fitted): coverage (%) of the "
                  "population value**", ""]
        for quantity, title in QUANTITIES.items():
            lines += [f"{title}:", ""] + _grid(of[of["quantity"] == quantity], "coverage", _pct) + [""]
    chosen = {q: coverage.choose(rows, (q,)) for q in QUANTITIES}
    both = coverage.choose(rows)
    lines += ["**Choice** (analysis/coverage.py `choose`: coverage ≥ nominal − "
              f"{100 * coverage.SLACK:g} points at every seed count, level and scenario run; then the narrowest at 95 %):",
              ""]
    lines += [f"- {QUANTITIES[q]}: {coverage.LABELS[c] if c else 'none passes'}" for q, c in chosen.items()]
    lines += [f"- one interval for both: {coverage.LABELS[both] if both else 'none passes'}",
              f"- the tables use: {coverage.LABELS[USED[crossed.DF]]} (analysis/crossed.py `DF`)"]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, rows: pd.DataFrame, model: OutcomeModel, used: list[str], command: str, sha: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv, md = out_dir / "coverage.csv", out_dir / "coverage.md"
    rows.assign(git_sha=sha, command=command).to_csv(csv, index=False)
    md.write_text(markdown(rows, model, used, command, sha))
    return [csv, md]
