"""Learning curves with seed bands: training reward and held-out accuracy per step, one row of two
panels per task, one line per method variant (mean over seeds, shaded ± 1 std where more than one
seed logged the step).

The reward of a single step is noisy (a few prompts), so each run's reward is first smoothed by a
trailing moving average (``SMOOTH`` steps) and then averaged over seeds. The per-run version of this
figure is ``python -m analysis.curves <run dirs> --out ...``.
"""

from __future__ import annotations

import pandas as pd

from analysis.render import Absent, colors, legend_right, line_styles, seed_band

SMOOTH = 5


def figure(runs: pd.DataFrame):
    import matplotlib.pyplot as plt

    has = {k: k in runs and runs[k].notna().any() for k in ("reward/mean", "eval/accuracy")}
    if not any(has.values()):
        raise Absent("no run logged reward/mean or eval/accuracy")
    tasks = sorted(runs["task_label"].unique())
    variants = sorted(runs["variant"].unique())
    color, look = colors(variants), line_styles(variants)
    fig, axes = plt.subplots(len(tasks), 2, figsize=(15, 3.8 * len(tasks) + 0.3), squeeze=False)
    for (ax_r, ax_e), task in zip(axes, tasks):
        of_task = runs[runs["task_label"] == task]
        for variant, frame in of_task.groupby("variant", sort=True):
            seeds = frame["run"].nunique()
            label = f"{variant} ({seeds} seeds)" if seeds > 1 else variant
            if has["reward/mean"]:
                seed_band(ax_r, frame[frame["step"] > 0], "reward/mean", color[variant], label, smooth=SMOOTH,
                          **look[variant])
            if has["eval/accuracy"]:
                seed_band(ax_e, frame, "eval/accuracy", color[variant], label, scale=100, **look[variant])
        problems = sorted({int(p) for p in of_task.get("eval/num_problems", pd.Series(dtype=float)).dropna()})
        ax_r.set(xlabel="GRPO step", ylabel=f"mean reward ({SMOOTH}-step moving average)",
                 title=f"{task}: training reward of sampled completions")
        ax_e.set(xlabel="GRPO step", ylabel="greedy pass@1 (%)",
                 title=f"{task}: held-out accuracy ({'/'.join(map(str, problems)) or '?'} problems)")
        for ax, least_top in ((ax_r, 0.1), (ax_e, 5.0)):  # rewards and accuracies are ≥ 0: no negative axis
            if ax.lines and min(min(line.get_ydata(), default=0) for line in ax.lines) >= 0:
                top = max(ax.get_ylim()[1], least_top)
                ax.set_ylim(-0.03 * top, top)  # a little room below 0, so a line at 0 is not hidden by the axis
            ax.grid(alpha=0.3)
        legend_right(ax_e if has["eval/accuracy"] else ax_r)
    fig.text(0.01, 0.005, "lines: mean over seeds; shaded: ± 1 std over seeds (where > 1 seed)", fontsize=7, color="0.4")
    return fig
