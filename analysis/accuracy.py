"""Accuracy table: held-out greedy pass@1 at the first and the last evaluation of each run, mean ±
std over seeds per task × method variant, and the end accuracy's difference to dense.

    python -m analysis.accuracy results/quick      # prints the Markdown table

Per run, ``start`` is ``eval/accuracy`` at its first evaluation (step 0 with ``eval.at_start``)
and ``end`` at its last. The difference to dense is mean(end) − mean(end of the task's dense
variant), in percentage points; with several dense variants the best one by mean end accuracy
is the reference (named in the notes; the same in every table).
"""

from __future__ import annotations

import pandas as pd

from analysis.cli import root_cli
from analysis.render import GROUP, Absent, Table, dense_reference, fmt, mean_std, seed_note


def per_run_accuracy(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run that evaluated: start/mid/end accuracy and the steps they were taken at.

    ``mid`` is the evaluation strictly between the first and the last whose step is nearest their
    midpoint (the earlier on a tie: step 15 of evaluations at 0, 15, 30); NaN with fewer than three."""
    if "eval/accuracy" not in runs:
        raise Absent("no run logged eval/accuracy")
    evals = runs.dropna(subset=["eval/accuracy"]).sort_values(["run", "step"])
    if evals.empty:
        raise Absent("no run logged eval/accuracy")
    grouped = evals.groupby("run")
    first, last = grouped.head(1).set_index("run"), grouped.tail(1).set_index("run")
    mid_step, mid = {}, {}
    for run, of_run in grouped:
        inner = of_run.iloc[1:-1]
        if len(inner):
            at = (inner["step"] - (of_run["step"].iloc[0] + of_run["step"].iloc[-1]) / 2).abs().idxmin()
            mid_step[run], mid[run] = inner.loc[at, "step"], inner.loc[at, "eval/accuracy"]
    return pd.DataFrame({
        "task_label": first["task_label"], "variant": first["variant"], "family": first["family"],
        "method": first["method"], "seed": first["seed"], "start_step": first["step"], "start": first["eval/accuracy"],
        "mid_step": pd.Series(mid_step, dtype=float), "mid": pd.Series(mid, dtype=float),
        "end_step": last["step"], "end": last["eval/accuracy"],
        "problems": last["eval/num_problems"] if "eval/num_problems" in last else float("nan"),
        "done": first["done"] if "done" in first else True,
    })


def unfinished_note(per: pd.DataFrame) -> list[str]:
    """A note naming how many runs of ``per_run_accuracy`` have no done.json (their "final" is the last
    evaluation so far), or none."""
    n = int((~per["done"].astype(bool)).sum())
    return [f"{n} of {len(per)} runs not finished (no done.json): their final accuracy is their last evaluation "
            "so far"] if n else []


def table(runs: pd.DataFrame) -> Table:
    per = per_run_accuracy(runs)
    g = per.groupby(GROUP, sort=True)
    data = pd.DataFrame({
        "method": g["method"].first(), "seeds": g.size(),
        "start_step": g["start_step"].min(), "end_step": g["end_step"].max(),
        "start_mean": g["start"].mean(), "start_std": g["start"].std(),
        "end_mean": g["end"].mean(), "end_std": g["end"].std(),
    })
    ref = dense_reference(runs)
    data["reference"] = [ref.get(task) for task, _ in data.index]
    data["delta_end"] = [row.end_mean - data.loc[(task, row.reference), "end_mean"] if row.reference else float("nan")
                         for (task, _), row in data.iterrows()]
    data = data.reset_index()
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"], "seeds": data["seeds"],
        "steps": data["end_step"].astype(int),
        "eval@start (%)": [mean_std(100 * m, 100 * s) for m, s in zip(data["start_mean"], data["start_std"])],
        "eval@end (%)": [mean_std(100 * m, 100 * s) for m, s in zip(data["end_mean"], data["end_std"])],
        "Δ end vs dense (pp)": ["ref" if r == v else fmt(100 * d, 1, signed=True)
                                for r, v, d in zip(data["reference"], data["variant"], data["delta_end"])],
    })
    problems = sorted({int(p) for p in per["problems"].dropna()})
    notes = [f"greedy pass@1 on {'/'.join(map(str, problems)) or 'the'} held-out problems; "
             "start = first evaluation, end = last; steps = the last evaluation's step", seed_note(data)]
    if ref:
        notes.append("dense reference: " + "; ".join(f"{task}: {v}" for task, v in ref.items()))
    else:
        notes.append("no dense run: no difference to dense")
    if (data["start_step"] > 0).any():
        notes.append("some runs did not evaluate at step 0: their start is a later step")
    return Table("accuracy", "Held-out accuracy at the start and the end of training", data, shown, notes)


def main(argv=None) -> int:
    from analysis.load import load_runs

    print(table(load_runs(root_cli("python -m analysis.accuracy", __doc__, argv).root)).markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
