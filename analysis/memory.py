"""Memory tables and the stacked-bar figure: peak bytes and their split into parameters, gradients,
optimizer state and activations (+ everything else), per method, and the reduction vs dense.

Two sources, each its own table:

- ``memory_step`` — ``<root>/memory/memory.csv`` from ``python -m experiments.memory_table``: one
  GRPO step of each method in a fresh process on the same fixed batch (per model), with the
  planner's prediction beside the measurement.
- ``memory_runs`` — the training runs' own ``mem/*`` metrics: per run the largest step peak and, at
  that step, ``mem/{params,grads,optimizer,activations}_bytes`` where the run logged them; also the
  mean over steps of the step peak (the "average training memory"). The step peak is the runs'
  tensor-accounting profiler's ``mem/tensor_peak_bytes`` where they ran it (``log.memory_profile=true``:
  the measurement of ``experiments.memory_table``, on each run's own batches; its categories sum to
  it), else ``mem/peak_bytes`` (CUDA: the allocator's peak; CPU: the process's peak RSS, generation
  and evaluation included). Mean over seeds per task × method variant.

Reduction vs dense = 1 − peak / peak(dense); with several dense variants on a task the reference
is the one the accuracy table compares with (``render.dense_reference``).
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.provenance import versions  # noqa: E402
from analysis.render import GROUP, Absent, Table, byte_unit, dense_reference, fmt, seed_note  # noqa: E402

CATEGORIES = ["params", "grads", "optimizer", "activations"]
CATEGORY_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
                   "activations": "activations + other"}


def _bytes(values, unit: tuple[str, float]) -> list[str]:
    """Bytes in the unit: MiB as whole numbers with thousands separators, GiB with one decimal."""
    digits = 1 if unit[0] == "GiB" else 0
    return [f"{v / unit[1]:,.{digits}f}" if pd.notna(v) else "—" for v in values]


def _with_reduction(data: pd.DataFrame, peak: str, ref: dict[str, str]) -> pd.DataFrame:
    """Add ``reference`` (the dense row per first index level), ``ratio`` = peak / its peak, ``reduction``."""
    ref_peak = {key: data.loc[[(key, name)], peak].iloc[0] for key, name in ref.items()}  # first row if repeated
    data["reference"] = [ref.get(key) for key, _ in data.index]
    data["ratio"] = [row[peak] / ref_peak[key] if key in ref_peak else math.nan for (key, _), row in data.iterrows()]
    data["reduction"] = 1 - data["ratio"]
    return data


def step_table(memory: pd.DataFrame | None) -> Table:
    """The ``memory.csv`` table (one fixed GRPO step per method, fresh processes)."""
    if memory is None or memory.empty:
        raise Absent("no <root>/memory/memory.csv (python -m experiments.memory_table)")
    memory = memory.assign(model=memory["model"] if "model" in memory else "?")
    data = memory.set_index(["model", "method"]).sort_index()
    for c in [f"{c}_bytes" for c in CATEGORIES] + ["peak_rss_bytes", "planner_bytes"]:
        if c not in data:
            data[c] = math.nan
    ref = {m: "dense" for m, method in data.index if method == "dense"}
    data = _with_reduction(data, "peak_bytes", ref).reset_index()
    unit = byte_unit(data[["peak_bytes", "peak_rss_bytes", "planner_bytes"]].to_numpy().ravel())
    shown = pd.DataFrame({"model": data["model"], "method": data["method"]})
    shown[f"peak ({unit[0]})"] = _bytes(data["peak_bytes"], unit)
    for c in CATEGORIES:
        shown[f"{CATEGORY_LABELS[c]} ({unit[0]})"] = _bytes(data[f"{c}_bytes"], unit)
    shown[f"peak RSS ({unit[0]})"] = _bytes(data["peak_rss_bytes"], unit)
    shown[f"planner ({unit[0]})"] = _bytes(data["planner_bytes"], unit)
    shown["× dense"] = [fmt(r, 2) for r in data["ratio"]]
    shown["reduction vs dense"] = [f"{100 * r:.1f} %" if pd.notna(r) else "—" for r in data["reduction"]]
    notes = ["one GRPO step per method, each in a fresh process on the same fixed batch "
             "(python -m experiments.memory_table); peak = the profiler's peak bytes, split at that peak; "
             "planner = experiments.memory.planner's prediction"]
    if not ref:
        notes.append("no dense row: no reduction vs dense")
    if "git_sha" in data:
        notes.append("git sha " + ", ".join(versions(data["git_sha"].dropna())))
    return Table("memory_step", "Peak memory of one training step, by category", data, shown, notes)


TENSOR_PEAK = "mem/tensor_peak_bytes"  # the runs' profiler (log.memory_profile=true)


def step_peaks(runs: pd.DataFrame) -> pd.Series:
    """Each step's peak: the profiler's live-tensor peak where a run logged it, else ``mem/peak_bytes``."""
    peak = runs["mem/peak_bytes"] if "mem/peak_bytes" in runs else pd.Series(math.nan, index=runs.index)
    if TENSOR_PEAK in runs:
        profiled = runs.groupby("run")[TENSOR_PEAK].transform(lambda v: v.notna().any())
        peak = peak.where(~profiled.astype(bool), runs[TENSOR_PEAK])
    return peak


def per_run_memory(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run: the peak over steps, the category split at that step, the mean step peak, and whether
    the peak is the profiler's live tensors (``profiled``) or mem/peak_bytes."""
    peaks = step_peaks(runs) if len(runs) else pd.Series(dtype=float)
    if peaks.dropna().empty:
        raise Absent("no run logged mem/peak_bytes")
    steps = runs.assign(_peak=peaks).dropna(subset=["_peak"])
    at_peak = steps.loc[steps.groupby("run")["_peak"].idxmax()].set_index("run")
    out = at_peak[GROUP + ["method", "seed"]].copy()
    out["peak_bytes"] = at_peak["_peak"]
    out["mean_peak_bytes"] = steps.groupby("run")["_peak"].mean()
    out["profiled"] = at_peak[TENSOR_PEAK].notna() if TENSOR_PEAK in at_peak else False
    for c in CATEGORIES:
        key = f"mem/{c}_bytes"
        out[f"{c}_bytes"] = at_peak[key] if key in at_peak else math.nan
    return out


