"""Which code version made a result: git shas as the tables show them.

A sha is shown whole, with its ``-dirty`` marker (the tree had uncommitted changes when the result was
made): :func:`shown` never cuts it. :func:`versions` lists the distinct shas of a set of inputs, so a
table or a README row says when its numbers come from several code versions. :func:`folder_sha` finds
the sha of a results folder whose files record none in machine-readable form, from the first
``sha <hex>`` its README states, expanded to the full sha by ``git rev-parse`` where this checkout
has the commit.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
_SHA = re.compile(r"\b(?:git sha|sha|at commit)\s+`?([0-9a-f]{7,40}(?:-dirty)?)")


def shown(sha) -> str:
    """The sha as a table shows it: whole, ``-dirty`` kept; ``unknown`` when absent."""
    text = str(sha).strip() if sha is not None else ""
    return text if text and text.lower() != "nan" else "unknown"


def versions(shas: Iterable) -> list[str]:
    """The distinct shas (shown whole), sorted."""
    return sorted({shown(s) for s in shas})


@functools.lru_cache(maxsize=None)
def full_sha(short: str) -> str:
    """``short`` (7+ hex digits, maybe ``-dirty``) expanded to 40 by ``git rev-parse``; unchanged where
    git or the commit is not there."""
    base, dirty = (short[:-6], "-dirty") if short.endswith("-dirty") else (short, "")
    if len(base) == 40:
        return short
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"], cwd=REPO,
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return (out if len(out) == 40 else base) + dirty


def folder_sha(folder: Path) -> str:
    """The sha a results folder's README states first (expanded), or ``unknown``."""
    readme = Path(folder) / "README.md"
    found = _SHA.search(readme.read_text()) if readme.exists() else None
    return full_sha(found.group(1)) if found else "unknown"
