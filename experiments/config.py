"""The run configuration: one dataclass per component, merged defaults -> YAML -> command line.

Each component keeps its config dataclass next to its code (``ModelConfig`` in ``rl/models.py``,
``TaskConfig`` in ``rl/tasks.py``, ...); :class:`RunConfig` nests them. A run config holds the
section of its own method only (``dense.lr`` for ``method=dense``, ``logra.rank`` for
``method=logra``): a method brings its knobs without the trainer knowing them. A YAML file or a
command line may also set other methods' sections (a sweep's base shared by several methods); those
are checked against their method's dataclass, then dropped.

Merge order (later wins): dataclass defaults -> ``experiments/configs/default.yaml`` -> the YAML
named by ``config=<path or name>`` -> ``key=value`` overrides. Shorthands: ``task=arith`` sets
``task.name``, ``model=tiny-llama`` sets ``model.name``. An unknown key or a value of the wrong
type is a :class:`ConfigError` naming the key, raised before anything heavy is loaded. The result
is read-only.

A run's key (:func:`run_key`, the ``<hash8>`` of a sweep's run directory) hashes :data:`SCHEMA_VERSION`
and the values that differ from the dataclass defaults, minus :data:`NOT_IDENTITY`: adding a key, or
changing the default of a key a run does not hold (another method's), keeps every finished run's key.
A changed default that changes what existing runs compute needs a :data:`SCHEMA_VERSION` bump.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from baselines import METHODS
from experiments.common.config import ConfigError, field_comments, flatten, known_keys, merge, stable_hash
from experiments.rl.distributed import DistConfig
from experiments.rl.grpo import GRPOConfig
from experiments.rl.guard import GuardConfig
from experiments.rl.models import ModelConfig
from experiments.rl.rollout import RolloutConfig
from experiments.rl.tasks import TaskConfig
from logra_core.step_control import StepControlConfig

__all__ = ["ConfigError", "RunConfig", "build_config", "config_diff", "describe", "identity", "non_defaults",
           "run_key", "schema", "to_yaml"]

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



# The version of the run-key scheme and of the defaults it assumes: bump it when a changed default
# changes what existing runs compute (their keys then change, and a sweep redoes them).
SCHEMA_VERSION = 4  # 3: step_control.predictor's default became secant; step control's keys count only where it is on; 4: step_control.probe_min's default became 12
# Keys whose default changed after runs were saved without them: a saved config that lacks the key ran
# with this value (its run key, and a resume's check for changed keys, see what it computed).
FORMER_DEFAULTS = {"step_control.predictor": "exact", "step_control.probe_min": 0}
# Keys that do not change what a run computes: where it lives, whether it resumes, threads, logging
# (log.*), where the converted model is cached and where the data files sit.
NOT_IDENTITY = ("out_dir", "resume", "threads", "log", "model.cache_dir", "task.data_dir")
# Keys that may differ between a run and its resumption.
RESUMABLE_CHANGES = {"resume", "train.steps", "log.progress", "log.tensorboard", "threads", "guard.max_consecutive_skips"}


def schema(method: Optional[str] = None) -> DictConfig:
    """The structured config: RunConfig plus the section of ``method`` (with ``method`` set); ``None``:
    a section per registered method (what a YAML or a command line is checked against). An
    unregistered ``method`` gets no section."""
    base = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(base, False)
    for name in sorted(METHODS) if method is None else [method] if method in METHODS else []:
        base[name] = OmegaConf.structured(METHODS[name].config_cls)
    if method is not None:
        base.method = method
    OmegaConf.set_struct(base, True)
    return base


def _own_sections(data: dict, method: str) -> dict:
    """``data`` without the sections of registered methods other than ``method``."""
    return {k: v for k, v in data.items() if not (k in METHODS and k != method)}


def _yaml(name: str) -> tuple[DictConfig, str]:
    path = Path(name)
    if not path.is_file():
        path = CONFIG_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    if not path.is_file():
        raise ConfigError(f"config file {name!r} not found (looked in . and {CONFIG_DIR})")
    return OmegaConf.load(path), str(path)


def build_config(overrides: Sequence[str] = (), base_yaml: Optional[str] = "default") -> DictConfig:
    """Merge defaults, YAML and ``key=value`` overrides into a read-only DictConfig holding the
    selected method's section only."""
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r}")
    cfg = schema()  # every method's section: each key is checked against its dataclass
    if base_yaml:
        loaded, path = _yaml(base_yaml)
        cfg = merge(cfg, loaded, source=path)
    user = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "config"]
    for name in user:
        loaded, path = _yaml(name)
        cfg = merge(cfg, loaded, source=path)
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
    cfg = merge(cfg, cli, source="the command line")
    if cfg.method not in METHODS:
        raise ConfigError(f"unknown method {cfg.method!r}; registered: {sorted(METHODS)}")
    own = _own_sections(OmegaConf.to_container(cfg, resolve=True), cfg.method)
    cfg = merge(schema(cfg.method), own, source="the merged config")
    if cfg.step_control.enabled and not METHODS[cfg.method].supports_step_control:
        raise ConfigError(f"step_control.enabled=true: method {cfg.method!r} applies its update inside backward, "
                          "so there is no update to scale before it lands")
    try:
        OmegaConf.to_object(cfg)  # runs the dataclasses' own checks (__post_init__)
    except (ValueError, OmegaConfBaseException) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    OmegaConf.set_readonly(cfg, True)
    return cfg


