"""The command line every analysis tool shares: ``python -m analysis[.<tool>] <root> [...]``.

:func:`root_cli` parses a results root (a usage error when it is not a directory) and the tool's
own arguments, declared as ``(name, keyword arguments of argparse's add_argument)`` pairs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

ROOT_HELP = "results root, e.g. results/quick"


def root_cli(prog: str, doc: str, argv: Sequence[str] | None = None, extra: Sequence[tuple[str, dict]] = (),
             root_help: str = ROOT_HELP) -> argparse.Namespace:
    """Parse ``argv``: the root, then ``extra`` arguments; the description is ``doc``'s first paragraph."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("root", type=Path, help=root_help)
    for name, kwargs in extra:
        ap.add_argument(name, **kwargs)
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        ap.error(f"{args.root} is not a directory")
    return args
