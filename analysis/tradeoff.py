"""The memory–accuracy trade-off: one point per method variant, x its peak memory × dense, y its
final held-out accuracy (mean over seeds) with the 95 % bootstrap interval of ``analysis/intervals.py``
as error bars. One panel per task.

x comes from ``<root>/memory/memory.csv`` when the root has it (``python -m experiments.memory_table``:
one GRPO step per method in a fresh process; the cpu profile's ``after:`` step writes it): a
variant's row is the one of its method whose ``key=value`` overrides (``logra:logra.embeddings=true``)
all hold in the variant's run config, the most specific such row when several do (plain ``logra``
for a logra run without sketched embeddings, with or without step control), of the runs' model where
the table has it. × dense divides by that table's ``dense`` row. Without memory.csv, x is the runs'
own largest ``mem/peak_bytes`` × the dense reference's (``memory.runs_table``; on CPU the process's
peak RSS, generation and evaluation included), and the axis says so. Variants that share a memory
row (logra with and without step control) are drawn side by side, ``DODGE`` apart.
"""

from __future__ import annotations

import math

import pandas as pd
import yaml

from analysis import intervals, memory
from analysis.load import per_run
from analysis.render import GROUP, Absent, colors, line_styles

DODGE = 0.015  # x offset between variants that share a memory row (× dense units), so their bars do not overlap


def _norm(value) -> str:
    """A config value and an override's text compared as one spelling: ``True``/``"true"`` -> "true",
    ``4e-05``/``"4e-5"`` -> "4e-05", ``None``/``"null"`` -> "null"."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return value.strip().lower()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return str(value).strip().lower()


def matching_row(step: pd.DataFrame, config: pd.Series) -> pd.Series | None:
    """The row of ``memory.step_table(...).data`` whose method label fits the run ``config`` (module
    docstring), or None."""
    from experiments.common.cli import parse_methods

    rows = step
    if "model.name" in config and (step["model"] == config["model.name"]).any():
        rows = step[step["model"] == config["model.name"]]
    best, best_n = None, -1
    for _, row in rows.iterrows():
        spec = parse_methods(str(row["method"]))[0]
        if spec.method != config["method"]:
            continue
        pairs = [o.split("=", 1) for o in spec.overrides]
        if all(k in config and _norm(config[k]) == _norm(v) for k, v in pairs) and len(pairs) > best_n:
            best, best_n = row, len(pairs)
    return best


def points(root_memory: pd.DataFrame | None, runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per (task, variant): x (peak × dense), the peak bytes, y and its interval; and the x source."""
    cells = intervals.cells(runs)
    configs = per_run(runs).drop_duplicates(GROUP).set_index(GROUP)
    try:
        step = memory.step_table(root_memory).data
        dense = step[step["method"] == "dense"]
        source = "memory.csv"
    except Absent:
        step = None
        by_run = memory.runs_table(runs).data.set_index(GROUP)  # Absent when the runs logged no memory either
        source = "runs"
    rows = []
    for (task, variant), cell in cells.items():
        if step is not None:
            row = matching_row(step, configs.loc[(task, variant)])
            ref = dense[dense["model"] == row["model"]] if row is not None else dense.iloc[0:0]
            peak = row["peak_bytes"] if row is not None else math.nan
            ratio = peak / ref["peak_bytes"].iloc[0] if len(ref) else math.nan
        else:
            peak = by_run.loc[(task, variant), "peak_bytes"] if (task, variant) in by_run.index else math.nan
            ratio = by_run.loc[(task, variant), "ratio"] if (task, variant) in by_run.index else math.nan
        mean = cell["boot"][0]
        rows.append({"task_label": task, "variant": variant, "peak_bytes": peak, "x_dense": ratio,
                     "accuracy": mean.estimate, "low": mean.low, "high": mean.high, "seeds": cell["seeds"]})
    data = pd.DataFrame(rows)
    if data["x_dense"].isna().all():
        raise Absent("no method's peak memory could be paired with its accuracy (no dense row to divide by?)")
    return data, source


def figure(root_memory: pd.DataFrame | None, runs: pd.DataFrame):
    import matplotlib.pyplot as plt

    data, source = points(root_memory, runs)
    shown = data.dropna(subset=["x_dense"])
    tasks = sorted(shown["task_label"].unique())
    variants = sorted(shown["variant"].unique())
    color, look = colors(variants), line_styles(variants)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.0 * len(tasks) + 2.5, 4.6), squeeze=False)
    handles = {}
    for ax, task in zip(axes[0], tasks):
        of_task = shown[shown["task_label"] == task]
        rank = of_task.groupby("x_dense").cumcount()  # variants at one x (same memory row) side by side
        width = of_task.groupby("x_dense")["variant"].transform("size")
        for r, i, n in zip(of_task.itertuples(), rank, width):
            y = 100 * r.accuracy
            label = f"{r.variant} ({r.seeds} seed{'s' if r.seeds > 1 else ''})"
            handles[label] = ax.errorbar(r.x_dense + DODGE * (i - (n - 1) / 2), y, yerr=[[y - 100 * r.low], [100 * r.high - y]],
                                         fmt=look[r.variant]["marker"], color=color[r.variant], capsize=4, markersize=7)
        ax.axvline(1.0, color="0.6", linewidth=0.8, linestyle=":")
        ax.set(xlabel=("peak memory of one training step × dense (memory/memory.csv)" if source == "memory.csv" else
                       "largest mem/peak_bytes of the runs × dense (CPU: peak RSS)"),
               ylabel="final greedy pass@1 (%)", title=f"{task}: memory vs accuracy")
        lo, hi = ax.get_xlim()
        ax.set_xlim(min(lo, 0.0), max(hi, 1.1))
        ax.grid(alpha=0.3)
    axes[0, -1].legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       borderaxespad=0.0)
    missing = data[data["x_dense"].isna()]["variant"].tolist()
    fig.text(0.01, 0.005, "points: mean over seeds; bars: 95 % bootstrap interval over seeds and held-out problems"
             + (f"; no memory row for: {', '.join(missing)}" if missing else ""), fontsize=7, color="0.4")
    return fig
