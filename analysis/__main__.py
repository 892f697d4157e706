"""``python -m analysis <results root> [--out DIR]``: every table and figure of a results root.

Writes ``<root>/tables/*.md|.tex`` (+ ``runs.csv``) and ``<root>/figures/*.png|.pdf`` (``--out``:
elsewhere) and prints each file it wrote; an output whose data is absent is skipped with one line
saying why. See ``analysis/report.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.report import build


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="results root, e.g. results/quick")
    ap.add_argument("--out", type=Path, help="write tables/ and figures/ here instead of under the root")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        ap.error(f"{args.root} is not a directory")
    build(args.root, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
