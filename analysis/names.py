"""Method variants by the names people use ("LoGRA, no step control"), not by their config keys.

A variant's name is its method's name (``METHOD_NAMES``) followed by a phrase for each setting in
``PHRASES`` whose value in the variant's run config differs from today's default for that method
(``experiments.config.build_config``): ``logra`` with ``step_control.enabled: false`` is "LoGRA, no
step control", with ``logra.embeddings: true`` "LoGRA, sketched embeddings", with
``step_control.probe_min: 0`` "LoGRA, no probe floor". Learning rates are not named: every cell runs
at its own best rate. A setting that a run's config lacks (it predates the setting) is read as
``ABSENT`` says: the value that reproduces the behaviour from before the setting existed.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import pandas as pd

METHOD_NAMES = {"dense": "dense AdamW", "logra": "LoGRA", "galore": "GaLore", "lora": "LoRA",
                "galore_layerwise": "GaLore, layer-wise"}


def controlled(config) -> bool:
    """Whether the run's method ran step control: ``step_control.enabled``, or the method's default."""
    from baselines import METHODS

    enabled = config.get("step_control.enabled")
    if _missing(enabled):
        method = METHODS.get(str(config.get("method")))
        return bool(method and method.step_control_default)
    return str(enabled).lower() == "true"


def _probe_floor(value, config) -> str | None:
    if not controlled(config):
        return None  # no step control: its probe does not exist
    return "no probe floor" if int(value) == 0 else f"probe floor {int(value)}"


def _embeddings(value, config) -> str | None:
    return "sketched embeddings" if bool(value) else "embeddings not sketched"


def _control(value, config) -> str | None:
    return "no step control" if str(value).lower() == "false" else "step control on"


MASTERS = {"fp32": "fp32 master", "kahan": "Kahan-compensated bf16", "stochastic": "stochastic rounding",
           "none": "no master copy"}

# key -> phrase for a non-default value (None: say nothing), in the order they are named
PHRASES = {"step_control.enabled": _control, "logra.embeddings": _embeddings, "step_control.probe_min": _probe_floor,
           "logra.master": lambda v, c: MASTERS.get(str(v), f"master={v}"),
           "dense.precision": lambda v, c: f"{v} precision"}
ABSENT = {"step_control.probe_min": 0}  # the probe floor came with config schema 4 (docs/speed.md, "The floor")


@functools.lru_cache(maxsize=None)
def defaults(method: str) -> dict:
    """Today's default config of ``method``, flattened."""
    from omegaconf import OmegaConf

    from analysis.load import flatten
    from experiments.config import build_config

    return flatten(OmegaConf.to_container(build_config([f"method={method}"]), resolve=True))


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def display_name(config: pd.Series | dict) -> str:
    """The variant of a run ``config`` (flattened, e.g. a row of ``load.per_run``) by name."""
    config = dict(config)
    method = str(config.get("method"))
    name = METHOD_NAMES.get(method, method)
    try:
        default = defaults(method)
    except Exception:  # a method this checkout does not register: its name alone
        return name
    from analysis.tradeoff import _norm  # one spelling for 12 / 12.0 / "12", True / "true"

    parts = []
    for key, phrase in PHRASES.items():
        value = config.get(key)
        if _missing(value):
            value = ABSENT.get(key)
        if key not in default or value is None:
            continue
        if _norm(value) != _norm(default[key]):
            said = phrase(value, config)
            if said:
                parts.append(said)
    return ", ".join([name, *parts])


def variant_names(runs: pd.DataFrame) -> dict[tuple[str, str], str]:
    """(task_label, variant) -> its display name, from each variant's first run. Variants of a task that
    the name alone does not tell apart (the same method and settings at two learning rates) say their rate."""
    from analysis.load import per_run

    first = per_run(runs).drop_duplicates(["task_label", "variant"])
    named = {(r["task_label"], r["variant"]): display_name(r) for _, r in first.iterrows()}
    seen = Counter((task, name) for (task, _), name in named.items())
    for (task, variant), name in list(named.items()):
        if seen[(task, name)] > 1:
            r = first[(first["task_label"] == task) & (first["variant"] == variant)].iloc[0]
            lr = r.get(f"{r['method']}.lr")
            named[(task, variant)] = f"{name}, lr {lr:g}" if not _missing(lr) else f"{name} ({variant})"
    return named
