"""The methods behind one interface (:class:`baselines.base.Method`), found by name in ``METHODS``.

A method is one file: a module of this package whose class carries ``@register_method("<name>")``.
On first use of ``METHODS`` every module of this package is imported (so a new file needs no
import list), then every module named in the environment variable ``LOGRA_PLUGINS``
(comma-separated, importable from ``sys.path``): a method outside the repository registers itself
the same way. Importing this package alone imports nothing heavy (``baselines.memory_terms``, which
the planner reads, needs no torch).
"""

from __future__ import annotations

import importlib
import os
import pkgutil

PLUGINS_ENV = "LOGRA_PLUGINS"
_discovered = False


def discover() -> dict:
    """Import this package's modules and the ``LOGRA_PLUGINS`` modules (once); the registry."""
    global _discovered
    from baselines.base import METHODS

    if not _discovered:
        _discovered = True  # a module that reads METHODS while it is imported sees the methods so far
        try:
            for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
                importlib.import_module(f"{__name__}.{info.name}")
            for name in (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")):
                if name:
                    try:
                        importlib.import_module(name)
                    except ImportError as e:
                        raise ImportError(f"{PLUGINS_ENV} names module {name!r}, which cannot be imported: {e}") from e
        except BaseException:
            _discovered = False
            raise
    return METHODS


def __getattr__(name: str):
    if name == "METHODS":
        return discover()
    if name in ("Method", "register_method"):
        from baselines import base

        return getattr(base, name)
    raise AttributeError(f"module 'baselines' has no attribute {name!r}")


__all__ = ["METHODS", "Method", "register_method", "discover"]