def runs_table(runs: pd.DataFrame) -> Table:
    """The training runs' memory, mean over seeds per task × variant."""
    per = per_run_memory(runs)
    g = per.groupby(GROUP, sort=True)
    data = g[["peak_bytes", "mean_peak_bytes"] + [f"{c}_bytes" for c in CATEGORIES]].mean()
    data["profiled"] = g["profiled"].all()
    data.insert(0, "seeds", g.size())
    data.insert(0, "method", g["method"].first())
    data["peak_std"] = g["peak_bytes"].std()
    ref = dense_reference(runs)
    data = _with_reduction(data, "peak_bytes", ref)
    data = data.reset_index()
    unit = byte_unit(data["peak_bytes"])
    shown = pd.DataFrame({"task": data["task_label"], "method": data["variant"], "seeds": data["seeds"]})
    shown[f"peak ({unit[0]})"] = _bytes(data["peak_bytes"], unit)
    has_split = data[[f"{c}_bytes" for c in CATEGORIES]].notna().any()
    for c in CATEGORIES:
        if has_split[f"{c}_bytes"]:
            shown[f"{CATEGORY_LABELS[c]} ({unit[0]})"] = _bytes(data[f"{c}_bytes"], unit)
    shown[f"mean step peak ({unit[0]})"] = _bytes(data["mean_peak_bytes"], unit)
    shown["× dense"] = [fmt(r, 2) for r in data["ratio"]]
    shown["reduction vs dense"] = [f"{100 * r:.1f} %" if pd.notna(r) else "—" for r in data["reduction"]]
    profiled = bool(data["profiled"].all())
    notes = [("peak = the largest live-tensor peak of a run's steps (tensor-accounting profiler, log.memory_profile=true: "
              "the measurement of experiments.memory_table, on each run's own batches), split at that step"
              if profiled else
              "peak = the largest mem/peak_bytes over a run's steps (CUDA: allocator peak; CPU: process peak RSS), "
              "split at that step where logged") + "; mean step peak = its mean over the steps", seed_note(data, std=False)]
    if data["profiled"].any() and not profiled:
        notes.append("profiled (live tensors): " + ", ".join(data.loc[data["profiled"], "variant"]) + "; the others: mem/peak_bytes")
    if not has_split.any():
        notes.append("no run logged the category split (mem/params_bytes, ...)")
    if ref:
        notes.append("dense reference: " + "; ".join(f"{t}: {v}" for t, v in ref.items()))
        others = data[data["variant"] != data["reference"]].dropna(subset=["reduction"])
        by_variant = others.groupby("variant")["reduction"].agg(["mean", "size"])
        if data["task_label"].nunique() > 1:
            notes.append("mean reduction over tasks: " + ", ".join(
                f"{v} {100 * r['mean']:.1f} % ({int(r['size'])} task{'s' if r['size'] > 1 else ''})" for v, r in by_variant.iterrows()))
    return Table("memory_runs", "Training-run memory per method, by category", data, shown, notes)


