"""Config machinery shared by every entry point: flatten, checked merge, field meanings, hashing.

A config is an OmegaConf structured config built from dataclasses (one per component, next to its
code). :func:`merge` merges a YAML file or a command-line dotlist into one and turns OmegaConf's
errors into a :class:`ConfigError` that names the key and, where one is close, the key meant.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import re
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A bad key or value in a configuration or on a command line."""


def flatten(d: Mapping | DictConfig | None, prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys: ``{"a": {"b": 1}, "c.d": 2}`` -> ``{"a.b": 1, "c.d": 2}``.

    A DictConfig is read resolved; an empty section contributes no key."""
    if isinstance(d, DictConfig):
        d = OmegaConf.to_container(d, resolve=True)
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def known_keys(cfg: DictConfig | Mapping) -> list[str]:
    """Every dotted key of ``cfg``, sections included (``train``, ``train.steps``, ...)."""
    keys = set()
    for key in flatten(cfg):
        parts = key.split(".")
        keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(keys)


def unknown_key_error(key: str, known: Iterable[str], source: str, what: str = "config key") -> ConfigError:
    """``unknown config key 'train.stpes' in the command line (did you mean 'train.steps'?)``; with no
    close key the message points to ``--help``."""
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = (f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})" if what == "method"
            else " (--help lists the keys)")
    return ConfigError(f"unknown {what} {key!r} in {source}{hint}")


def merge(base: DictConfig, other, source: str) -> DictConfig:
    """``OmegaConf.merge(base, other)`` with errors as :class:`ConfigError` naming the key."""
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:
        key = str(e.full_key or getattr(e, "key", "?"))
        try:  # OmegaConf names the first unknown node (``bad``); name the key as given (``bad.key``)
            given = [k for k in flatten(other) if k == key or k.startswith(key + ".")]
        except (AttributeError, TypeError, OmegaConfBaseException):
            given = []
        raise unknown_key_error(given[0] if given else key, known_keys(base), source) from None
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ConfigError(f"bad value for {e.full_key!r} in {source}: {msg}") from None


def field_comments(cls) -> dict[str, str]:
    """``{field: its trailing # comment}`` from a config dataclass's source: the field's meaning."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return dict(re.findall(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", source, flags=re.M))


def stable_hash(obj, n: int = 8) -> str:
    """First ``n`` hex digits of SHA-256 over the canonical JSON of ``obj`` (sorted keys)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:n]
