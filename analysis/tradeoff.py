"""The memory–accuracy trade-off: one point per method variant, y its final held-out accuracy (mean over
seeds) with the 95 % interval of ``analysis/intervals.py`` (t over seeds × problems) as error bars, x
its memory × dense's, in up to two panels per task:

- **the training step's peak** (the measure the memory claim uses): from ``memory.csv`` of
  ``python -m experiments.memory_table`` (one GRPO step per method in a fresh process; the profiler's
  live-tensor peak) — the root's own ``<root>/memory/memory.csv``, else a committed one
  (``results/memory_table``, ``results/memory_table_bf16``) that measured the runs' model in their dtype. A variant's row is the one of its method whose ``key=value`` overrides
  (``logra:logra.embeddings=true``) all hold in the variant's run config, the most specific such row
  when several do (plain ``logra`` for a logra run without sketched embeddings, with or without step
  control), of the runs' model where the table has it; × dense divides by the row the dense reference
  (``render.dense_reference``) takes (``dense:dense.precision=mixed`` for a bf16 run);
- **the whole process's peak over a run** beside it: the runs' own largest ``mem/peak_bytes`` × the
  dense reference's (``memory.runs_table``; on CPU the process's peak RSS, generation, evaluation and
  the Python runtime included, which every method pays alike).

Variants are named as people say them (``analysis/names.py``: "LoGRA, no step control"). Variants that
share a memory row (LoGRA with and without step control) are drawn side by side, ``DODGE`` apart.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import yaml

from analysis import intervals, memory
from analysis.load import per_run
from analysis.names import variant_names
from analysis.render import GROUP, Absent, colors, dense_reference, line_styles

REPO = Path(__file__).resolve().parents[1]

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


COMMITTED = ("memory_table", "memory_table_bf16")  # results/<folder>/memory.csv a root without its own may borrow


def _table_dtype(folder: Path) -> str:
    """The model dtype a memory table ran in: ``model.dtype=`` among its memory.json overrides, else fp32."""
    meta = folder / "memory.json"
    overrides = json.loads(meta.read_text()).get("settings", {}).get("overrides", []) if meta.exists() else []
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("model.dtype=")), "float32")


def step_memory(root_memory: pd.DataFrame | None, runs: pd.DataFrame, root: Path | None) -> tuple[pd.DataFrame | None, str]:
    """The step table (``memory.step_table``'s data) to read x from, and where it came from: the root's
    memory.csv, else the first committed one (``COMMITTED``, beside the root or in this repository) that
    measured the runs' model in the runs' dtype."""
    if root_memory is not None:
        return memory.step_table(root_memory).data, "memory/memory.csv"
    if root is None:
        return None, ""
    from analysis.load import read_memory_csv

    configs = per_run(runs)
    models = set(configs["model.name"].dropna().astype(str)) if "model.name" in configs else set()
    dtypes = set(configs["model.dtype"].dropna().astype(str)) if "model.dtype" in configs else {"float32"}
    for folder in [Path(root).parent / f for f in COMMITTED] + [REPO / "results" / f for f in COMMITTED]:
        path = folder / "memory.csv"
        if not path.exists() or dtypes != {_table_dtype(folder)}:
            continue
        table = memory.step_table(read_memory_csv(path)).data
        if models & set(table["model"]):
            where = path.resolve()
            return table, str(where.relative_to(REPO)) if where.is_relative_to(REPO) else str(path)
    return None, ""


def points(root_memory: pd.DataFrame | None, runs: pd.DataFrame, root: Path | None = None) -> tuple[pd.DataFrame, str]:
    """Per (task, variant): ``x_dense`` (the step's peak × dense, NaN without a step table), ``x_rss``
    (the runs' largest peak × dense's), the peak bytes, y and its interval; and the step table's source
    (``"runs"`` when there is none)."""
    cells = intervals.cells(runs)
    configs = per_run(runs).drop_duplicates(GROUP).set_index(GROUP)
    step, source = step_memory(root_memory, runs, root)
    reference = dense_reference(runs)
    try:
        by_run = memory.runs_table(runs).data.set_index(GROUP)
    except Absent:
        by_run = pd.DataFrame(columns=["ratio"])
    if step is None and by_run.empty:
        raise Absent("no memory.csv and no run logged mem/peak_bytes")
    names = variant_names(runs)
    rows = []
    for (task, variant), cell in cells.items():
        peak, ratio = math.nan, math.nan
        if step is not None and task in reference:
            row = matching_row(step, configs.loc[(task, variant)])
            ref = matching_row(step, configs.loc[(task, reference[task])])  # the dense row of the reference's config
            peak = row["peak_bytes"] if row is not None else math.nan
            ratio = peak / ref["peak_bytes"] if ref is not None else math.nan
        rss = by_run.loc[(task, variant), "ratio"] if (task, variant) in by_run.index else math.nan
        mean = cell["interval"]
        rows.append({"task_label": task, "variant": variant, "name": names[(task, variant)], "peak_bytes": peak,
                     "x_dense": ratio, "x_rss": rss, "accuracy": mean.estimate, "low": mean.low, "high": mean.high,
                     "seeds": cell["seeds"]})
    data = pd.DataFrame(rows)
    if data["x_dense"].isna().all() and data["x_rss"].isna().all():
        raise Absent("no method's peak memory could be paired with its accuracy (no dense row to divide by?)")
    return data, source or "runs"


PANELS = {  # x column -> (title, axis label)
    "x_dense": ("the training step's peak (the memory claim's measure)",
                "peak of one training step × dense AdamW's\n(live-tensor profiler, {source})"),
    "x_rss": ("the whole process's peak over a run",
              "largest peak over a run × dense AdamW's\n(on CPU the process's peak RSS)")}


def figure(root_memory: pd.DataFrame | None, runs: pd.DataFrame, root: Path | None = None):
    import matplotlib.pyplot as plt

    data, source = points(root_memory, runs, root)
    tasks = sorted(data["task_label"].unique())
    panels = [x for x in PANELS if data[x].notna().any()]
    order = list(dict.fromkeys(data.sort_values(["x_dense", "x_rss", "name"], ascending=False)["name"]))
    color, look = colors(order), line_styles(order)
    fig, axes = plt.subplots(len(tasks), len(panels), figsize=(5.2 * len(panels) + 2.8, 4.8 * len(tasks)), squeeze=False)
    handles = {}
    for row_axes, task in zip(axes, tasks):
        for ax, x in zip(row_axes, panels):
            shown = data[(data["task_label"] == task) & data[x].notna()]
            rank = shown.groupby(x).cumcount()  # variants at one x (same memory row) side by side
            width = shown.groupby(x)["variant"].transform("size")
            for r, i, n in zip(shown.itertuples(), rank, width):
                y = 100 * r.accuracy
                err = [[y - 100 * r.low], [100 * r.high - y]] if not math.isnan(r.low) else None
                label = f"{r.name} ({r.seeds} seed{'s' if r.seeds > 1 else ''})"
                handles[label] = ax.errorbar(getattr(r, x) + DODGE * (i - (n - 1) / 2), y, yerr=err,
                                             fmt=look[r.name]["marker"], color=color[r.name], capsize=4, markersize=7)
            ax.axvline(1.0, color="0.6", linewidth=0.8, linestyle=":")
            lo = min(0.4, shown[x].min() - 0.05) if len(shown) else 0.0
            ax.set(xlabel=PANELS[x][1].format(source=source), ylabel="final greedy pass@1 (%)", xlim=(lo, 1.08))
            ax.set_title(f"{task}: {PANELS[x][0]}", fontsize=10)
            ax.xaxis.label.set_fontsize(8)
            ax.grid(alpha=0.3)
    axes[0, -1].legend(list(handles.values()), list(handles), fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       borderaxespad=0.0)
    missing = sorted(set(data[data[panels[0]].isna()]["name"]))
    fig.text(0.01, 0.005, "points: mean over seeds; bars: 95 % interval over seeds and held-out problems (t, analysis/crossed.py)"
             + (f"; no {panels[0]} for: {', '.join(missing)}" if missing else ""), fontsize=7, color="0.4")
    return fig