def figure(memory: pd.DataFrame | None, runs: pd.DataFrame):
    """Stacked horizontal bars: one panel for memory.csv (per model), one per task for the runs."""
    panels = []
    try:
        step = step_table(memory).data
        for model, rows in step.groupby("model"):
            panels.append((f"one GRPO step per method, fresh processes ({model})", "method", rows))
    except Absent:
        pass
    try:
        run_data = runs_table(runs).data
        for task, rows in run_data.groupby("task_label"):
            n = sorted(set(rows["seeds"]))
            seeds = "" if n == [1] else f" (mean over {n[0]} seeds)" if len(n) == 1 else f" (mean over {n[0]}–{n[-1]} seeds per bar)"
            split = rows[[f"{c}_bytes" for c in CATEGORIES]].notna().any(axis=None)
            what = ("largest live-tensor peak of a step (the runs' profiler)" if rows["profiled"].all() else
                    "largest mem/peak_bytes over the steps" if split else
                    "largest mem/peak_bytes over the steps\n(on CPU the process's peak RSS: generation and evaluation included)")
            panels.append((f"training runs on {task}: {what}{seeds}",
                           "variant", rows))
    except Absent:
        pass
    if not panels:
        raise Absent("no memory.csv and no run logged mem/peak_bytes")
    unit = byte_unit(pd.concat([rows["peak_bytes"] for _, _, rows in panels]))
    height = sum(0.4 * len(rows) + 1.3 for _, _, rows in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, max(3.0, height)), squeeze=False,
                             gridspec_kw={"height_ratios": [len(rows) + 2 for _, _, rows in panels]})
    colors = {c: f"C{i}" for i, c in enumerate(CATEGORIES)}
    drawn = set()
    for ax, (title, label_col, rows) in zip(axes[:, 0], panels):
        for i, (_, row) in enumerate(rows.iterrows()):
            peak = row["peak_bytes"] / unit[1]
            parts = [(c, row[f"{c}_bytes"] / unit[1]) for c in CATEGORIES if pd.notna(row[f"{c}_bytes"])]
            left = 0.0
            for c, width in parts:
                ax.barh(i, width, left=left, color=colors[c], label=None if c in drawn else CATEGORY_LABELS[c])
                drawn.add(c)
                left += width
            if left < 0.99 * peak:  # no split logged (or part of the peak unaccounted): the rest in grey
                name = "peak, not split" if not parts else "unaccounted"
                ax.barh(i, peak - left, left=left, color="0.7", label=None if name in drawn else name)
                drawn.add(name)
            ratio = ("  (dense reference)" if row[label_col] == row["reference"] else
                     f"  ({row['ratio']:.2f}× dense)" if pd.notna(row["ratio"]) else "")
            ax.text(max(peak, left), i, f" {_bytes([row['peak_bytes']], unit)[0]} {unit[0]}{ratio}", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), rows[label_col].tolist(), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"peak memory ({unit[0]})")
        ax.set_xlim(0, 1.35 * max(rows["peak_bytes"]) / unit[1])
        ax.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
        ax.grid(axis="x", alpha=0.3)
    handles, names = [], []
    for ax in axes[:, 0]:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    axes[0, 0].legend(handles, names, fontsize=8, loc="lower right")
    return fig
