"""The step-time table: one GRPO step per method by phase (``<root>/time/time.csv``, written by
``python -m experiments.time_table``), median seconds per phase and the whole step, × dense.

A phase a method does not run is 0 s and its × dense "—" where dense does not run it either.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.provenance import versions
from analysis.render import Absent, Table, fmt

TIME_CSV = "time/time.csv"
PHASES = ["rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync", "step"]


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
