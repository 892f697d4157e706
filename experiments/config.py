"""The run configuration: one dataclass per component, merged defaults -> YAML -> command line.

Each component keeps its config dataclass next to its code (``ModelConfig`` in ``rl/models.py``,
``TaskConfig`` in ``rl/tasks.py``, ...); :class:`RunConfig` nests them. Every registered method
adds its own section under its name (``dense.lr``, later ``logra.rank``), so a method brings its
knobs without the trainer knowing them.

Merge order (later wins): dataclass defaults -> ``experiments/configs/default.yaml`` -> the YAML
named by ``config=<path or name>`` -> ``key=value`` overrides. Shorthands: ``task=arith`` sets
``task.name``, ``model=tiny-llama`` sets ``model.name``. An unknown key or a value of the wrong
type is a :class:`ConfigError` naming the key, raised before anything heavy is loaded. The result
is read-only.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Optional, Sequence, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from baselines import METHODS
from experiments.rl.distributed import DistConfig
from experiments.rl.grpo import GRPOConfig
from experiments.rl.guard import GuardConfig
from experiments.rl.models import ModelConfig
from experiments.rl.rollout import RolloutConfig
from experiments.rl.tasks import TaskConfig
from logra_core.step_control import StepControlConfig

CONFIG_DIR = Path(__file__).parent / "configs"
SHORTHANDS = {"task": "task.name", "model": "model.name"}


@dataclass
class EvalConfig:
    every: int = 10  # greedy pass@1 evaluation every N steps (and at step 0 and the last step); 0 = never
    size: int = 100  # held-out problems per evaluation (the first N of the test split in an order drawn from the run seed)
    max_new_tokens: int = 0  # generation budget for evaluation; 0 = same as rollout.max_new_tokens
    batch_size: int = 64  # prompts per generate call
    at_start: bool = True  # evaluate before the first update (the baseline accuracy)


@dataclass
class LogConfig:
    tensorboard: bool = False  # also write TensorBoard event files to <run_dir>/tb
    progress: bool = True  # tqdm progress bar on the terminal
    samples: int = 2  # completions per step written to samples.jsonl (0 = none)
    memory_profile: bool = False  # tensor-accounting memory profile per step and phase (mem/<phase>/peak_bytes, mem/<category>_bytes; <run_dir>/memory_profile.jsonl); slows a step


@dataclass
class CheckpointConfig:
    every: int = 10  # save every N steps (and at the end, on SIGTERM/SIGUSR1, and before a NonFiniteError stop); 0 = only then
    keep: int = 2  # keep the newest K complete checkpoints (with manifest.json and checksums); 0 = all


@dataclass
class RunConfig:
    method: str = "dense"  # registry key of the optimization method (baselines.METHODS)
    seed: int = 0  # seeds sampling, data order, the held-out order (tasks.held_out) and anything random in the loop
    out_dir: str = "runs/default"  # the run directory: config, metrics, checkpoints
    resume: bool = False  # continue from the newest checkpoint in out_dir
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)  # non-finite guard (experiments/rl/guard.py)
    step_control: StepControlConfig = field(default_factory=StepControlConfig)
    dist: DistConfig = field(default_factory=DistConfig)


class ConfigError(ValueError):
    """A bad key or value in the run configuration."""


def schema() -> DictConfig:
    """The structured config: RunConfig plus one section per registered method."""
    base = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(base, False)
    for name, method in sorted(METHODS.items()):
        base[name] = OmegaConf.structured(method.config_cls)
    OmegaConf.set_struct(base, True)
    return base


def _all_keys(cfg, prefix="") -> list[str]:
    keys = []
    for k, v in cfg.items():
        keys.append(prefix + str(k))
        if isinstance(v, DictConfig):
            keys += _all_keys(v, prefix + str(k) + ".")
    return keys


def _merge(base: DictConfig, other, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:
        key = e.full_key or getattr(e, "key", "?")
        close = difflib.get_close_matches(str(key), _all_keys(base), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown config key {key!r} in {source}{hint}") from None
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ConfigError(f"bad value for {e.full_key!r} in {source}: {msg}") from None


def _yaml(name: str) -> tuple[DictConfig, str]:
    path = Path(name)
    if not path.is_file():
        path = CONFIG_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    if not path.is_file():
        raise ConfigError(f"config file {name!r} not found (looked in . and {CONFIG_DIR})")
    return OmegaConf.load(path), str(path)


def build_config(overrides: Sequence[str] = (), base_yaml: Optional[str] = "default") -> DictConfig:
    """Merge defaults, YAML and ``key=value`` overrides into a read-only DictConfig."""
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r}")
    cfg = schema()
    if base_yaml:
        loaded, path = _yaml(base_yaml)
        cfg = _merge(cfg, loaded, source=path)
    user = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "config"]
    for name in user:
        loaded, path = _yaml(name)
        cfg = _merge(cfg, loaded, source=path)
    dotlist = []
    for item in overrides:
        key, value = item.split("=", 1)
        if key == "config":
            continue
        dotlist.append(f"{SHORTHANDS.get(key, key)}={value}")
    try:
        cli = OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot parse command line overrides: {e}") from None
    cfg = _merge(cfg, cli, source="the command line")
    if cfg.method not in METHODS:
        raise ConfigError(f"unknown method {cfg.method!r}; registered: {sorted(METHODS)}")
    if cfg.step_control.enabled and not METHODS[cfg.method].supports_step_control:
        raise ConfigError(f"step_control.enabled=true: method {cfg.method!r} applies its update inside backward, "
                          "so there is no update to scale before it lands")
    try:
        OmegaConf.to_object(cfg)  # runs the dataclasses' own checks (__post_init__)
    except (ValueError, OmegaConfBaseException) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _field_comments(cls) -> dict[str, str]:
    """``{field: its trailing # comment}`` from a config dataclass's source."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return dict(re.findall(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", source, flags=re.M))


def describe() -> str:
    """Every key with its default and its one-line meaning (``python -m experiments.train --help``)."""
    nested = {k: t for k, t in get_type_hints(RunConfig).items() if is_dataclass(t)}
    sections = {"": RunConfig, **nested, **{name: m.config_cls for name, m in sorted(METHODS.items())}}
    cfg = schema()
    lines = []
    for prefix, cls in sections.items():
        notes = _field_comments(cls)
        for f in fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if key in nested:
                continue
            lines.append(f"  {key + '=' + str(OmegaConf.select(cfg, key)):<42} {notes.get(f.name, '')}")
        lines.append("")
    return "\n".join(lines)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
