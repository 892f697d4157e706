"""The learning-rate sweep: held-out accuracy per rate for each method, the best rate marked.

    python -m analysis.lr_sweep runs/lr       # prints the Markdown table

A method's runs are grouped by ``family`` (``analysis.load``: the method variant without its
learning-rate keys, so ``logra`` and ``logra step_control.enabled=False`` are two families) and
ordered by the method's own rate ``<method>.lr``. A family enters the table when it ran at two or
more rates on a task. Per rate: greedy pass@1 on the held-out problems at the first, the middle
and the last evaluation (``analysis.accuracy.per_run_accuracy``), mean over seeds.

The best rate of a family is the one with the highest mean final accuracy; a tie goes to the higher
mid accuracy, then to the smaller rate (the safer step). With one seed per rate and 500 problems
a difference of a few points between rates is within the binomial noise (±4 pp at 95 % near 50 %):
the pick says which rate the later runs use, not that the others are worse.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis.accuracy import per_run_accuracy, unfinished_note
from analysis.cli import root_cli
from analysis.load import per_run
from analysis.render import Absent, Table, colors, fmt, fmt_g, legend_right, line_styles, plain_log_ticks

KEYS = ["task_label", "family", "lr"]


def rate_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run: its accuracies, family and rate ``<method>.lr``; only families swept over ≥ 2 rates."""
    per = per_run_accuracy(runs)
    configs = per_run(runs)
    per["lr"] = [configs.loc[run].get(f"{method}.lr", math.nan) for run, method in zip(per.index, per["method"])]
    per = per.dropna(subset=["lr"]).astype({"lr": float})
    swept = per.groupby(["task_label", "family"])["lr"].transform("nunique") >= 2
    if not swept.any():
        raise Absent("no method ran at two or more learning rates on one task")
    return per[swept]


def best_rate(rates: pd.DataFrame) -> float:
    """The rate of ``rates`` (one row per rate: ``lr``, ``end_mean``, ``mid_mean``) with the highest
    final accuracy; ties by mid accuracy, then the smaller rate."""
    key = rates.assign(mid_key=rates["mid_mean"].fillna(-math.inf), neg_lr=-rates["lr"])
    return float(key.sort_values(["end_mean", "mid_key", "neg_lr"], ascending=False)["lr"].iloc[0])


def table(runs: pd.DataFrame) -> Table:
    per = rate_runs(runs)
    g = per.groupby(KEYS, sort=True)
    data = pd.DataFrame({
        "method": g["method"].first(), "variant": g["variant"].first(), "seeds": g.size(), "start_mean": g["start"].mean(),
        "mid_step": g["mid_step"].median(), "mid_mean": g["mid"].mean(),
        "end_step": g["end_step"].max(), "end_mean": g["end"].mean(), "end_std": g["end"].std(),
    }).reset_index()
    best = {key: best_rate(rows) for key, rows in data.groupby(["task_label", "family"])}
    data["best"] = [best[(t, f)] == lr for t, f, lr in zip(data["task_label"], data["family"], data["lr"])]
    pct = lambda v: fmt(100 * v, 1)  # noqa: E731
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["family"], "lr": [fmt_g(v) for v in data["lr"]],
        "seeds": data["seeds"], "start (%)": [pct(v) for v in data["start_mean"]],
        "mid (%)": [pct(v) for v in data["mid_mean"]], "final (%)": [pct(v) for v in data["end_mean"]],
        "best": ["best" if b else "" for b in data["best"]],
    })
    mids = sorted({int(s) for s in data["mid_step"].dropna()})
    ends = sorted({int(s) for s in data["end_step"]})
    notes = [f"greedy pass@1 on the held-out problems, mean over seeds; start = first evaluation, mid = step "
             f"{'/'.join(map(str, mids)) or '— (no middle evaluation)'}, final = step {'/'.join(map(str, ends))}",
             "best = highest final accuracy of the method (ties: higher mid, then smaller lr); one seed per rate "
             "cannot separate rates a few points apart", *unfinished_note(per)]
    return Table("lr_sweep", "Learning-rate sweep: held-out accuracy per rate", data, shown, notes)


def headline(runs: pd.DataFrame) -> list[str]:
    """One line per task: each method's best rate and its final accuracy."""
    data = table(runs).data
    lines = []
    for task, rows in data[data["best"]].groupby("task_label", sort=True):
        lines.append(f"best learning rate on {task} (final accuracy): " + "; ".join(
            f"{r.family} {fmt_g(r.lr)} ({fmt(100 * r.end_mean, 1)} %)" for r in rows.itertuples()))
    return lines


def figure(runs: pd.DataFrame):
    """Final (solid) and mid (dashed) accuracy vs learning rate, log x, one line per method family;
    the best rate ringed. One panel per task."""
    import matplotlib.pyplot as plt

    data = table(runs).data
    tasks = sorted(data["task_label"].unique())
    families = sorted(data["family"].unique())
    color, look = colors(families), line_styles(families)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks) + 2.0, 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for family, rows in data[data["task_label"] == task].groupby("family", sort=True):
            rows = rows.sort_values("lr")
            style = {"marker": look[family]["marker"], "markersize": look[family]["markersize"]}
            ax.plot(rows["lr"], 100 * rows["end_mean"], color=color[family], label=family, **style)
            if rows["mid_mean"].notna().any():
                ax.plot(rows["lr"], 100 * rows["mid_mean"], color=color[family], linestyle=":", alpha=0.6, **style)
            top = rows[rows["best"]]
            ax.scatter(top["lr"], 100 * top["end_mean"], s=180, facecolors="none", edgecolors=color[family], linewidths=1.5)
        ax.set(xscale="log", xlabel="learning rate (log scale)", ylabel="greedy pass@1 (%)",
               title=f"{task}: held-out accuracy vs learning rate")
        plain_log_ticks(ax, "x")
        ax.grid(alpha=0.3, which="both")
    legend_right(axes[0, -1])
    fig.text(0.01, 0.005, "solid: final evaluation; dotted: mid-training evaluation; ring: the best rate "
             "(highest final accuracy); mean over seeds", fontsize=7, color="0.4")
    return fig


def main(argv=None) -> int:
    from analysis.load import load_runs

    print(table(load_runs(root_cli("python -m analysis.lr_sweep", __doc__, argv).root)).markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
