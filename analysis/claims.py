"""The claims table: LoGRA's claims against dense AdamW, each with the number this harness measured,
its scale and caveats, and the results folder it comes from, for one results root (README's headline
table is rendered across the committed folders by ``analysis/readme.py``).

Rows (``METHOD`` vs ``REFERENCE``), each "not run" when its input is absent:

- memory: peak bytes of one GRPO step, method / reference, from ``memory.csv``
  (``memory.step_table``), one value per method row of the table (``logra``, ``logra:logra.embeddings=true``);
- accuracy: final greedy pass@1, method − reference in percentage points with the 95 % interval over
  seeds and problems (t, ``analysis/crossed.py``) and the ≥ −5 pp verdict (``analysis/intervals.py``),
  one row per task and method variant of the root's runs, with the git shas of the runs it compares;
- step time: the whole GRPO step's median seconds, method / reference (the ``step`` phase's
  ``x_dense`` of ``time.csv``, ``steptime``), one value per method row;
- sync bytes: mean bytes a step sends to the rollout engine / a full-weight sync (``sync.table``),
  one value per method variant that synced.

Each input is looked for in the root first, then in the committed folder that holds it alone
(``SOURCES``): ``<root>/memory/memory.csv``, else ``results/memory_table/memory.csv``;
``<root>/time/time.csv``, else ``results/time_table/time.csv``; the root's runs, else
``results/quick``'s for sync bytes. The folder a number came from is in its row, and the code version
that made it: every sha whole, its "-dirty" marker kept (``analysis/provenance.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis import intervals, lr_sweep, memory, steptime, sync
from analysis.load import load_runs, per_run, read_memory_csv
from analysis.provenance import versions
from analysis.render import Absent, Table, fmt

METHOD, REFERENCE = "logra", "dense"  # the claim: METHOD's memory, accuracy, time and sync against REFERENCE's
REPO = Path(__file__).resolve().parents[1]
NOT_RUN = "not run"


@dataclass(frozen=True)
class Source:
    """Where an input lives: ``own`` under the root, else ``results/<folder>/<file>`` beside the root or in the repo."""

    own: str
    folder: str
    file: str

    def candidates(self, root: Path) -> list[Path]:
        """The places to look, in order (each once)."""
        paths = [root / self.own, root.parent / self.folder / self.file, REPO / "results" / self.folder / self.file]
        return [p for i, p in enumerate(paths) if p.resolve() not in {q.resolve() for q in paths[:i]}]

    def find(self, root: Path) -> Path | None:
        return next((p for p in self.candidates(root) if p.exists()), None)


SOURCES = {"memory": Source("memory/memory.csv", "memory_table", "memory.csv"),
           "time": Source("time/time.csv", "time_table", "time.csv"),
           "sync": Source(".", "quick", ".")}  # run directories: the root itself, else results/quick


def _where(path: Path) -> str:
    """A folder as the reader finds it: relative to the working directory when below it."""
    rel = os.path.relpath(path.resolve(), Path.cwd())
    return rel if not rel.startswith("..") else str(path)


def _method_rows(labels: pd.Series) -> pd.Series:
    """Which labels (``logra``, ``logra:logra.embeddings=true``, ``logra lr=4e-05``) are METHOD's."""
    return labels.astype(str).str.split(r"[: ]", regex=True).str[0] == METHOD


def memory_rows(root: Path) -> list[dict]:
    path = SOURCES["memory"].find(root)
    claim = f"peak memory of one training step, {METHOD} / {REFERENCE}"
    if path is None:
        return [{"claim": claim, "measured": NOT_RUN, "scale": "", "results": ""}]
    data = memory.step_table(read_memory_csv(path)).data
    mine = data[_method_rows(data["method"]) & data["ratio"].notna()]
    measured = "; ".join(f"{fmt(r.ratio, 3)} ({r.method})" for r in mine.itertuples()) or NOT_RUN
    shas = versions(data.get("git_sha", pd.Series(dtype=str)).dropna())
    scale = f"{', '.join(sorted(set(data['model'])))}; one GRPO step, fresh process per method; profiler peak"
    return [{"claim": claim, "measured": measured, "scale": scale + (f"; sha {', '.join(shas)}" if shas else ""),
             "results": _where(path.parent)}]


