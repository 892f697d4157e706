"""Rename run directories keyed by an earlier run-key scheme to their current key.

    python -m experiments.launcher.migrate <root> [--dry-run]

A sweep keeps each run in ``<root>/runs/<name>-<hash8>`` and skips it when ``done.json`` is there.
When the key scheme changes (``experiments.config.SCHEMA_VERSION``; before version 2, hash8 covered
every resolved key of every method's section, so any new key or default re-keyed every run), the
sweep would no longer find finished runs. This recomputes each directory's key from the
``config.yaml`` it holds (``experiments.config.run_key``: an old config's other method sections are
ignored) and renames ``<name>-<old>`` to ``<name>-<new>``, rewriting the directory's own name where
the run recorded it (``out_dir`` in ``config.yaml``, ``run_dir`` in ``done.json``, so that a resume
sees no config change) and in ``<root>/summary.csv`` and ``<root>/tables/*.csv``. Metrics, samples,
checkpoints and ``meta.json`` are untouched. A directory whose new name exists already is left
alone and reported. Rerunning it changes nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments.config import run_key

KEYED = re.compile(r"^(?P<name>.+)-(?P<key>[0-9a-f]{8})$")


def plan_renames(root: Path) -> list[tuple[Path, Path]]:
    """``(old dir, new dir)`` for every run directory under ``<root>/runs`` whose key is stale."""
    out = []
    for run_dir in sorted((Path(root) / "runs").glob("*")):
        m = KEYED.match(run_dir.name)
        if not (m and (run_dir / "config.yaml").is_file()):
            continue
        key = run_key(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True))
        if key != m["key"]:
            out.append((run_dir, run_dir.with_name(f"{m['name']}-{key}")))
    return out


def migrate(root: Path, dry_run: bool = False) -> list[tuple[Path, Path]]:
    """Rename the stale run directories under ``root``; returns what was (or would be) renamed."""
    root = Path(root)
    done = []
    for old, new in plan_renames(root):
        if new.exists():
            print(f"[   kept] {old.name}: {new.name} exists already")
            continue
        print(f"[{'would rename' if dry_run else 'renamed'}] {old.name} -> {new.name}")
        done.append((old, new))
        if dry_run:
            continue
        old.rename(new)
        # a path ending in the old name (out_dir, run_dir, summary rows) now ends in the new one
        name, old_key, new_key = KEYED.match(old.name)["name"], old.name[-8:], new.name[-8:]
        pattern = re.compile(re.escape(old.name) + r"(?![0-9A-Za-z])")
        for path in [new / "config.yaml", new / "done.json", root / "summary.csv", *sorted((root / "tables").glob("*.csv"))]:
            if path.is_file():
                text = pattern.sub(new.name, path.read_text())
                path.write_text(text.replace(f"{name},{old_key},", f"{name},{new_key},"))  # summary.csv's hash column
    return done


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    dry_run = "--dry-run" in argv
    roots = [a for a in argv if a != "--dry-run"]
    for root in roots:
        if not (Path(root) / "runs").is_dir():
            print(f"migrate error: {root}/runs is not a directory", file=sys.stderr)
            return 2
        renamed = migrate(Path(root), dry_run)
        print(f"{root}: {len(renamed)} run directories {'to rename' if dry_run else 'renamed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
