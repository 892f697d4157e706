"""Final accuracy with 95 % intervals over seeds × problems, and each method's difference to dense with its own.

    python -m analysis.intervals results/cpu      # prints the Markdown table

Per task × method variant (runs that differ only in seed): the final greedy pass@1 on the held-out
problems (``eval/accuracy`` at a run's last evaluation) as mean ± std over seeds, its 95 % interval,
and Δ = variant − dense reference in percentage points with its 95 % interval. Every interval is the
crossed-design t-interval of ``analysis/crossed.py`` — the mean over seeds and problems ± t_{m−1} ·
√(s²_seed/m + σ̂²_P/n), cut to [0, 1] (Δ's to [−1, 1]): the per-seed means' spread plus the problem
component, estimated from the per-problem outcomes of ``eval_outcomes.jsonl`` (``analysis/outcomes.py``)
— the interval whose coverage ``analysis/coverage.py`` measured (results/cpu/tables/coverage.md). A cell whose runs lack those
outcomes gets the per-seed accuracies' t-interval with a binomial problem term (conservative); a cell
of one seed gets none.

Δ is **paired** where both cells' runs logged their final outcomes on the seeds both ran and the same
problems: d[s, p] = x^variant − x^reference on those seeds (the others' seeds left out of Δ: the table
says how many it used), Δ = mean d with the crossed interval of d. Otherwise it is **unpaired**: the
two cells' intervals combined (V̂_a + V̂_b, ν = min), conservative since the cells share their problems.
The dense reference is ``render.dense_reference`` (the task's best dense variant).

"No worse than dense by more than 5 points" (the paper's "equal accuracy" at this scale, read as
non-inferiority with margin ``MARGIN``) is decided from Δ's interval: **yes** when its lower end is
above −5 pp, **no** when its upper end is below −5 pp, **undecided** when it straddles −5 pp.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis import crossed, outcomes
from analysis.accuracy import per_run_accuracy, unfinished_note
from analysis.cli import root_cli
from analysis.load import per_run
from analysis.render import GROUP, Absent, Table, dense_reference, fmt, mean_std, seed_note

MARGIN = 0.05  # the non-inferiority margin: Δ ≥ −5 percentage points counts as equal accuracy
SAY_CROSSED = ("t-interval over seeds × problems: the per-seed means' spread (t, m − 1 degrees of freedom) plus the "
               "problem component from the per-problem outcomes (analysis/crossed.py; coverage: "
               "results/cpu/tables/coverage.md)")


def verdict(delta, margin: float = MARGIN) -> str:
    """Is the variant no worse than the reference by more than ``margin``, by Δ's interval?"""
    if math.isnan(delta.low):
        return "undecided"
    if delta.low > -margin:
        return "yes"
    if delta.high < -margin:
        return "no"
    return "undecided"


def outcome_matrix(runs: list[outcomes.RunOutcomes]) -> np.ndarray | None:
    """The runs' 0/1 outcomes as (seeds in sorted order, problems in id order), or None when a run lacks
    them, a seed repeats or the runs evaluated different problems."""
    if any(r.outcomes is None for r in runs) or len({r.seed for r in runs}) != len(runs):
        return None
    ids = sorted(runs[0].outcomes)
    if any(sorted(r.outcomes) != ids for r in runs):
        return None
    return np.array([[r.outcomes[i] for i in ids] for r in sorted(runs, key=lambda r: r.seed)], dtype=float)


def cells(runs: pd.DataFrame) -> dict[tuple[str, str], dict]:
    """Per (task, variant): the per-run final accuracies, the interval of their mean (``interval``, and
    ``how`` it was computed) and each run's final per-problem outcomes (``outcomes.RunOutcomes``)."""
    per = per_run_accuracy(runs)
    if per["problems"].isna().any():
        missing = sorted(per.index[per["problems"].isna()])
        raise Absent(f"no eval/num_problems in {', '.join(missing[:3])}: the problem term cannot be formed")
    run_dirs = per_run(runs)["run_dir"] if "run_dir" in runs else {}
    out = {}
    for (task, variant), group in per.groupby(GROUP, sort=True):
        problems = group["problems"].astype(int).to_numpy()
        correct = (group["end"].to_numpy() * problems).round()
        found = [outcomes.final_outcomes(run, run_dirs[run], int(r.seed), int(r.end_step), int(k), int(n))
                 if run in run_dirs else outcomes.RunOutcomes(int(r.seed), run, None, f"{run}: no run directory")
                 for (run, r), k, n in zip(group.iterrows(), correct, problems)]
        matrix = outcome_matrix(found)
        interval = (crossed.interval(matrix) if matrix is not None else crossed.from_counts(correct, problems)).clipped(0, 1)
        out[(task, variant)] = {
            "method": group["method"].iloc[0], "seeds": len(group), "problems": sorted(set(problems.tolist())),
            "end_std": group["end"].std(), "interval": interval,
            "how": "per problem" if matrix is not None else "from counts", "outcomes": found,
        }
    return out


def difference(cell: dict, reference: dict) -> tuple[crossed.Interval, str, int]:
    """Δ = cell − reference with its 95 % interval, how (``"paired"``, else ``"unpaired: <why not>"``)
    and the number of seeds Δ used: paired over the seeds both cells ran (``outcomes.pair``)."""
    common = {r.seed for r in cell["outcomes"]} & {r.seed for r in reference["outcomes"]}
    mine = [r for r in cell["outcomes"] if r.seed in common]
    theirs = [r for r in reference["outcomes"] if r.seed in common]
    diffs, why_not = outcomes.pair(mine, theirs) if common else (None, "the cells share no seed")
    if diffs is not None:
        return crossed.interval(diffs).clipped(-1, 1), "paired", len(diffs)
    return crossed.difference(cell["interval"], reference["interval"]).clipped(-1, 1), f"unpaired: {why_not}", \
        min(cell["seeds"], reference["seeds"])


