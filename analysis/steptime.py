"""Step-time tables: a GRPO step's seconds by phase, median per method, × dense.

- ``time_step`` — ``<root>/time/time.csv`` (``python -m experiments.time_table``): one step per
  method on a fixed batch, methods interleaved in one process, every completion full length;
  the careful measurement (the cpu profile, results/time_table).
- ``time_runs`` — the training runs' own phase timers (``time/rollout_s``, ``time/fwd_bwd_s``,
  ``time/optimizer_s``, ``time/kl_predict_s``, ``time/kl_realized_s``, ``time/sync_s``, ``time/step_s``):
  per run the median over its steps, mean over the seeds whose runs logged phase timers (runs from
  before the timers are left out, not read as 0 s) per task × method variant; × dense paired by seed (on
  the seeds both ran). No second pass over the work, but the
  methods ran as separate runs on their own samples (a policy's answer lengths set its rollout time;
  the quick profile runs two at once, sharing the machine), so it is a first look, not ``time_step``'s
  comparison.

A phase a method does not run is 0 s and its × dense "—" where dense does not run it either.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.names import variant_names
from analysis.provenance import versions
from analysis.render import GROUP, Absent, Table, dense_reference, fmt

TIME_CSV = "time/time.csv"
TIME_RUNS_MD = "tables/time_runs.md"  # where python -m analysis writes runs_table
PHASES = ["rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync", "step"]
RUN_PHASES = {"rollout": "time/rollout_s", "reward": "time/reward_s", "old_logprobs": "time/old_logprobs_s",
              "fwd_bwd": "time/fwd_bwd_s", "optimizer": "time/optimizer_s", "kl_predict": "time/kl_predict_s",
              "kl_realized": "time/kl_realized_s", "sync": "time/sync_s",
              "step": "time/step_s"}  # the runs' keys (experiments/rl/metrics.py)


def load_time_csv(root: str | Path) -> pd.DataFrame | None:
    """``<root>/time/time.csv``, or None when absent."""
    path = Path(root) / TIME_CSV
    return read_time_csv(path) if path.exists() else None


def read_time_csv(path: str | Path) -> pd.DataFrame:
    """A time.csv wherever it is (``results/time_table/time.csv``), its columns checked."""
    table = pd.read_csv(path)
    missing = {"method", "phase", "median_s", "x_dense"} - set(table.columns)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    return table


def step_table(time: pd.DataFrame | None) -> Table:
    """Median seconds per phase and for the whole step, each method, with the step's × dense and its spread."""
    if time is None or time.empty:
        raise Absent("no <root>/time/time.csv (python -m experiments.time_table)")
    time = time.assign(model=time["model"] if "model" in time else "?")
    methods = list(dict.fromkeys(time["method"]))
    med = time.pivot_table(index=["model", "method"], columns="phase", values="median_s", sort=False)
    ratio = time.pivot_table(index=["model", "method"], columns="phase", values="x_dense", sort=False, dropna=False)
    data = med.reindex(columns=[p for p in PHASES if p in med.columns]).reset_index()
    data["method"] = pd.Categorical(data["method"], methods, ordered=True)
    data = data.sort_values(["model", "method"]).reset_index(drop=True)
    data["method"] = data["method"].astype(str)
    shown = pd.DataFrame({"model": data["model"], "method": data["method"]})
    for p in [p for p in PHASES if p in med.columns]:
        shown[f"{p} (s)"] = [fmt(v, 2) for v in data[p]]
    steps = time[time["phase"] == "step"].set_index(["model", "method"])
    keys = list(zip(data["model"], data["method"]))
    shown["step × dense"] = [fmt(ratio.loc[k, "step"], 2) if "step" in ratio.columns else "—" for k in keys]
    shown["fwd_bwd+optimizer × dense"] = [
        fmt((med.loc[k, "fwd_bwd"] + med.loc[k, "optimizer"]) / (med.loc[(k[0], "dense"), "fwd_bwd"] + med.loc[(k[0], "dense"), "optimizer"]), 2)
        if (k[0], "dense") in med.index else "—" for k in keys]
    shown["kl_predict / step"] = [f"{100 * med.loc[k, 'kl_predict'] / med.loc[k, 'step']:.1f} %" for k in keys]
    if {"min_s", "max_s"} <= set(steps.columns):
        shown["step min–max (s)"] = [f"{steps.loc[k, 'min_s']:.2f}–{steps.loc[k, 'max_s']:.2f}" for k in keys]
    notes = ["one GRPO step per method on a fixed batch, methods interleaved in one process, median over repeats "
             "(python -m experiments.time_table); a phase a method does not run is 0; kl_predict is shown apart from "
             "the optimizer phase that holds it; reward verification is not timed"]
    for col in ("device", "repeats", "git_sha"):
        if col in time:
            notes.append(f"{col} " + ", ".join(versions(time[col].dropna())))
    return Table("time_step", "Time of one training step, by phase", data, shown, notes)


def timed_runs(runs: pd.DataFrame) -> set[str]:
    """The runs that logged phase timers (``time/fwd_bwd_s`` on some step)."""
    return set(runs.loc[runs["time/fwd_bwd_s"].notna(), "run"]) if "time/fwd_bwd_s" in runs else set()