def run_keys() -> list[str]:
    """Every key a run config accepts (every method's section), shorthands and ``config`` included."""
    return sorted(set(known_keys(schema())) | set(SHORTHANDS) | {"config"})


def describe() -> str:
    """Every key with its default and its one-line meaning (``python -m experiments.train --help``)."""
    def sections_of(cls, prefix: str = "") -> dict:  # nested config dataclasses, depth first (rollout, rollout.vllm)
        out = {}
        for name, t in get_type_hints(cls).items():
            if is_dataclass(t):
                key = f"{prefix}.{name}" if prefix else name
                out.update({key: t, **sections_of(t, key)})
        return out

    nested = sections_of(RunConfig)
    sections = {"": RunConfig, **nested, **{name: m.config_cls for name, m in sorted(METHODS.items())}}
    cfg = schema()
    lines = []
    for prefix, cls in sections.items():
        notes = field_comments(cls)
        for f in fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if key in nested:
                continue
            lines.append(f"  {key + '=' + str(OmegaConf.select(cfg, key)):<42} {notes.get(f.name, '')}")
        lines.append("")
    return "\n".join(lines)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


# ---- run identity ------------------------------------------------------------------------------
def _flat_run(cfg: DictConfig | dict) -> dict[str, Any]:
    """The flattened config with its own method's section only (a config saved before run configs held
    one section holds every method's: the others are ignored), a key it lacks that is in
    :data:`FORMER_DEFAULTS` filled with the value it ran with, and step control's other keys dropped
    where step control is off (they change nothing such a run computes)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    method = data.get("method", RunConfig.method)
    flat = flatten(_own_sections(data, method))
    for key, value in FORMER_DEFAULTS.items():
        flat.setdefault(key, value)
    enabled = flat.get("step_control.enabled")
    if not (METHODS[method].step_control_default if enabled is None and method in METHODS else enabled):
        flat = {k: v for k, v in flat.items() if not k.startswith("step_control.") or k == "step_control.enabled"}
    return flat


def _is_identity(key: str) -> bool:
    return not any(key == x or key.startswith(x + ".") for x in NOT_IDENTITY)


def identity(cfg: DictConfig | dict) -> dict[str, Any]:
    """Every key of the resolved config that says what a run computes: all but :data:`NOT_IDENTITY`."""
    return {k: v for k, v in _flat_run(cfg).items() if _is_identity(k)}


_MISSING = object()


def non_defaults(cfg: DictConfig | dict) -> dict[str, Any]:
    """The keys of :func:`identity` whose values differ from the dataclass defaults of the run's method
    (``method`` itself included when it is not the default; a key the schema lacks counts as set)."""
    flat = identity(cfg)
    default = flatten(schema(flat.get("method", RunConfig.method)))
    default["method"] = RunConfig.method
    return {k: v for k, v in flat.items() if default.get(k, _MISSING) != v}


def run_key(cfg: DictConfig | dict) -> str:
    """hash8 of a run: SHA-256 over :data:`SCHEMA_VERSION` and :func:`non_defaults`. Equal configs share a
    key however they were spelled (YAML, override, shorthand, a default spelled out); any change of a
    value that matters gives another."""
    return stable_hash({"schema": SCHEMA_VERSION, "values": non_defaults(cfg)})


def config_diff(saved: DictConfig | dict, cfg: DictConfig | dict) -> set[str]:
    """Keys whose values differ between a saved run config and ``cfg``, minus :data:`RESUMABLE_CHANGES`.

    A key one side lacks counts as its default (a key added to the code since the run started is no
    change while it holds its default); other methods' sections of an older saved config are ignored."""
    old, new = _flat_run(saved), _flat_run(cfg)
    default = flatten(schema(new.get("method", RunConfig.method)))
    return {k for k in old.keys() | new.keys()
            if old.get(k, default.get(k, _MISSING)) != new.get(k, default.get(k, _MISSING))} - RESUMABLE_CHANGES