def pairing_note(data: pd.DataFrame) -> str:
    """Which of Δ's intervals (rows of ``table(...).data`` with a ``pairing``) are paired and which
    unpaired, with the first reason."""
    rows = data[data["pairing"] != ""]
    paired = rows[rows["pairing"] == "paired"]
    unpaired = rows[rows["pairing"] != "paired"]
    say_paired = ("paired: the crossed t-interval of the per-problem differences x^a − x^b of the runs of the seeds "
                  "both cells ran (eval_outcomes.jsonl; analysis/crossed.py)")
    say_unpaired = ("unpaired: the two cells' intervals combined, their variances added (conservative: the cells share "
                    "their problems)")
    if unpaired.empty:
        return f"Δ's 95 % interval: {say_paired}"
    why = unpaired["pairing"].iloc[0].removeprefix("unpaired: ")
    if paired.empty:
        return f"Δ's 95 % interval: {say_unpaired}; not paired because {why}"
    names = ", ".join(f"{r.task_label} {r.variant}" for r in paired.itertuples())
    return f"Δ's 95 % interval: {say_paired} for {names}; the others {say_unpaired} (e.g. because {why})"


def interval_text(low: float, high: float, scale: float = 100, signed: bool = False) -> str:
    """``[lo, hi]`` in points, ``—`` where there is no interval (one seed)."""
    if math.isnan(low):
        return "—"
    return f"[{fmt(scale * low, 1, signed=signed)}, {fmt(scale * high, 1, signed=signed)}]"


def table(runs: pd.DataFrame) -> Table:
    data_cells = cells(runs)
    unfinished = unfinished_note(per_run_accuracy(runs))
    ref = dense_reference(runs)
    rows = []
    for (task, variant), c in data_cells.items():
        mean = c["interval"]
        reference = ref.get(task)
        delta, pairing, used = (difference(c, data_cells[(task, reference)])
                                if reference and reference != variant else (None, "", 0))
        rows.append({"task_label": task, "variant": variant, "method": c["method"], "seeds": c["seeds"],
                     "problems": "/".join(map(str, c["problems"])), "end_mean": mean.estimate,
                     "end_std": c["end_std"], "ci_low": mean.low, "ci_high": mean.high, "how": c["how"],
                     "reference": reference, "delta_seeds": used,
                     "delta": delta.estimate if delta else math.nan, "delta_low": delta.low if delta else math.nan,
                     "delta_high": delta.high if delta else math.nan, "verdict": verdict(delta) if delta else "",
                     "pairing": pairing})
    data = pd.DataFrame(rows)
    pp = lambda v: fmt(100 * v, 1)  # noqa: E731
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"], "seeds": data["seeds"],
        "final (%)": [mean_std(100 * m, 100 * s) for m, s in zip(data["end_mean"], data["end_std"])],
        "95 % interval (%)": [interval_text(lo, hi) for lo, hi in zip(data["ci_low"], data["ci_high"])],
        "Δ vs dense (pp)": ["ref" if r == v else fmt(100 * d, 1, signed=True) if pd.notna(d) else "—"
                            for r, v, d in zip(data["reference"], data["variant"], data["delta"])],
        "Δ seeds": [str(n) if n else "—" for n in data["delta_seeds"]],
        "Δ 95 % interval (pp)": [interval_text(lo, hi, signed=True) if pd.notna(d) else "—"
                                 for lo, hi, d in zip(data["delta_low"], data["delta_high"], data["delta"])],
        "Δ ≥ −5 pp?": [v or "—" for v in data["verdict"]],
    })
    notes = [f"final greedy pass@1 on the held-out problems ({'/'.join(sorted(set(data['problems'])))} per run) at "
             "each run's last evaluation", seed_note(data), f"95 % intervals: {SAY_CROSSED}"]
    if (data["how"] == "from counts").any():
        notes.append("cells without per-problem outcomes: the per-seed accuracies' t-interval with a binomial problem "
                     "term p(1 − p)/n (conservative)")
    if (data["seeds"] == 1).any():
        notes.append("one seed: no interval (the seed component cannot be estimated from one value)")
    if (data["pairing"] != "").any():
        notes.append(pairing_note(data))
        notes.append("Δ seeds: the seeds Δ is over (paired: the seeds both cells ran)")
    notes.append("Δ ≥ −5 pp?: yes when Δ's interval lies above −5 pp, no when below, undecided when it straddles −5 pp")
    notes.append("dense reference: " + "; ".join(f"{t}: {v}" for t, v in ref.items()) if ref
                 else "no dense run: no difference to dense")
    notes += unfinished
    return Table("accuracy_intervals", "Final held-out accuracy with 95 % intervals (seeds × problems)",
                 data, shown, notes)


def headline(data: pd.DataFrame) -> list[str]:
    """One line per row of ``table(...).data`` that has a difference to dense: Δ, its interval, the verdict."""
    others = data[data["delta"].notna()]
    return [f"{r.task_label}: {r.variant} − {r.reference} = {fmt(100 * r.delta, 1, signed=True)} pp, 95 % interval "
            f"{interval_text(r.delta_low, r.delta_high, signed=True)} "
            f"({r.delta_seeds} seed{'s' if r.delta_seeds > 1 else ''}, {r.pairing.split(':')[0]}); "
            f"no worse than dense by more than 5 pp: {r.verdict}"
            for r in others.itertuples()]


def main(argv=None) -> int:
    from analysis.load import load_runs

    args = root_cli("python -m analysis.intervals", __doc__, argv)
    print(table(load_runs(args.root)).markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
