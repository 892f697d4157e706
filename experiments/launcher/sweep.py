"""A sweep: a base config, a grid and named ablations, expanded into runs keyed by config hash.

A sweep YAML (``experiments/sweeps/*.yaml``; the first comment line is the command that runs it)::

    config: arith_compare          # optional: an experiments/configs YAML every run starts from
    base: {model: {name: ...}, train: {steps: 3}}   # overrides for every run (nested or dotted keys)
    grid:                          # cartesian product, in this order; dotted config keys -> lists
      method: [dense, logra]
      task: [arith]
      seed: [0, 1, 2]
    ablations:                     # extra runs, each crossed with the grid keys it does not set
      - name: logra-nokl
        set: {method: logra, step_control.enabled: false}
        grid: {logra.rank: [16, 64]}          # optional: axes of its own
    launcher: {name: local, max_parallel: 1, timeout_min: 600, partition: ..., gpus_per_node: 1, ...}
    planner: {gpu_mem_gb: 80, seq_len: 1024, models: {<model.name>: <planner preset>}}
    after:                         # commands run after the runs (skipped when `creates` exists)
      - {name: memory table, module: experiments.memory_table, args: ["out={root}/memory"], creates: "{root}/memory/memory.csv"}

Each run's directory is ``<root>/runs/<readable name>-<hash8>``, where hash8 is the run key
(``experiments.config.run_key``): the first 8 hex digits of the SHA-256 of the config's schema
version and the values that differ from the defaults, minus the keys in :data:`NOT_IDENTITY` (keys
that say where things live or how they are shown, not what is computed). Equal configs share a
directory however they were spelled (YAML, override, shorthand, key order, a default spelled out);
any change to a key that matters gives a new one; adding a key or changing another method's default
keeps it. A run is complete when ``done.json`` exists. Directories keyed by the earlier scheme (a
hash of every resolved key) are renamed by ``python -m experiments.launcher.migrate <root>``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from baselines import METHODS
from experiments.common.config import ConfigError, flatten
from experiments.config import NOT_IDENTITY, build_config, identity, run_key

__all__ = ["DONE", "NOT_IDENTITY", "Run", "Sweep", "config_hash", "dotlist_value", "flatten", "identity", "load_sweep"]

SWEEP_DIR = Path(__file__).resolve().parents[1] / "sweeps"
SWEEP_KEYS = {"name", "config", "root", "base", "grid", "ablations", "launcher", "planner", "after"}
DONE = "done.json"
# Where a sweep trains unless told otherwise: runs/<sweep name> (git-ignored). The committed
# results/<profile>/ is a reference, written only by ``python -m experiments.publish``.
RUNS_DIR = "runs"
# Readable run names list the grid values in this order (method, model, task, then the rest, seed last).
NAME_ORDER = ["method", "model", "model.name", "task", "task.name"]


def dotlist_value(value: Any) -> str:
    """A value as the YAML scalar/flow text that ``key=<text>`` parses back to the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


config_hash = run_key  # a run's hash8: schema version + non-default values (experiments.config)


def _slug(value: Any) -> str:
    text = str(value).rstrip("/").split("/")[-1]
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "x"


def _name_part(key: str, value: Any) -> str:
    if key in ("method", "task", "task.name", "model", "model.name"):
        return _slug(value)
    if key == "seed":
        return f"s{value}"
    return f"{key.split('.')[-1]}{_slug(value)}"


@dataclass
class Run:
    name: str  # readable: the ablation (or method), task, seed and the other grid values
    overrides: list[str]  # key=value, without out_dir / resume
    cfg: DictConfig  # resolved, with out_dir
    key: str  # hash8: the run key of the resolved config
    run_dir: Path
    ablation: Optional[str] = None
    settings: dict = field(default_factory=dict)  # what sets this run apart: ablation settings + grid values

    @property
    def done(self) -> bool:
        return (self.run_dir / DONE).exists()

    @property
    def started(self) -> bool:
        return (self.run_dir / "config.yaml").exists()

    @property
    def label(self) -> str:
        return self.run_dir.name


