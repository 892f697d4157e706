"""Final accuracy with 95 % bootstrap intervals, and each method's difference to dense with its own.

    python -m analysis.intervals results/cpu      # prints the Markdown table

Per task × method variant (runs that differ only in seed): the final greedy pass@1 on the held-out
problems (``eval/accuracy`` at a run's last evaluation) as mean ± std over seeds, its 95 % interval
from the two-stage bootstrap of ``analysis/bootstrap.py`` (seeds with replacement, then each drawn
run's problems with replacement; 10,000 replicates, seeded per cell), and Δ = mean(variant) −
mean(dense reference) in percentage points with its 95 % interval: paired — seeds and problems
resampled once for both methods, from the per-problem outcomes of ``eval_outcomes.jsonl``
(``analysis/outcomes.py``, ``bootstrap.paired_difference``) — where every run of both cells has them
for its final evaluation on the same seeds and problems, else the difference of the two cells'
independent replicates (unpaired). The table's notes say which, and why not paired.
The dense reference is ``render.dense_reference`` (the task's best dense variant).

"No worse than dense by more than 5 points" (the paper's "equal accuracy" at this scale, read as
non-inferiority with margin ``MARGIN``) is decided from Δ's interval: **yes** when its lower end is
above −5 pp, **no** when its upper end is below −5 pp, **undecided** when it straddles −5 pp.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis import bootstrap, outcomes
from analysis.accuracy import per_run_accuracy, unfinished_note
from analysis.cli import root_cli
from analysis.load import per_run
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
    """Per (task, variant): the per-run final accuracies, the bootstrap of their mean and each run's
    final per-problem outcomes (``outcomes.RunOutcomes``, for a paired Δ)."""
    per = per_run_accuracy(runs)
    if per["problems"].isna().any():
        missing = sorted(per.index[per["problems"].isna()])
        raise Absent(f"no eval/num_problems in {', '.join(missing[:3])}: the problems cannot be resampled")
    run_dirs = per_run(runs)["run_dir"] if "run_dir" in runs else {}
    out = {}
    for (task, variant), group in per.groupby(GROUP, sort=True):
        problems = group["problems"].astype(int).to_numpy()
        correct = (group["end"].to_numpy() * problems).round()
        out[(task, variant)] = {
            "method": group["method"].iloc[0], "seeds": len(group), "problems": sorted(set(problems.tolist())),
            "end_std": group["end"].std(),
            "boot": bootstrap.mean_interval(correct, problems, key=f"{task}|{variant}"),
            "outcomes": [outcomes.final_outcomes(run, run_dirs[run], int(r.seed), int(r.end_step), int(k), int(n))
                         if run in run_dirs else outcomes.RunOutcomes(int(r.seed), run, None, f"{run}: no run directory")
                         for (run, r), k, n in zip(group.iterrows(), correct, problems)],
        }
    return out


def difference(cell: dict, reference: dict, key: str) -> tuple[bootstrap.Interval, str]:
    """Δ = cell − reference with its 95 % interval, and how: ``"paired"`` when the two cells' outcomes
    pair up (``outcomes.pair``), else ``"unpaired: <why not>"``."""
    diffs, why_not = outcomes.pair(cell["outcomes"], reference["outcomes"])
    if diffs is not None:
        return bootstrap.paired_difference(diffs, key=f"{key}|paired"), "paired"
    return bootstrap.difference_interval(cell["boot"], reference["boot"]), f"unpaired: {why_not}"


def pairing_note(data: pd.DataFrame) -> str:
    """Which of Δ's intervals (rows of ``table(...).data`` with a ``pairing``) are paired and which
    unpaired, with the first reason."""
    rows = data[data["pairing"] != ""]
    paired = rows[rows["pairing"] == "paired"]
    unpaired = rows[rows["pairing"] != "paired"]
    say_paired = ("paired bootstrap: per replicate the seeds are drawn with replacement and the held-out problems "
                  "once with replacement, the same for both methods of a seed (eval_outcomes.jsonl; analysis/bootstrap.py)")
    say_unpaired = ("unpaired: the difference of the two cells' independent replicates (conservative: the cells share "
                    "their problems)")
    if unpaired.empty:
        return f"Δ's 95 % interval: {say_paired}"
    why = unpaired["pairing"].iloc[0].removeprefix("unpaired: ")
    if paired.empty:
        return f"Δ's 95 % interval: {say_unpaired}; not paired because {why}"
    names = ", ".join(f"{r.task_label} {r.variant}" for r in paired.itertuples())
    return f"Δ's 95 % interval: {say_paired} for {names}; the others {say_unpaired} (e.g. because {why})"


def table(runs: pd.DataFrame) -> Table:
    data_cells = cells(runs)
    unfinished = unfinished_note(per_run_accuracy(runs))
    ref = dense_reference(runs)
    rows = []
    for (task, variant), c in data_cells.items():
        mean, _ = c["boot"]
        reference = ref.get(task)
        delta, pairing = (difference(c, data_cells[(task, reference)], key=f"{task}|{variant}|{reference}")
                          if reference and reference != variant else (None, ""))
        rows.append({"task_label": task, "variant": variant, "method": c["method"], "seeds": c["seeds"],
                     "problems": "/".join(map(str, c["problems"])), "end_mean": mean.estimate,
                     "end_std": c["end_std"], "ci_low": mean.low, "ci_high": mean.high, "reference": reference,
                     "delta": delta.estimate if delta else math.nan, "delta_low": delta.low if delta else math.nan,
                     "delta_high": delta.high if delta else math.nan, "verdict": verdict(delta) if delta else "",
                     "pairing": pairing})
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
             "(analysis/bootstrap.py)", *([pairing_note(data)] if (data["pairing"] != "").any() else []),
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
            f"({r.seeds} seed{'s' if r.seeds > 1 else ''}, {r.pairing.split(':')[0]}); "
            f"no worse than dense by more than 5 pp: {r.verdict}"
            for r in others.itertuples()]


def main(argv=None) -> int:
    from analysis.load import load_runs

    args = root_cli("python -m analysis.intervals", __doc__, argv)
    print(table(load_runs(args.root)).markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
