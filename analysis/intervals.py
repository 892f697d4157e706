"""Final accuracy with 95 % bootstrap intervals, and each method's difference to dense with its own.

    python -m analysis.intervals results/cpu      # prints the Markdown table

Per task × method variant (runs that differ only in seed): the final greedy pass@1 on the held-out
problems (``eval/accuracy`` at a run's last evaluation) as mean ± std over seeds, its 95 % interval
from the two-stage bootstrap of ``analysis/bootstrap.py`` (seeds with replacement, then each drawn
run's problems with replacement; 10,000 replicates, seeded per cell), and Δ = mean(variant) −
mean(dense reference) in percentage points with the 95 % interval of the replicates' difference.
The dense reference is ``render.dense_reference`` (the task's best dense variant).

"No worse than dense by more than 5 points" (the paper's "equal accuracy" at this scale, read as
non-inferiority with margin ``MARGIN``) is decided from Δ's interval: **yes** when its lower end is
above −5 pp, **no** when its upper end is below −5 pp, **undecided** when it straddles −5 pp.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis import bootstrap
from analysis.accuracy import per_run_accuracy, unfinished_note
from analysis.cli import root_cli
from analysis.render import GROUP, Absent, Table, dense_reference, fmt, mean_std, seed_note

MARGIN = 0.05  # the non-inferiority margin: Δ ≥ −5 percentage points counts as equal accuracy


def verdict(delta: bootstrap.Interval, margin: float = MARGIN) -> str:
    """Is the variant no worse than the reference by more than ``margin``, by Δ's interval?"""
    if delta.low > -margin:
        return "yes"
    if delta.high < -margin:
        return "no"
    return "undecided"


def cells(runs: pd.DataFrame) -> dict[tuple[str, str], dict]:
    """Per (task, variant): the per-run final accuracies and the bootstrap of their mean."""
    per = per_run_accuracy(runs)
    if per["problems"].isna().any():
        missing = sorted(per.index[per["problems"].isna()])
        raise Absent(f"no eval/num_problems in {', '.join(missing[:3])}: the problems cannot be resampled")
    out = {}
    for (task, variant), group in per.groupby(GROUP, sort=True):
        problems = group["problems"].astype(int).to_numpy()
        correct = (group["end"].to_numpy() * problems).round()
        out[(task, variant)] = {
            "method": group["method"].iloc[0], "seeds": len(group), "problems": sorted(set(problems.tolist())),
            "end_std": group["end"].std(),
            "boot": bootstrap.mean_interval(correct, problems, key=f"{task}|{variant}"),
        }
    return out


def table(runs: pd.DataFrame) -> Table:
    data_cells = cells(runs)
    unfinished = unfinished_note(per_run_accuracy(runs))
    ref = dense_reference(runs)
    rows = []
    for (task, variant), c in data_cells.items():
        mean, _ = c["boot"]
        reference = ref.get(task)
        delta = (bootstrap.difference_interval(c["boot"], data_cells[(task, reference)]["boot"])
                 if reference and reference != variant else None)
        rows.append({"task_label": task, "variant": variant, "method": c["method"], "seeds": c["seeds"],
                     "problems": "/".join(map(str, c["problems"])), "end_mean": mean.estimate,
                     "end_std": c["end_std"], "ci_low": mean.low, "ci_high": mean.high, "reference": reference,
                     "delta": delta.estimate if delta else math.nan, "delta_low": delta.low if delta else math.nan,
                     "delta_high": delta.high if delta else math.nan, "verdict": verdict(delta) if delta else ""})
    data = pd.DataFrame(rows)
    pp = lambda v: fmt(100 * v, 1)  # noqa: E731
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"], "seeds": data["seeds"],
        "final (%)": [mean_std(100 * m, 100 * s) for m, s in zip(data["end_mean"], data["end_std"])],
        "95 % interval (%)": [f"[{pp(lo)}, {pp(hi)}]" for lo, hi in zip(data["ci_low"], data["ci_high"])],
        "Δ vs dense (pp)": ["ref" if r == v else fmt(100 * d, 1, signed=True) if pd.notna(d) else "—"
                            for r, v, d in zip(data["reference"], data["variant"], data["delta"])],
        "Δ 95 % interval (pp)": [f"[{fmt(100 * lo, 1, signed=True)}, {fmt(100 * hi, 1, signed=True)}]"
                                 if pd.notna(lo) else "—" for lo, hi in zip(data["delta_low"], data["delta_high"])],
        "Δ ≥ −5 pp?": [v or "—" for v in data["verdict"]],
    })
    notes = [f"final greedy pass@1 on the held-out problems ({'/'.join(sorted(set(data['problems'])))} per run) at "
             "each run's last evaluation", seed_note(data),
             f"95 % intervals: percentile bootstrap, {bootstrap.N_BOOT:,} replicates (seed {bootstrap.SEED}, one generator "
             "per cell), resampling the seeds with replacement and then each drawn run's problems with replacement "
             "(analysis/bootstrap.py); Δ's interval from the difference of the two cells' independent replicates "
             "(conservative: the cells share their problems)",
             "Δ ≥ −5 pp?: yes when Δ's interval lies above −5 pp, no when below, undecided when it straddles −5 pp"]
    notes.append("dense reference: " + "; ".join(f"{t}: {v}" for t, v in ref.items()) if ref
                 else "no dense run: no difference to dense")
    notes += unfinished
    return Table("accuracy_intervals", "Final held-out accuracy with 95 % bootstrap intervals (seeds × problems)",
                 data, shown, notes)


def headline(data: pd.DataFrame) -> list[str]:
    """One line per row of ``table(...).data`` that has a difference to dense: Δ, its interval, the verdict."""
    others = data[data["delta"].notna()]
    return [f"{r.task_label}: {r.variant} − {r.reference} = {fmt(100 * r.delta, 1, signed=True)} pp, 95 % interval "
            f"[{fmt(100 * r.delta_low, 1, signed=True)}, {fmt(100 * r.delta_high, 1, signed=True)}] "
            f"({r.seeds} seed{'s' if r.seeds > 1 else ''}); no worse than dense by more than 5 pp: {r.verdict}"
            for r in others.itertuples()]


def main(argv=None) -> int:
    from analysis.load import load_runs

    args = root_cli("python -m analysis.intervals", __doc__, argv)
    print(table(load_runs(args.root)).markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