@dataclass
class Sweep:
    name: str
    path: Path
    root: Path
    config: Optional[str] = None
    base: dict = field(default_factory=dict)
    grid: dict = field(default_factory=dict)
    ablations: list = field(default_factory=list)
    launcher: dict = field(default_factory=dict)
    planner: dict = field(default_factory=dict)
    after: list = field(default_factory=list)

    def runs(self, extra: tuple[str, ...] = ()) -> list[Run]:
        """Every run of the sweep, grid first then ablations, duplicates (equal hashes) dropped.

        ``extra``: ``key=value`` overrides applied to every run last (from the command line)."""
        points: list[tuple[Optional[str], dict, dict]] = []  # (ablation, named axes, settings)
        for combo in _product(self.grid):
            points.append((None, combo, {}))
        for abl in self.ablations:
            if not isinstance(abl, dict) or "name" not in abl:
                raise ConfigError(f"{self.path}: each ablation needs a name (got {abl!r})")
            unknown = set(abl) - {"name", "set", "grid"}
            if unknown:
                raise ConfigError(f"{self.path}: ablation {abl['name']!r} has unknown keys {sorted(unknown)} (name, set, grid)")
            settings = flatten(abl.get("set") or {})
            own = {k: _as_list(v, f"ablation {abl['name']} grid.{k}") for k, v in flatten(abl.get("grid") or {}).items()}
            shared = {k: v for k, v in self.grid.items() if k not in settings and k not in own
                      and not _other_method_key(k, settings.get("method"))}
            for combo in _product({**shared, **own}):
                points.append((abl["name"], combo, settings))

        runs, seen = [], {}
        base = flatten(self.base)
        for ablation, axes, settings in points:
            values = {**base, **settings, **axes}
            overrides = ([f"config={self.config}"] if self.config else []) + [f"{k}={dotlist_value(v)}" for k, v in values.items()]
            overrides += list(extra)
            order = sorted(axes, key=lambda k: NAME_ORDER.index(k) if k in NAME_ORDER else len(NAME_ORDER) + (k == "seed"))
            parts = ([_slug(ablation)] if ablation else []) + [_name_part(k, axes[k]) for k in order]
            name = "-".join(parts) or self.name
            try:
                cfg = build_config(overrides)
            except ConfigError as e:
                raise ConfigError(f"sweep {self.name!r}, run {name!r}: {e}") from None
            key = config_hash(cfg)
            if key in seen:
                continue
            run_dir = self.root / "runs" / f"{name}-{key}"
            OmegaConf.set_readonly(cfg, False)
            cfg.out_dir = str(run_dir)  # not part of the hash; the job passes the same out_dir
            OmegaConf.set_readonly(cfg, True)
            seen[key] = run_dir
            runs.append(Run(name, overrides, cfg, key, run_dir, ablation, {**settings, **axes}))
        return runs


def _other_method_key(key: str, method: Optional[str]) -> bool:
    """Whether ``key`` belongs to the config section of a method other than ``method``: such a grid
    axis (``dense.lr`` beside an ablation that sets ``method: logra``) changes nothing in that run (a
    run config keeps only its own method's section), so the ablation is not crossed with it."""
    section = key.split(".", 1)[0]
    return method is not None and "." in key and section != method and section in METHODS


def _as_list(v, where: str) -> list:
    if not isinstance(v, list) or not v:
        raise ConfigError(f"{where}: a grid axis must be a non-empty list, got {v!r}")
    return v


def _product(grid: dict) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def sweep_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    path = SWEEP_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    if not path.is_file():
        known = sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))
        raise ConfigError(f"sweep {name!r} not found (a path, or one of {known} in {SWEEP_DIR})")
    return path


def load_sweep(name: str, root: Optional[str] = None) -> Sweep:
    """Read a sweep YAML (a path or a name in experiments/sweeps/). ``root`` overrides its results
    root (default: the YAML's ``root:``, else ``runs/<sweep name>``)."""
    path = sweep_path(name)
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - SWEEP_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown sweep keys {sorted(unknown)}; known: {sorted(SWEEP_KEYS)}")
    sweep_name = data.get("name") or path.stem
    grid = {k: _as_list(v, f"{path}: grid.{k}") for k, v in flatten(data.get("grid") or {}).items()}
    return Sweep(
        name=sweep_name,
        path=path,
        root=Path(root or data.get("root") or f"{RUNS_DIR}/{sweep_name}"),
        config=data.get("config"),
        base=data.get("base") or {},
        grid=grid,
        ablations=data.get("ablations") or [],
        launcher=data.get("launcher") or {},
        planner=data.get("planner") or {},
        after=data.get("after") or [],
    )
