"""The one command-line front of every ``python -m experiments.*`` tool: ``key=value`` into a dataclass.

A tool declares its keys as a dataclass, one field per key with a trailing ``# meaning`` comment,
and calls :func:`parse`: the ``key=value`` arguments are read by ``OmegaConf.from_dotlist`` and
merged into ``OmegaConf.structured(<the dataclass>)`` (types checked and converted), an unknown key is
a :class:`ConfigError` naming it with the closest known key, and ``--help`` prints the tool's
docstring and every key with its default and meaning. A tool that also takes run-config overrides
(``model=tiny-llama train.logprob_chunk=0``, handed to ``experiments.config.build_config``) passes the
run config's keys as ``run_keys``: a key that is neither the tool's nor the run config's is the
same error, with a suggestion from both.

A method with overrides is spelled one way everywhere. One run: ``method=logra logra.rank=32``
(run-config keys). Several, side by side (``methods=`` of memory_table, step_bench, sync_bench,
allreduce_bench, gpu_memory, plan): a comma-separated list, each entry a method name, optionally
followed by ``:`` and its own run-config overrides separated by spaces::

    methods="dense,logra,logra:logra.embeddings=true logra.rank=32"

(:func:`parse_methods`; the entry as written is its label in the tool's output.)
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, fields
from typing import Callable, Iterable, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.common.config import ConfigError, field_comments, known_keys, merge, unknown_key_error

HELP = ("-h", "--help")


def describe_args(cls) -> str:
    """Every key of a tool's dataclass with its default and its meaning, one per line."""
    notes = field_comments(cls)
    lines = []
    for f in fields(cls):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        lines.append(f"  {f.name + '=' + str(default):<42} {notes.get(f.name, '')}")
    return "\n".join(lines)


def help_text(cls, doc: str, run_keys: Optional[Callable[[], Iterable[str]]] = None) -> str:
    text = (doc or "").rstrip() + "\n\nKeys, defaults and meanings (key=value):\n" + describe_args(cls) + "\n"
    if run_keys is not None:
        text += "  any run-config key=value                   (python -m experiments.train --help lists them)\n"
    return text


def parse(cls, argv: Sequence[str], *, doc: str = "", run_keys: Optional[Callable[[], Iterable[str]]] = None,
          flags: Sequence[str] = (), shorthands: Optional[dict[str, str]] = None):
    """``argv`` -> ``(args, overrides, flags_given)``.

    ``args``: an instance of the dataclass ``cls`` (defaults, then every ``key=value`` whose first
    dotted part is a field of ``cls``); ``overrides``: the other ``key=value`` arguments, in order,
    allowed only when ``run_keys`` is given and each key is one of them (``experiments.config.run_keys``);
    ``flags_given``: the ``--flags`` of ``flags`` that appear. ``shorthands`` rewrites a key
    (``{"launcher": "launcher.name"}``). ``-h``/``--help`` print :func:`help_text` and exit 0.
    Raises :class:`ConfigError` on anything else."""
    argv = list(argv)
    if any(a in HELP for a in argv):
        print(help_text(cls, doc, run_keys))
        raise SystemExit(0)
    own_fields = {f.name for f in fields(cls)}
    base = OmegaConf.structured(cls)
    own, overrides, given = [], [], set()
    run_known: Optional[set] = None
    for arg in argv:
        if arg.startswith("-") and "=" not in arg:
            if arg not in flags:
                raise ConfigError(f"unknown flag {arg!r}; this tool takes {', '.join(flags) or 'no flags'} and key=value")
            given.add(arg)
            continue
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {arg!r} (--help lists the keys)")
        key = (shorthands or {}).get(key, key)
        if key.split(".")[0] in own_fields:
            own.append(f"{key}={value}")
            continue
        if run_keys is not None:
            run_known = set(run_keys()) if run_known is None else run_known
            if key in run_known:
                overrides.append(arg)
                continue
        raise unknown_key_error(key, known_keys(base) + sorted(run_known or ()), "the command line", what="key")
    try:
        cfg = merge(base, OmegaConf.from_dotlist(own), source="the command line")
        return OmegaConf.to_object(cfg), overrides, given
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad command line: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # the dataclass's own checks (__post_init__)
        raise ConfigError(str(e).splitlines()[0]) from None


def parse_tool(cls, argv: Sequence[str], doc: str, run_keys: Callable[[], Iterable[str]]) -> tuple[dict[str, str], list[str]]:
    """A measurement tool's command line: ``(settings, run-config overrides)``, the settings of the
    dataclass ``cls`` as strings (the form the tools record in their JSON), every other key checked
    against ``run_keys()`` (``experiments.config.run_keys``). Raises :class:`ConfigError`."""
    from dataclasses import asdict

    parsed, overrides, _ = parse(cls, argv, doc=doc, run_keys=run_keys)
    return {k: str(v) for k, v in asdict(parsed).items()}, overrides


def fail(error: Exception, tool: str = "") -> int:
    """Print a command-line error the one way every tool does; the exit code 2."""
    print(f"config error{' (' + tool + ')' if tool else ''}: {error}", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class MethodSpec:
    """One entry of ``methods=``: ``logra:logra.embeddings=true logra.rank=32``."""

    label: str  # the entry as written (the tool's row label)
    method: str  # the method's registry name
    overrides: tuple[str, ...]  # its own run-config key=value overrides

    def run_overrides(self) -> list[str]:
        """``method=<name>`` and the entry's own overrides, for ``build_config``."""
        return [f"method={self.method}", *self.overrides]


def _split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside brackets and quotes (a list value may hold commas)."""
    parts, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return parts + [cur]


def parse_methods(text: str, known: Optional[Iterable[str]] = None) -> list[MethodSpec]:
    """``"dense,logra:logra.embeddings=true logra.rank=32"`` -> one :class:`MethodSpec` per entry.

    ``known``: the registered method names; an entry naming another is a :class:`ConfigError` with the
    closest name."""
    specs = []
    known = sorted(known) if known is not None else None
    for entry in (e.strip() for e in _split_top(str(text), ",")):
        if not entry:
            continue
        name, _, rest = entry.partition(":")
        name = name.strip()
        own = tuple(o for o in rest.split() if o)
        bad = [o for o in own if "=" not in o]
        if bad:
            raise ConfigError(f"methods entry {entry!r}: expected <method>[:key=value ...], got {bad[0]!r}")
        if known is not None and name not in known:
            raise unknown_key_error(name, known, f"methods={text!r}", what="method")
        specs.append(MethodSpec(entry, name, own))
    if not specs:
        raise ConfigError("methods= names no method")
    return specs
