"""Every run directory under a results root, as one tidy DataFrame.

    from analysis.load import load_runs, load_memory_csv
    runs = load_runs("results/quick")          # one row per (run, step)
    mem = load_memory_csv("results/quick")     # <root>/memory/memory.csv, or None
    some = load_dirs(["results/a/run1", "results/b/run2"])   # named run directories, same columns

The one loader of the analysis: the root-wide report (``python -m analysis <root>``) and the
per-run-directory tools (``analysis.summary``, ``analysis.curves``, ``analysis.traces``) all read
run directories through :func:`read_run`.

A run directory is any folder below the root holding ``config.yaml`` and ``metrics.jsonl`` (the
trainer's ``out_dir``), at any depth; ``checkpoints/`` folders are not searched. Each row of
:func:`load_runs` is one line of a run's ``metrics.jsonl`` (so one step), with

- ``run``: the run directory relative to the root, ``run_dir``: its absolute path;
- the resolved config flattened to dotted columns (``method``, ``seed``, ``task.name``,
  ``logra.lr``, ``step_control.target_kl``, ...; lists as JSON strings);
- ``git_sha`` from ``meta.json`` and ``done`` (a ``done.json`` marker from the launcher is there);
- the metric columns with their namespaced keys (``reward/mean``, ``eval/accuracy``, ``mem/...``;
  documented in ``experiments/rl/metrics.py``), NaN where a step did not log a key;
- ``task_label``, ``variant`` and ``family``: what the tables group by (below).

Grouping. Runs that differ only in seed are repeats of one experiment. :func:`label_runs` names
the experiment: ``task_label`` is ``task.name`` plus the ``task.*`` keys that differ between runs
of that task (``arith digits=3``) and, when the root holds several models, the model
(``gsm8k (qwen2.5-7b)``), so that every comparison stays within one task and model. ``variant`` is
the method plus the keys of its own config section and of the shared sections (model settings,
rollout, train, eval, step_control) that differ between its runs on some task (``logra lr=4e-05``,
``logra target_kl=0.01``), named by the same keys on every task. Seeds, paths, devices, logging
and checkpointing never make a variant, nor do step control's settings in a run that never ran it.
``family`` is the variant without its learning-rate keys
(:func:`is_rate_key`: ``logra`` and ``logra step_control.enabled=False`` in a learning-rate sweep):
the runs a learning-rate sweep compares along its rates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import yaml

CONFIG, METRICS, META, DONE = "config.yaml", "metrics.jsonl", "meta.json", "done.json"
MEMORY_CSV = Path("memory") / "memory.csv"
MEMORY_COLUMNS = ["method", "model", "peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
                  "activations_bytes", "peak_rss_bytes", "planner_bytes", "git_sha"]
EMPTY_COLUMNS = ["run", "step", "method", "seed", "task_label", "variant", "family"]  # a root without runs
SKIP_DIRS = {"checkpoints", "tb", "tables", "figures", "__pycache__", ".ipynb_checkpoints"}

# Config keys that never define an experiment: repeats, bookkeeping, where things live.
IGNORED_SECTIONS = ("log.", "checkpoint.")
IGNORED_KEYS = {"seed", "out_dir", "resume", "device", "threads", "task.data_dir", "model.cache_dir",
                "task.reward_workers", "task.reward_timeout_s", "eval.batch_size", "rollout.batch_size"}
# Shared sections whose differences name a method variant (a method's own section is added per method).
VARIANT_SECTIONS = ("model.", "rollout.", "train.", "eval.", "step_control.")


def find_runs(root: str | Path) -> list[Path]:
    """Run directories under ``root`` (the root itself included), sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results root {root} is not a directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if CONFIG in filenames and METRICS in filenames:
            found.append(Path(dirpath))
            dirnames[:] = []  # a run directory holds no further runs
        else:
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
    return sorted(found)


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": "[1, 2]"}``."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(list(value))
        else:
            flat[name] = value
    return flat