def each_run_times(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run that logged phase timers (:func:`timed_runs`; one from before the timers has
    no phase to read, not phases of 0 s): each phase's median seconds over its steps (a phase the run
    did not time is 0), its task × variant, seed and number of steps."""
    have = {p: k for p, k in RUN_PHASES.items() if k in runs}
    if "step" not in have or runs["time/step_s"].dropna().empty or "fwd_bwd" not in have:
        raise Absent("no run logged its phase times (time/step_s, time/fwd_bwd_s)")
    steps = runs[runs["run"].isin(timed_runs(runs))].dropna(subset=["time/step_s"])
    per_run = steps.groupby("run")[[have[p] for p in have]].median().fillna(0.0)
    per_run.columns = list(have)
    first = steps.groupby("run")[GROUP + ["seed"]].first()
    return per_run.join(first).join(steps.groupby("run").size().rename("steps")).reset_index()


def per_run_times(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per task × variant: each phase's median seconds over a run's steps, mean over seeds (``per_run``:
    :func:`each_run_times`), the seeds, and the steps per run."""
    phases = [p for p in RUN_PHASES if p in per_run.columns]
    g = per_run.groupby(GROUP, sort=True)
    data = g[phases].mean()
    data.insert(0, "seeds", g.size())
    data.insert(1, "steps", g["steps"].min())
    return data.reset_index()


def paired_ratios(per_run: pd.DataFrame, ref: dict) -> pd.DataFrame:
    """Per task × variant, its step and its fwd_bwd + optimizer over the dense reference's (``ref``:
    task → dense variant), each a mean over the seeds both ran over dense's mean on those seeds (a
    seed only one of them ran, as while a sweep's runs land, would tilt the ratio by its own noise);
    ``paired``: how many seeds, 0 (and NaN ratios) where they share none or the task has no dense
    (``per_run``: :func:`each_run_times`)."""
    per_run = per_run.assign(train=per_run["fwd_bwd"] + per_run.get("optimizer", 0.0))
    rows = []
    for (task, variant), group in per_run.groupby(GROUP, sort=True):
        dense = per_run[(per_run["task_label"] == task) & (per_run["variant"] == ref.get(task))].groupby("seed").mean(numeric_only=True)
        mine = group.groupby("seed").mean(numeric_only=True)
        both = mine.index.intersection(dense.index)
        ratio = lambda col: mine.loc[both, col].mean() / dense.loc[both, col].mean() if len(both) else float("nan")  # noqa: E731
        rows.append({"task_label": task, "variant": variant, "paired": len(both), "dense_seeds": len(dense),
                     "x_dense": ratio("step"), "train_x_dense": ratio("train")})
    return pd.DataFrame(rows)


def runs_table(runs: pd.DataFrame) -> Table:
    """The runs' own phase timers: median seconds per phase, the step × dense, and the KL prediction's share."""
    per_run = each_run_times(runs)
    data = per_run_times(per_run)
    phases = [p for p in RUN_PHASES if p in data.columns]
    data = data.merge(paired_ratios(per_run, dense_reference(runs)), on=GROUP, how="left")
    named = variant_names(runs)
    shown = pd.DataFrame({"task": data["task_label"],
                          "method": [named.get((t, v), v) for t, v in zip(data["task_label"], data["variant"])],
                          "seeds": data["seeds"], "steps": data["steps"]})
    for p in phases:
        shown[f"{p} (s)"] = [fmt(v, 2) for v in data[p]]
    shown["step × dense"] = [fmt(v, 2) for v in data["x_dense"]]
    shown["fwd_bwd+optimizer × dense"] = [fmt(v, 2) for v in data["train_x_dense"]]
    if "kl_predict" in data:
        shown["kl_predict / step"] = [f"{100 * k / t:.1f} %" for k, t in zip(data["kl_predict"], data["step"])]
    notes = ["the training runs' own phase timers: median over a run's steps, mean over seeds; step = rollout + "
             "reward + the update (fwd_bwd, optimizer, kl_predict, kl_realized, sync); each method a separate run on its own "
             "samples (answer lengths set the rollout time), runs sharing the machine as the launcher ran them: a first look — python -m experiments.time_table "
             "(tables/time_step) times them interleaved on a fixed batch"]
    unpaired = data[(data["dense_seeds"] > 0) & ((data["paired"] < data["seeds"]) | (data["paired"] < data["dense_seeds"]))]
    if not unpaired.empty:
        notes.append("× dense is paired by seed (a method's mean over dense's on the seeds both ran); here not every "
                     "seed has both: " + "; ".join(
                         f"{t} {named.get((t, v), v)} on {p} (it ran {n}, dense {d})" for t, v, p, n, d in
                         zip(unpaired["task_label"], unpaired["variant"], unpaired["paired"], unpaired["seeds"],
                             unpaired["dense_seeds"])))
    timed = timed_runs(runs)
    if untimed := set(runs["run"]) - timed:
        notes.append(f"seeds: the runs with phase timers; {len(untimed)} run(s) from before the timers are left out")
    measured = set(runs.loc[runs["kl/realized"].notna(), "run"]) if "kl/realized" in runs else set()
    split = set(runs.loc[runs["time/kl_realized_s"].notna(), "run"]) if "time/kl_realized_s" in runs else set()
    if (measured - split) & timed:
        notes.append("runs that measured the realized KL (step_control.measure_realized: two more forwards of the batch) "
                     "before time/kl_realized_s existed count those forwards in their optimizer phase")
    return Table("time_runs", "Time of a training step by phase, from the runs", data, shown, notes)
