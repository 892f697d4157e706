"""Where a result came from, and writing it safely: the git sha of the tree, atomic file writes, a
measurement tool's CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[2]


def git_sha() -> str:
    """``git rev-parse HEAD`` of this repository, ``-dirty`` appended when tracked files changed;
    ``unknown`` outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a reader sees the old
    file or the new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_csv(path: Path, rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> Path:
    """``rows`` as CSV at ``path`` (folders made, written atomically): the ``columns`` given (keys a row
    lacks are empty, keys not listed are left out) or else the first row's keys."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, list(columns or (rows[0] if rows else [])), extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue())
    return path


def write_results(out: Path, name: str, rows: Sequence[dict], meta: dict, columns: Optional[Sequence[str]] = None) -> None:
    """A measurement tool's two files in ``out``: ``<name>.csv`` (:func:`write_csv`) and ``<name>.json``
    (``meta``: the command, git sha, settings and whatever else made the rows)."""
    write_csv(Path(out) / f"{name}.csv", rows, columns)
    write_atomic(Path(out) / f"{name}.json", json.dumps(meta, indent=1))