def read_run(run_dir: Path, root: Path) -> pd.DataFrame:
    """One run directory as rows (one per metrics line) with its config, git sha and done marker."""
    cfg = yaml.safe_load((run_dir / CONFIG).read_text()) or {}
    meta_path = run_dir / META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    records = []
    for n, line in enumerate((run_dir / METRICS).read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write: keep what came before
                print(f"[analysis] {run_dir / METRICS}:{n}: not JSON, ignored")
    frame = pd.DataFrame.from_records(records)
    if frame.empty:
        return frame
    frame = frame.drop_duplicates("step", keep="last").sort_values("step", ignore_index=True)
    info = {"run": str(run_dir.relative_to(root)) if run_dir != root else run_dir.name,
            "run_dir": str(run_dir.resolve()), **flatten(cfg),
            "git_sha": meta.get("git_sha", "unknown"), "done": (run_dir / DONE).exists()}
    return pd.concat([pd.DataFrame({k: [v] * len(frame) for k, v in info.items()}), frame], axis=1)


def load_runs(root: str | Path) -> pd.DataFrame:
    """Every run under ``root`` in one DataFrame, one row per (run, step); empty if none."""
    root = Path(root)
    frames = []
    for run_dir in find_runs(root):
        frame = read_run(run_dir, root)
        if frame.empty:
            print(f"[analysis] {run_dir}: no metrics yet, skipped")
        else:
            frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=EMPTY_COLUMNS)
    return label_runs(pd.concat(frames, ignore_index=True))


def load_dirs(run_dirs) -> pd.DataFrame:
    """The named run directories (not searched below), in the given order, as :func:`load_runs`
    gives them; ``run`` is the directory's name (its path where two names collide). A directory
    without ``config.yaml`` and ``metrics.jsonl`` is an error naming it."""
    run_dirs = [Path(d) for d in run_dirs]
    missing = [str(d) for d in run_dirs if not ((d / CONFIG).is_file() and (d / METRICS).is_file())]
    if missing:
        raise FileNotFoundError(f"not run directories (need {CONFIG} and {METRICS}): {', '.join(missing)}")
    names = [d.resolve().name for d in run_dirs]
    frames = []
    for d, name in zip(run_dirs, names):
        frame = read_run(d, d)
        if frame.empty:
            print(f"[analysis] {d}: no metrics yet, skipped")
            continue
        frames.append(frame.assign(run=name if names.count(name) == 1 else str(d)))
    if not frames:
        return pd.DataFrame(columns=EMPTY_COLUMNS)
    return label_runs(pd.concat(frames, ignore_index=True))


def dir_labels(runs: pd.DataFrame) -> dict[str, str]:
    """``run`` -> ``"<run> (<method> lr=<its lr>)"`` (just the method part where it equals the run's
    name): how the per-run-directory tools name a run in legends and tables."""
    labels = {}
    for run, row in per_run(runs).iterrows():
        method = str(row["method"])
        lr = row.get(f"{method}.lr")
        what = f"{method} lr={lr:g}" if lr is not None and pd.notna(lr) else method
        labels[run] = what if run == what else f"{run} ({what})"
    return labels


