"""Every table and figure of a results root (``python -m analysis <root>`` runs :func:`build`).

Loads every run directory under the root (``analysis.load``) and ``<root>/memory/memory.csv``
and ``<root>/time/time.csv`` when present, then writes ``<out>/tables/<name>.md|.tex`` (and ``runs.csv``, the tidy per-step
DataFrame) and ``<out>/figures/<name>.png|.pdf``, and ``<out>/tables/summary.md``: the headline
lines (each method's best learning rate, each method's accuracy difference to dense with its
interval) a results README opens with; ``--out`` defaults to the root. An output whose
data is absent (no run synced weights, no memory.csv, ...) is skipped with one line saying why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from analysis import accuracy, claims, control, intervals, kl, learning, lr_sweep, memory, seeds, steptime, sync, tradeoff
from analysis.load import load_memory_csv, load_runs
from analysis.render import Absent, Table, save_figure


@dataclass
class Results:
    root: Path
    runs: pd.DataFrame
    memory: pd.DataFrame | None

    @functools.cached_property
    def profile(self) -> pd.DataFrame:
        """The runs outside the seed study (:func:`analysis.seeds.outside`): what every output that reports
        accuracy or step control reads; the study's runs count in seed_study and the cost tables only."""
        return seeds.outside(self.runs)


TABLES: dict[str, Callable[[Results], Table]] = {
    "memory_step": lambda r: memory.step_table(r.memory),
    "memory_runs": lambda r: memory.runs_table(r.runs),
    "time_step": lambda r: steptime.step_table(steptime.load_time_csv(r.root)),
    "time_runs": lambda r: steptime.runs_table(r.runs),
    "accuracy": lambda r: accuracy.table(r.profile),
    "accuracy_intervals": lambda r: intervals.table(r.profile),
    "lr_sweep": lambda r: lr_sweep.table(r.profile),
    "sync": lambda r: sync.table(r.profile),
    "kl": lambda r: kl.table(r.profile),
    "control": lambda r: control.table(r.profile),
    "claims": lambda r: claims.table(r.root, r.profile),
    "seed_study": lambda r: seeds.table(r.runs),
}
FIGURES: dict[str, Callable[[Results], object]] = {
    "memory": lambda r: memory.figure(r.memory, r.runs),
    "memory_accuracy": lambda r: tradeoff.figure(r.memory, r.profile, r.root),
    "lr_sweep": lambda r: lr_sweep.figure(r.profile),
    "curves": lambda r: learning.figure(r.profile),
    "kl_scatter": lambda r: kl.scatter(r.profile),
    "scale_trace": lambda r: kl.scale_trace(r.profile),
    "sync_bytes": lambda r: sync.figure(r.profile),
}
# The headline lines of tables/summary.md: what a results README says first.
HEADLINES: dict[str, Callable[[Results], list[str]]] = {
    "best learning rates": lambda r: lr_sweep.headline(r.profile),
    "accuracy vs dense": lambda r: claims.headline(r.profile),
    "seed study": lambda r: seeds.headline(r.runs),
}
PROFILE_TABLES = ("accuracy", "accuracy_intervals", "lr_sweep", "sync", "kl", "control", "claims")
APART = "the seed study's {n} runs (fresh seeds {seeds}) are left out: only its stopping rule reads them (tables/seed_study.md)"
SUMMARY = "summary.md"
# Columns of runs.csv besides the metrics: what names a run and where it came from.
RUN_COLUMNS = ["run", "task_label", "variant", "family", "method", "seed", "model.name", "task.name", "git_sha", "done"]


def load(root: str | Path) -> Results:
    root = Path(root)
    return Results(root, load_runs(root), load_memory_csv(root))


def tables(results: Results) -> dict[str, Table | str]:
    """Every table, or the one-line reason it is absent; a table that reads :attr:`Results.profile` says
    which runs that leaves out."""
    out = {name: _try(build, results) for name, build in TABLES.items()}
    apart = results.runs[~results.runs["run"].isin(results.profile["run"])] if not results.runs.empty else results.runs
    if not apart.empty:
        seeds_apart = sorted(set(apart["seed"].astype(int)))
        note = APART.format(n=apart["run"].nunique(), seeds=", ".join(map(str, seeds_apart)))
        for name in PROFILE_TABLES:
            if isinstance(out.get(name), Table):
                out[name].notes.append(note)
    return out


def _try(build, results):
    try:
        return build(results)
    except Absent as why:
        return str(why)


def build(root: str | Path | Results, out: str | Path | None = None, log=print) -> list[Path]:
    """Write every table and figure of ``root`` (a path, or what :func:`load` returned) under ``out``
    (default: the root); returns the files written."""
    results = root if isinstance(root, Results) else load(root)
    out = Path(out) if out is not None else results.root
    log(f"[analysis] {results.root}: {results.runs['run'].nunique()} runs, "
        f"memory.csv {'found' if results.memory is not None else 'absent'}")
    written = []
    if not results.runs.empty:
        metrics = [c for c in results.runs.columns if "/" in c]
        path = out / "tables" / "runs.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        results.runs[[c for c in RUN_COLUMNS if c in results.runs] + ["step"] + metrics].to_csv(path, index=False)
        written.append(path)
    for name, table in tables(results).items():
        if isinstance(table, str):
            log(f"[analysis] skipped table {name}: {table}")
        else:
            written += table.write(out / "tables")
    for name, make in FIGURES.items():
        fig = _try(make, results)
        if isinstance(fig, str):
            log(f"[analysis] skipped figure {name}: {fig}")
        else:
            written += save_figure(fig, out / "figures", name)
    lines = summary_lines(results)
    if lines:
        path = out / "tables" / SUMMARY
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Summary of {results.root}\n\n" + "".join(f"- {line}\n" for line in lines))
        written.append(path)
    for path in written:
        log(f"wrote {path}")
    return written


def summary_lines(results: Results) -> list[str]:
    """Every headline line whose data is there (``HEADLINES``), in order."""
    lines = []
    for make in HEADLINES.values():
        got = _try(make, results)
        lines += [] if isinstance(got, str) else got
    return lines
