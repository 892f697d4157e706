"""Predicted-KL step control: the KL table, the predicted-vs-realized scatter and the scale trace.

Per step a controlled run logs ``kl/predicted`` (second-order KL of the proposed update),
``step/scale`` s = min(1, √(κ / kl/predicted)), ``kl/predicted_scaled`` = kl/predicted·s² (the
prediction for the applied update) and, with ``step_control.measure_realized``, ``kl/realized``
(the exact KL of the applied update on the same tokens). A good predictor puts realized on
predicted·s², i.e. on the y = x line of the scatter.

The table pools every logged step of every seed of a task × method variant: medians of the three
KLs, of realized / (predicted·s²) and of s, the fraction of steps that were shrunk (s < 1), and of
those the fraction whose realized KL landed within ± 25 % of the target κ.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis.render import GROUP, Absent, Table, colors, fmt, fmt_g, legend_right, plain_log_ticks, seed_band

TOLERANCE = 0.25  # |realized / κ − 1| ≤ 25 % counts as on target (docs/design.md §3.2)


def controlled_steps(runs: pd.DataFrame) -> pd.DataFrame:
    if "kl/predicted" not in runs or runs["kl/predicted"].dropna().empty:
        raise Absent("no run logged kl/predicted (step control off everywhere)")
    steps = runs.dropna(subset=["kl/predicted"]).copy()
    for key in ("kl/realized", "kl/predicted_scaled", "step/scale", "step_control.target_kl"):
        if key not in steps:
            steps[key] = math.nan
    steps["ratio"] = steps["kl/realized"] / steps["kl/predicted_scaled"]
    return steps


def table(runs: pd.DataFrame) -> Table:
    steps = controlled_steps(runs)
    rows = []
    for (task, variant), s in steps.groupby(GROUP, sort=True):
        target = s["step_control.target_kl"].dropna()
        kappa = float(target.iloc[0]) if len(target) and target.nunique() == 1 else math.nan
        shrunk = s[s["step/scale"] < 1]
        on_target = (shrunk["kl/realized"] / kappa - 1).abs() <= TOLERANCE
        rows.append({
            "task_label": task, "variant": variant, "seeds": s["run"].nunique(), "steps": len(s), "target_kl": kappa,
            "predicted_median": s["kl/predicted"].median(), "predicted_scaled_median": s["kl/predicted_scaled"].median(),
            "realized_median": s["kl/realized"].median(), "realized_max": s["kl/realized"].max(),
            "ratio_median": s["ratio"].median(), "ratio_min": s["ratio"].min(), "ratio_max": s["ratio"].max(),
            "scale_median": s["step/scale"].median(), "scale_min": s["step/scale"].min(),
            "shrunk_frac": len(shrunk) / len(s),
            "on_target_frac": on_target[shrunk["kl/realized"].notna()].mean()
            if shrunk["kl/realized"].notna().any() and not math.isnan(kappa) else math.nan,
        })
    data = pd.DataFrame(rows)
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"], "seeds": data["seeds"], "steps": data["steps"],
        "κ": [fmt_g(k) for k in data["target_kl"]],
        "predicted (median)": [fmt_g(v) for v in data["predicted_median"]],
        "predicted·s² (median)": [fmt_g(v) for v in data["predicted_scaled_median"]],
        "realized (median / max)": [f"{fmt_g(m)} / {fmt_g(x)}" if pd.notna(m) else "—"
                                    for m, x in zip(data["realized_median"], data["realized_max"])],
        "realized / predicted·s² (median, range)": [
            f"{fmt(m, 2)} ({fmt(lo, 2)}–{fmt(hi, 2)})" if pd.notna(m) else "—"
            for m, lo, hi in zip(data["ratio_median"], data["ratio_min"], data["ratio_max"])],
        "s (median / min)": [f"{fmt(m, 2)} / {fmt(lo, 2)}" for m, lo in zip(data["scale_median"], data["scale_min"])],
        "shrunk (s < 1)": [f"{100 * f:.0f} %" for f in data["shrunk_frac"]],
        "within ±25 % of κ (of the shrunk)": [f"{100 * f:.0f} %" if pd.notna(f) else "—" for f in data["on_target_frac"]],
    })
    notes = ["KL per token, pooled over every logged step of every seed; s = applied scale; "
             "κ = step_control.target_kl (≥ 1e9 means predict and log, never scale)"]
    return Table("kl", "Predicted-KL step control: predicted vs realized KL and the applied scale", data, shown, notes)


def scatter(runs: pd.DataFrame):
    import matplotlib.pyplot as plt

    steps = controlled_steps(runs)
    both = steps[(steps["kl/realized"] > 0) & (steps["kl/predicted_scaled"] > 0)]
    if both.empty:
        raise Absent("no run logged kl/realized beside kl/predicted (step_control.measure_realized=false)")
    color = colors(sorted(steps["variant"].unique()))
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    for (task, variant), s in both.groupby(GROUP, sort=True):
        label = variant if both["task_label"].nunique() == 1 else f"{task}: {variant}"
        ax.scatter(s["kl/predicted_scaled"], s["kl/realized"], s=18, alpha=0.75, color=color[variant], label=label)
    lo = min(both["kl/predicted_scaled"].min(), both["kl/realized"].min()) / 1.5
    hi = max(both["kl/predicted_scaled"].max(), both["kl/realized"].max()) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="y = x (exact prediction)")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), aspect="equal",
           xlabel="predicted KL of the applied update (kl/predicted · s²)",
           ylabel="realized KL (exact, same tokens)", title="Predicted vs realized KL per step (per token)")
    plain_log_ticks(ax, "both")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def scale_trace(runs: pd.DataFrame):
    import matplotlib.pyplot as plt

    steps = controlled_steps(runs)
    tasks = sorted(steps["task_label"].unique())
    color = colors(sorted(steps["variant"].unique()))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(15, 3.8 * len(tasks)), squeeze=False)
    for (ax_k, ax_s), task in zip(axes, tasks):
        targets = set()
        for variant, frame in steps[steps["task_label"] == task].groupby("variant", sort=True):
            seeds = frame["run"].nunique()
            label = f"{variant} ({seeds} seeds)" if seeds > 1 else variant
            seed_band(ax_k, frame, "kl/predicted", color[variant], label, marker=".")
            seed_band(ax_s, frame, "step/scale", color[variant], label, marker=".")
            targets |= {k for k in frame["step_control.target_kl"].dropna() if k < 1e6}  # 1e9: log only
        for kappa in sorted(targets):
            ax_k.axhline(kappa, color="0.3", linestyle=":", linewidth=1.2)
            ax_k.annotate(f"target κ = {kappa:g}", (0.01, kappa), xycoords=("axes fraction", "data"), ha="left", va="bottom",
                          fontsize=7, color="0.3")
        ax_k.set(yscale="log", xlabel="GRPO step", ylabel="predicted KL per token (log scale)",
                 title=f"{task}: predicted KL of the proposed update")
        ax_s.set(xlabel="GRPO step", ylabel="applied scale s", ylim=(0, 1.05),
                 title=f"{task}: step scale s = min(1, √(κ / predicted))")
        plain_log_ticks(ax_k)
        ax_k.grid(alpha=0.3, which="both")
        ax_s.grid(alpha=0.3)
        legend_right(ax_s)
    return fig

