"""This run beside a reference: the headline tables of two results roots and their difference.

    python -m analysis.compare runs/quick results/quick        # ./run_all.sh prints this at the end

``./run_all.sh`` trains into ``runs/<profile>/`` and compares with the committed reference
``results/<profile>/``. Three tables, each joined on what names a row in both roots:

- accuracy — per task × method variant (``analysis.accuracy``): held-out greedy pass@1 at the
  first and the last evaluation, mean over seeds, and Δ = this − reference in percentage points;
- memory — per model × method, the one-step peak of ``<root>/memory/memory.csv``
  (``analysis.memory.step_table``) in MiB and × dense, and ratio = this / reference, when both
  roots have it; else the runs' own largest step peak (``analysis.memory.runs_table``: the
  profiler's live tensors where the runs ran it, ``log.memory_profile=true``; else ``mem/peak_bytes``);
- time — per task × method variant, the median ``time/step_s`` over the steps of the runs (mean
  over seeds) and × dense, ratio = this / reference; and, when either root has it, ``<root>/time/time.csv``
  (``python -m experiments.time_table out=<root>/time``: per method, the whole step's median seconds
  and × dense, as this / reference).

A row present in one root only is shown with "—" on the other side. Seconds depend on the machine
and on what else ran on it: a time ratio far from 1 says "look", not "slower code".
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import accuracy, memory, steptime
from analysis.cli import root_cli
from analysis.load import load_memory_csv, load_runs
from analysis.render import GROUP, Absent, Table, dense_reference, fmt, fmt_g

TIME_CSV = Path("time") / "time.csv"  # python -m experiments.time_table out=<root>/time
TIME_HEADLINE = ["median_s", "x_dense"]  # the time table's columns worth a comparison, when it has them
TIME_PROVENANCE = {"git_sha", "time", "command"}  # text columns that do not name a row


def _pp(value) -> str:
    return fmt(100 * value, 1) if pd.notna(value) else "—"


def _side_by_side(this: pd.DataFrame | None, ref: pd.DataFrame | None, keys: list[str]) -> pd.DataFrame:
    """Outer join of two per-row frames on ``keys`` (a missing side: no rows); every other column
    suffixed ``_this`` / ``_ref``."""
    like = this if this is not None else ref
    empty = pd.DataFrame({c: pd.Series(dtype=object if c in keys else float) for c in like.columns})
    this, ref = (f if f is not None else empty for f in (this, ref))
    return this.merge(ref, on=keys, how="outer", suffixes=("_this", "_ref")).sort_values(keys, ignore_index=True)


def _accuracy_rows(runs: pd.DataFrame) -> pd.DataFrame | None:
    try:
        per = accuracy.per_run_accuracy(runs)
    except Absent:
        return None
    g = per.groupby(GROUP)
    return pd.DataFrame({"seeds": g.size(), "start": g["start"].mean(), "end": g["end"].mean(),
                         "end_std": g["end"].std(), "end_step": g["end_step"].max()}).reset_index()


def accuracy_table(this_runs: pd.DataFrame, ref_runs: pd.DataFrame) -> Table:
    """End (and start) accuracy of both roots per task × variant, Δ end = this − reference (pp)."""
    a, b = _accuracy_rows(this_runs), _accuracy_rows(ref_runs)
    if a is None and b is None:
        raise Absent("no run in either root logged eval/accuracy")
    data = _side_by_side(a, b, GROUP)
    data["delta_end"] = data["end_this"] - data["end_ref"]
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"],
        "seeds (this/ref)": [f"{_count(x)}/{_count(y)}" for x, y in zip(data["seeds_this"], data["seeds_ref"])],
        "start this (%)": [_pp(v) for v in data["start_this"]], "start ref (%)": [_pp(v) for v in data["start_ref"]],
        "end this (%)": [_pp(v) for v in data["end_this"]], "end ref (%)": [_pp(v) for v in data["end_ref"]],
        "Δ end (pp)": [fmt(100 * d, 1, signed=True) if pd.notna(d) else "—" for d in data["delta_end"]],
    })
    notes = ["greedy pass@1 on the held-out problems, mean over seeds; start = first evaluation, end = last; "
             "Δ = this run − reference"]
    return Table("compare_accuracy", "Held-out accuracy: this run vs the reference", data, shown, notes)


def _count(n) -> str:
    return str(int(n)) if pd.notna(n) else "0"


def _step_memory(mem: pd.DataFrame | None) -> pd.DataFrame | None:
    try:
        data = memory.step_table(mem).data
    except Absent:
        return None
    return data[["model", "method", "peak_bytes", "ratio"]]


def _run_memory(runs: pd.DataFrame) -> pd.DataFrame | None:
    try:
        data = memory.runs_table(runs).data
    except Absent:
        return None
    return data[GROUP + ["peak_bytes", "ratio", "profiled"]]


def _run_source(frame: pd.DataFrame | None) -> str:
    if frame is None:
        return "none"
    return ("live tensors at the step's peak (the runs' profiler, log.memory_profile=true)" if frame["profiled"].all()
            else "mem/peak_bytes (CUDA: allocator; CPU: process peak RSS)")


def memory_table(this_root: Path, ref_root: Path, this_runs: pd.DataFrame, ref_runs: pd.DataFrame) -> Table:
    """One-step peak (memory.csv) of both roots when both have it, else the runs' own step peaks."""
    a, b = _step_memory(load_memory_csv(this_root)), _step_memory(load_memory_csv(ref_root))
    ra, rb = _run_memory(this_runs), _run_memory(ref_runs)
    notes = []
    if (a is not None and b is not None) or (ra is None and rb is None):
        if a is None and b is None:
            raise Absent("no memory.csv and no run logged mem/peak_bytes in either root")
        keys, notes = ["model", "method"], ["one GRPO step per method in a fresh process (<root>/memory/memory.csv)"]
    else:
        a, b = ra, rb
        keys = GROUP
        this_src, ref_src = _run_source(a), _run_source(b)
        notes = [f"the training runs' largest step peak, mean over seeds: {this_src}"
                 + ("" if ref_src in (this_src, "none") else f" (the reference: {ref_src}: not the same measurement)")]
        a, b = (f.drop(columns="profiled") if f is not None else None for f in (a, b))
    data = _side_by_side(a, b, keys)
    data["this_over_ref"] = data["peak_bytes_this"] / data["peak_bytes_ref"]
    mib = lambda v: f"{v / 2**20:,.1f}" if pd.notna(v) else "—"  # noqa: E731
    shown = pd.DataFrame({
        ("task" if k == "task_label" else "method" if k == "variant" else k): data[k] for k in keys})
    shown["peak this (MiB)"] = [mib(v) for v in data["peak_bytes_this"]]
    shown["peak ref (MiB)"] = [mib(v) for v in data["peak_bytes_ref"]]
    shown["× dense this"] = [fmt(v, 2) for v in data["ratio_this"]]
    shown["× dense ref"] = [fmt(v, 2) for v in data["ratio_ref"]]
    shown["this / ref"] = [fmt(v, 3) for v in data["this_over_ref"]]
    return Table("compare_memory", "Peak memory: this run vs the reference", data, shown, notes)


