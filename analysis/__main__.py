"""``python -m analysis <results root> [--out DIR]``: every table and figure of a results root.

Writes ``<root>/tables/*.md|.tex`` (+ ``runs.csv``) and ``<root>/figures/*.png|.pdf`` (``--out``:
elsewhere) and prints each file it wrote; an output whose data is absent is skipped with one line
saying why. See ``analysis/report.py``.
"""

from __future__ import annotations

from pathlib import Path

from analysis.cli import root_cli
from analysis.report import build


def main(argv=None) -> int:
    args = root_cli("python -m analysis", __doc__, argv, extra=[
        ("--out", {"type": Path, "help": "write tables/ and figures/ here instead of under the root"})])
    build(args.root, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