def accuracy_rows(root: Path, runs: pd.DataFrame) -> list[dict]:
    claim = f"equal accuracy: final greedy pass@1, {METHOD} − {REFERENCE}"
    try:
        data = intervals.table(runs).data
    except Absent:
        data = pd.DataFrame(columns=["variant", "delta"])
    mine = data[_method_rows(data["variant"]) & data["delta"].notna()]
    if mine.empty:
        return [{"claim": claim, "measured": NOT_RUN, "scale": f"no {METHOD} and {REFERENCE} runs with evaluations",
                 "results": _where(root)}]
    rows = []
    for r in mine.itertuples():
        of = runs[(runs["task_label"] == r.task_label) & (runs["variant"] == r.variant)]
        both = per_run(runs[(runs["task_label"] == r.task_label) & runs["variant"].isin([r.variant, r.reference])])
        model = "/".join(sorted(set(of["model.name"].dropna().astype(str)))) if "model.name" in of else "?"
        dtype = "/".join(sorted(set(of["model.dtype"].dropna().astype(str)))) if "model.dtype" in of else ""
        steps = int(of["step"].max())
        rows.append({
            "claim": f"{claim} ({r.task_label}; {r.variant} vs {r.reference})",
            "measured": (f"{fmt(100 * r.delta, 1, signed=True)} pp, 95 % interval "
                         f"{intervals.interval_text(r.delta_low, r.delta_high, signed=True)}; ≥ −5 pp: {r.verdict}"),
            "scale": f"{model} {dtype}, {r.delta_seeds} seed{'s' if r.delta_seeds > 1 else ''} × {steps} steps, "
                     f"{r.problems} held-out problems; {r.pairing.split(':')[0]} t-interval over seeds and problems; "
                     f"runs at {', '.join(versions(both['git_sha']))}",
            "results": _where(root)})
    return rows


def time_rows(root: Path) -> list[dict]:
    path = SOURCES["time"].find(root)
    claim = f"step time: one GRPO step, {METHOD} / {REFERENCE}"
    if path is None:
        return [{"claim": claim, "measured": NOT_RUN, "scale": "", "results": ""}]
    time = steptime.read_time_csv(path)
    step = time[(time["phase"] == "step") & _method_rows(time["method"]) & time["x_dense"].notna()]
    measured = "; ".join(f"{fmt(r.x_dense, 2)} ({r.method})" for r in step.itertuples()) or NOT_RUN
    details = [f"{c} {', '.join(sorted({str(v) for v in time[c].dropna()}))}" for c in ("device", "repeats") if c in time]
    details += [f"git_sha {', '.join(versions(time['git_sha'].dropna()))}"] if "git_sha" in time else []
    scale = "median over repeats, methods interleaved in one process; " + "; ".join(details)
    return [{"claim": claim, "measured": measured, "scale": scale, "results": _where(path.parent)}]


def sync_rows(root: Path, runs: pd.DataFrame) -> list[dict]:
    claim = f"weight sync: bytes per step, {METHOD} / a full-weight sync"
    for where in SOURCES["sync"].candidates(root):
        if not where.is_dir():
            continue
        try:
            data = sync.table(runs if where == root / "." else load_runs(where)).data
        except Absent:
            continue
        mine = data[_method_rows(data["variant"])]
        if mine.empty:
            continue
        measured = "; ".join(f"{fmt(r.ratio, 3)} ({r.task_label}: {r.variant})" for r in mine.itertuples())
        return [{"claim": claim, "measured": measured, "scale": "mean sync/bytes over every step / sync/full_bytes "
                 "(a ratio of shapes and rank; full resyncs included)", "results": _where(where)}]
    return [{"claim": claim, "measured": NOT_RUN, "scale": "", "results": ""}]


def table(root: str | Path, runs: pd.DataFrame) -> Table:
    root = Path(root)
    rows = memory_rows(root) + accuracy_rows(root, runs) + time_rows(root) + sync_rows(root, runs)
    data = pd.DataFrame(rows)
    shown = pd.DataFrame({"claim": data["claim"], "measured": data["measured"], "scale and caveats": data["scale"],
                          "results": [r or "—" for r in data["results"]]})
    notes = [f"{NOT_RUN}: the input is absent (no memory.csv, no time.csv, no {METHOD} and {REFERENCE} runs, no sync metrics)",
             "accuracy: Δ and its 95 % interval as in tables/accuracy_intervals.md (analysis/crossed.py); "
             "≥ −5 pp: yes / no / undecided by whether the interval lies above, below or across −5 pp"]
    return Table("claims", f"Claims: {METHOD} against {REFERENCE}, as measured", data, shown, notes)


def headline(runs: pd.DataFrame) -> list[str]:
    """The accuracy claim in a line per task and METHOD variant (``intervals.headline``); in a root that
    swept learning rates, only each family's best rate (``lr_sweep``)."""
    data = intervals.table(runs).data
    data = data[_method_rows(data["variant"])]
    try:
        sweep = lr_sweep.table(runs).data
    except Absent:
        return intervals.headline(data)
    swept = set(zip(sweep["task_label"], sweep["variant"]))
    best = set(zip(sweep[sweep["best"]]["task_label"], sweep[sweep["best"]]["variant"]))
    keep = pd.Series([(t, v) not in swept or (t, v) in best for t, v in zip(data["task_label"], data["variant"])],
                     index=data.index, dtype=bool)
    return intervals.headline(data[keep])