def _step_time(runs: pd.DataFrame) -> pd.DataFrame | None:
    if "time/step_s" not in runs or runs["time/step_s"].dropna().empty:
        return None
    per_run = runs.dropna(subset=["time/step_s"]).groupby("run").agg(
        task_label=("task_label", "first"), variant=("variant", "first"), step_s=("time/step_s", "median"))
    g = per_run.groupby(GROUP)
    out = pd.DataFrame({"step_s": g["step_s"].mean()}).reset_index()
    dense = {task: out[(out["task_label"] == task) & (out["variant"] == v)]["step_s"]
             for task, v in dense_reference(runs).items()}
    out["x_dense"] = [s / dense[t].iloc[0] if t in dense and len(dense[t]) else float("nan")
                      for t, s in zip(out["task_label"], out["step_s"])]
    return out


def time_table(this_runs: pd.DataFrame, ref_runs: pd.DataFrame) -> Table:
    """Median seconds per GRPO step of both roots per task × variant, and × dense."""
    a, b = _step_time(this_runs), _step_time(ref_runs)
    if a is None and b is None:
        raise Absent("no run in either root logged time/step_s")
    data = _side_by_side(a, b, GROUP)
    data["this_over_ref"] = data["step_s_this"] / data["step_s_ref"]
    shown = pd.DataFrame({"task": data["task_label"], "method": data["variant"],
                          "s/step this": [fmt(v, 1) for v in data["step_s_this"]],
                          "s/step ref": [fmt(v, 1) for v in data["step_s_ref"]],
                          "this / ref": [fmt(v, 2) for v in data["this_over_ref"]],
                          "× dense this": [fmt(v, 2) for v in data["x_dense_this"]],
                          "× dense ref": [fmt(v, 2) for v in data["x_dense_ref"]]})
    notes = ["median time/step_s over a run's steps, mean over seeds; seconds depend on the machine and its load"
             + (f"; this run's step by phase: <root>/{steptime.TIME_RUNS_MD}" if "time/fwd_bwd_s" in this_runs else "")]
    return Table("compare_time", "Seconds per training step: this run vs the reference", data, shown, notes)


