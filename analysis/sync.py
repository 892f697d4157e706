"""Weight-sync table and figure: bytes sent to the rollout engine per step, and their ratio to a
full-weight sync.

Runs whose rollout engine holds its own copy of the policy (``rollout.engine`` = hf, hf_process,
vllm) log ``sync/bytes`` (the step's payload, a full resync included), ``sync/full_bytes`` (what
sending every parameter costs) and ``sync/resyncs``. Per task × method variant: the mean payload
per step over every step of every seed, the full-weight bytes, their ratio, and the resyncs.
"""

from __future__ import annotations

import pandas as pd

from analysis.render import GROUP, Absent, Table, byte_unit, colors, fmt, legend_right, line_styles, plain_log_ticks, seed_band


def synced_steps(runs: pd.DataFrame) -> pd.DataFrame:
    if "sync/bytes" not in runs or runs["sync/bytes"].dropna().empty:
        raise Absent("no run logged sync/bytes (every rollout engine was 'shared')")
    steps = runs.dropna(subset=["sync/bytes"]).copy()
    for key in ("sync/full_bytes", "sync/resyncs"):
        if key not in steps:
            steps[key] = float("nan")
    return steps


def table(runs: pd.DataFrame) -> Table:
    steps = synced_steps(runs)
    g = steps.groupby(GROUP, sort=True)
    data = pd.DataFrame({
        "method": g["method"].first(), "seeds": g["run"].nunique(), "steps": g.size(),
        "bytes_per_step": g["sync/bytes"].mean(), "bytes_max": g["sync/bytes"].max(),
        "full_bytes": g["sync/full_bytes"].median(), "resyncs": g["sync/resyncs"].sum(min_count=1),
    })
    data["ratio"] = data["bytes_per_step"] / data["full_bytes"]
    data = data.reset_index()
    unit = byte_unit(data["full_bytes"])
    mib = lambda v: f"{v / unit[1]:,.1f}" if pd.notna(v) else "—"  # noqa: E731
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"], "seeds": data["seeds"], "steps": data["steps"],
        f"payload per step ({unit[0]})": [mib(v) for v in data["bytes_per_step"]],
        f"largest payload ({unit[0]})": [mib(v) for v in data["bytes_max"]],
        f"full weights ({unit[0]})": [mib(v) for v in data["full_bytes"]],
        "payload / full": [fmt(r, 3) for r in data["ratio"]],
        "full resyncs": [str(int(r)) if pd.notna(r) else "—" for r in data["resyncs"]],
    })
    notes = ["payload per step = mean of sync/bytes over every step of every seed; "
             "full weights = sync/full_bytes (every parameter once)"]
    return Table("sync", "Weight-sync bytes per step vs a full-weight sync", data, shown, notes)


def figure(runs: pd.DataFrame):
    import matplotlib.pyplot as plt

    data = table(runs).data
    steps = synced_steps(runs)
    unit = byte_unit(pd.concat([data["full_bytes"], data["bytes_max"]]))
    color, look = colors(sorted(steps["variant"].unique())), line_styles(sorted(steps["variant"].unique()))
    labels = [v if data["task_label"].nunique() == 1 else f"{t}: {v}" for t, v in zip(data["task_label"], data["variant"])]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(14, max(3.5, 0.5 * len(data) + 2)))
    y = range(len(data))
    ax_b.barh(y, data["full_bytes"] / unit[1], color="0.85")
    ax_b.barh(y, data["bytes_per_step"] / unit[1], color=[color[v] for v in data["variant"]], height=0.5)
    for i, row in data.iterrows():
        ax_b.text(row["full_bytes"] / unit[1], i, f" {row['ratio']:.3f}× full", va="center", fontsize=8)
    ax_b.set_yticks(list(y), labels, fontsize=8)
    ax_b.invert_yaxis()
    ax_b.set(xlabel=f"bytes per step ({unit[0]})", title="mean payload per step (colour) vs full-weight sync (grey)",
             xlim=(0, 1.3 * max(data["full_bytes"].max(), data["bytes_max"].max()) / unit[1]))
    for (task, variant), frame in steps.groupby(GROUP, sort=True):
        label = variant if steps["task_label"].nunique() == 1 else f"{task}: {variant}"
        seed_band(ax_t, frame, "sync/bytes", color[variant], label, scale=1 / unit[1], **look[variant])
    for full in sorted(data["full_bytes"].dropna().unique()):
        ax_t.axhline(full / unit[1], color="0.4", linestyle="--", linewidth=1)
    ax_t.set(yscale="log", xlabel="GRPO step", ylabel=f"sync bytes ({unit[0]}, log scale)",
             title="sync bytes per step (dashed: full weights; spikes: full resyncs)")
    plain_log_ticks(ax_t)
    ax_t.grid(alpha=0.3, which="both")
    legend_right(ax_t)
    return fig