def per_run(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its config columns (everything that is constant within the run)."""
    return runs.drop_duplicates("run").set_index("run", drop=False)


def _differing(configs: pd.DataFrame, keys: list[str]) -> list[str]:
    """Keys with more than one value among the runs that have them (a key that older runs lack
    does not count as a difference; a YAML ``null`` is a value: ``step_control.enabled: null``, the
    method's default, differs from ``false``)."""
    return [k for k in keys if configs[k].map(lambda v: "null" if v is None else v).dropna().astype(str).nunique() > 1]


def is_rate_key(key: str) -> bool:
    """A learning-rate key (``dense.lr``, ``logra.dense_lr``): what a learning-rate sweep varies, so not
    part of a run's ``family``."""
    last = key.rsplit(".", 1)[-1]
    return last == "lr" or last.endswith("_lr")


def _label(head: str, row: pd.Series, keys: list[str], names: dict[str, str]) -> str:
    return " ".join([head, *(f"{names[k]}={_short(row[k])}" for k in keys if pd.notna(row[k]))])


def _short_names(keys: list[str], own: str) -> dict[str, str]:
    """``logra.lr`` -> ``lr`` in a logra label; a shared key by its last part where that is unique
    and telling (``target_kl``), else in full (``eval.size``)."""
    last = pd.Series([k.rsplit(".", 1)[-1] for k in keys]).value_counts()

    def name(key: str) -> str:
        if own and key.startswith(own):
            return key.removeprefix(own)
        tail = key.rsplit(".", 1)[-1]
        return tail if last[tail] == 1 and "_" in tail else key

    return {k: name(k) for k in keys}


def _short(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _without_idle_step_control(configs: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """``configs`` with the step_control keys (all but ``enabled``) blanked for runs that never ran step
    control (no ``kl/predicted`` logged: galore, lora, dense, logra with it off): there they change
    nothing the run computes, as in the run key (experiments.config), so a galore run with
    ``measure_realized: true`` and one without are one variant."""
    logged = runs.groupby("run")["kl/predicted"].apply(lambda v: v.notna().any()) if "kl/predicted" in runs else None
    idle = [r for r in configs.index if logged is None or not logged.get(r, False)]
    keys = [k for k in configs.columns if k.startswith("step_control.") and k != "step_control.enabled"]
    if idle and keys:
        configs = configs.astype({k: object for k in keys})  # a bool column takes no NaN
        configs.loc[idle, keys] = float("nan")  # not None: a YAML null is a value (_differing)
    return configs


def defines_experiment(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return key not in IGNORED_KEYS and not key.startswith(IGNORED_SECTIONS) and "seed" not in last


def label_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Add ``task_label``, ``variant`` and ``family`` (see the module docstring)."""
    runs = runs.assign(**{c: runs[c].fillna("?") if c in runs else "?" for c in ("method", "task.name")})
    configs = _without_idle_step_control(per_run(runs), runs)
    config_keys = [c for c in configs.columns
                   if "/" not in c and c not in ("run", "run_dir", "git_sha", "done", "step") and defines_experiment(c)]
    task_label, variant, family = {}, {}, {}
    several_models = "model.name" in configs and configs["model.name"].dropna().nunique() > 1
    for task, group in configs.groupby("task.name"):
        keys = _differing(group, [k for k in config_keys if k.startswith("task.") and k != "task.name"])
        names = _short_names(keys, "task.")
        for run, row in group.iterrows():
            model = f" ({row['model.name']})" if several_models else ""
            task_label[run] = _label(str(task), row, keys, names) + model
    configs = configs.copy().assign(task_label=configs.index.map(task_label))  # copy: one block, not many
    methods = set(configs["method"].astype(str))
    for method, group in configs.groupby("method"):
        others = tuple(f"{m}." for m in methods - {method})
        candidates = ([k for k in config_keys if k.startswith(f"{method}.")]  # its own knobs first
                      + [k for k in config_keys if k.startswith(VARIANT_SECTIONS) and not k.startswith(others)
                         and k != "model.name"])  # the model is part of the task label
        differing = {k for _, of_task in group.groupby("task_label") for k in _differing(of_task, candidates)}
        keys = [k for k in candidates if k in differing]
        names = _short_names(config_keys, f"{method}.")
        variant.update({run: _label(str(method), row, keys, names) for run, row in group.iterrows()})
        fixed = [k for k in keys if not is_rate_key(k)]
        family.update({run: _label(str(method), row, fixed, names) for run, row in group.iterrows()})
    return runs.copy().assign(task_label=runs["run"].map(task_label), variant=runs["run"].map(variant),
                       family=runs["run"].map(family))


def load_memory_csv(root: str | Path) -> pd.DataFrame | None:
    """``<root>/memory/memory.csv`` (written by ``python -m experiments.memory_table``), or None."""
    path = Path(root) / MEMORY_CSV
    return read_memory_csv(path) if path.exists() else None


def read_memory_csv(path: str | Path) -> pd.DataFrame:
    """A memory.csv wherever it is (``results/memory_table/memory.csv``), its columns checked."""
    table = pd.read_csv(path)
    if "method" not in table.columns or "peak_bytes" not in table.columns:
        raise ValueError(f"{path}: expected columns {MEMORY_COLUMNS}, got {list(table.columns)}")
    return table