def read_time_csv(root: Path) -> pd.DataFrame | None:
    path = Path(root) / TIME_CSV
    return pd.read_csv(path) if path.exists() else None


def time_csv_table(this_root: Path, ref_root: Path) -> Table:
    """``<root>/time/time.csv`` of both roots (``python -m experiments.time_table out=<root>/time``):
    its text columns but :data:`TIME_PROVENANCE` name a row, the :data:`TIME_HEADLINE` columns (else
    every numeric one) are compared; of a per-phase table only the whole step's rows are shown."""
    a, b = read_time_csv(this_root), read_time_csv(ref_root)
    if a is None and b is None:
        raise Absent(f"no {TIME_CSV} in either root")
    frames = [f for f in (a, b) if f is not None]
    if all("phase" in f and (f["phase"] == "step").any() for f in frames):
        a, b = (f[f["phase"] == "step"] if f is not None else None for f in (a, b))
        frames = [f for f in (a, b) if f is not None]
    numeric = [c for c in frames[0].columns if all(c in f and pd.api.types.is_numeric_dtype(f[c]) for f in frames)]
    keys = [c for c in frames[0].columns
            if c not in numeric and c not in TIME_PROVENANCE and all(c in f for f in frames)]
    shown_cols = [c for c in TIME_HEADLINE if c in numeric] or numeric
    if not keys:
        raise Absent(f"{TIME_CSV}: no text column to match rows on")
    data = _side_by_side(a[keys + shown_cols] if a is not None else None,
                         b[keys + shown_cols] if b is not None else None, keys)
    shown = data[keys].astype(str).copy()
    for c in shown_cols:
        this, ref = data[f"{c}_this"], data[f"{c}_ref"]
        shown[f"{c} this"] = [fmt_g(v, 4) for v in this]
        shown[f"{c} ref"] = [fmt_g(v, 4) for v in ref]
        shown[f"{c} this/ref"] = [fmt(x / y, 2) if pd.notna(x) and pd.notna(y) and y else "—" for x, y in zip(this, ref)]
    return Table("compare_time_table", f"Time table ({TIME_CSV}): this run vs the reference", data, shown,
                 ["rows matched on " + ", ".join(keys)])


def tables(this_root: str | Path, ref_root: str | Path) -> dict[str, Table | str]:
    """Every comparison table, or the one-line reason it is absent."""
    this_root, ref_root = Path(this_root), Path(ref_root)
    this_runs = load_runs(this_root)
    ref_runs = load_runs(ref_root) if ref_root.is_dir() else this_runs.iloc[0:0]
    builders = {
        "accuracy": lambda: accuracy_table(this_runs, ref_runs),
        "memory": lambda: memory_table(this_root, ref_root, this_runs, ref_runs),
        "time": lambda: time_table(this_runs, ref_runs),
        "time table": lambda: time_csv_table(this_root, ref_root),
    }
    out: dict[str, Table | str] = {}
    for name, build in builders.items():
        try:
            out[name] = build()
        except Absent as why:
            out[name] = str(why)
    return out


def report(this_root: str | Path, ref_root: str | Path) -> str:
    """The printed comparison: a header naming both roots, each table (or why it is absent), and
    where this run's tables and figures are."""
    this_root, ref_root = Path(this_root), Path(ref_root)
    lines = [f"# This run ({this_root}) vs the reference ({ref_root})", ""]
    if not ref_root.is_dir():
        lines += [f"no reference: {ref_root} does not exist; this run's figures alone are shown", ""]
    for name, table in tables(this_root, ref_root).items():
        lines += [table.markdown() if isinstance(table, Table) else f"({name}: {table})", ""]
    found = [d for d in ("tables", "figures", "memory", str(TIME_CSV.parent)) if (this_root / d).is_dir()]
    lines.append("this run's figures: " + (", ".join(f"{this_root / d}/" for d in found) or "none written")
                 + f"; the reference's: {ref_root}/ (README.md there says how it was made)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = root_cli("python -m analysis.compare", __doc__, argv, root_help="this run's results root, e.g. runs/quick",
                    extra=[("reference", {"type": Path, "help": "the reference root, e.g. results/quick"})])
    print(report(args.root, args.reference), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
