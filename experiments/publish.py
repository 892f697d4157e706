"""Publish a finished sweep root as the committed reference: ``runs/<profile>`` -> ``results/<profile>``.

    python -m experiments.publish sweep=quick                    # runs/quick -> results/quick
    python -m experiments.publish sweep=cpu --partial            # only the finished runs, merged in
    python -m experiments.publish sweep=cpu root=/scratch/cpu to=results/cpu [key=value ...]
    ./run_all.sh --profile cpu --publish [--partial]              # the same, from run_all

Training writes to a git-ignored root (``runs/<sweep name>`` by default); the committed
``results/<sweep name>/`` is what ``./run_all.sh`` compares a new run with. This tool is the only
writer of ``results/``, for maintainers. ``key=value`` overrides must be those the runs were
launched with (they are part of the runs' hashes, hence of their directories).

Finished means: every run of the sweep has ``done.json`` and every ``after:`` step's ``creates``
file exists. An unfinished root is refused with the list of what is missing. ``--partial``
publishes the finished runs only and merges them into the destination (a run already there from an
earlier publish stays; the cpu profile is meant to be run and published in parts); without it the
destination is replaced, keeping only its ``README.md``.

What is copied: each finished run directory (config, meta, metrics, samples, the per-problem
``eval_outcomes.jsonl`` the paired accuracy intervals need, ...) and the root's other data folders
(``memory/``, ``time/``, ...), without ``checkpoints/``, ``submitit/`` logs and anything git ignores
at the destination. ``summary.csv`` (the launcher's run list) and the analysis step's ``tables/`` and
``figures/`` are then rewritten from the destination's own runs, and the headline lines of
``tables/summary.md`` (each method's best learning rate, logra − dense with its interval) printed
for the destination's README.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from experiments.config import ConfigError
from experiments.launcher.sweep import load_sweep

EXCLUDED_DIRS = {"checkpoints", "submitit", "__pycache__", ".ipynb_checkpoints"}  # never published
REWRITTEN = {"runs", "tables", "figures", "summary.csv"}  # root entries the publish step writes itself
KEPT = {"README.md"}  # the destination's hand-written account survives a full publish
USAGE = "usage: python -m experiments.publish sweep=<name> [root=<dir>] [to=<dir>] [--partial] [key=value ...]"


class PublishError(Exception):
    """The root cannot be published as asked (unfinished, absent, or the destination itself)."""


def ignored_by_git(paths: list[Path]) -> set[Path]:
    """The paths among ``paths`` that the enclosing git work tree's ignore rules exclude (each
    checked by pattern, tracked or not); none outside a work tree or without git."""
    if not paths:
        return set()
    probe = next((p for p in paths[0].parents if p.exists()), Path.cwd())
    try:
        top = subprocess.run(["git", "-C", str(probe), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return set()
    rel = {str(p.resolve().relative_to(Path(top).resolve())): p for p in paths}
    out = subprocess.run(["git", "-C", top, "check-ignore", "--no-index", "--stdin", "-z"],
                         input="\0".join(rel) + "\0", capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 1: nothing ignored
        raise PublishError(f"git check-ignore failed: {out.stderr.strip()}")
    return {rel[name] for name in out.stdout.split("\0") if name}


def copy_filtered(src: Path, dst: Path) -> list[Path]:
    """Copy the files under ``src`` to ``dst`` except :data:`EXCLUDED_DIRS` and git-ignored
    destinations; returns the destination files written."""
    pairs = []
    for path in sorted(src.rglob("*") if src.is_dir() else [src]):
        rel = path.relative_to(src) if src.is_dir() else Path(path.name)
        if path.is_file() and not EXCLUDED_DIRS & set(rel.parts):
            pairs.append((path, dst / rel if src.is_dir() else dst))
    skip = ignored_by_git([d for _, d in pairs])
    written = []
    for path, target in pairs:
        if target in skip:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        written.append(target)
    return written


def check_finished(sweep, runs) -> list[str]:
    """What keeps the root from being finished: runs without done.json, absent ``after:`` outputs."""
    missing = [f"run {r.run_dir} ({'started, not done' if r.started else 'not started'})" for r in runs if not r.done]
    for step in sweep.after:
        creates = step.get("creates")
        if creates and not Path(str(creates).format(root=sweep.root)).exists():
            missing.append(f"{step.get('name', step['module'])}: {str(creates).format(root=sweep.root)} absent")
    return missing


def publish(sweep_name: str, root: str | None = None, to: str | None = None, extra: tuple[str, ...] = (),
            partial: bool = False, analyse: bool = True, log=print) -> Path:
    """Copy the finished root of ``sweep_name`` into ``to`` (default ``results/<sweep name>``);
    returns the destination. Raises :class:`PublishError` when it is not finished (see the module
    docstring) and ``partial`` is false."""
    sweep = load_sweep(sweep_name, root)
    dest = Path(to or f"results/{sweep.name}")
    if not sweep.root.is_dir():
        raise PublishError(f"{sweep.root} does not exist: nothing to publish "
                           f"(./run_all.sh --profile {sweep.name} trains into it)")
    if sweep.root.resolve() == dest.resolve():
        raise PublishError(f"{sweep.root} is the destination itself: publish copies a training root into results/")
    runs = sweep.runs(extra)
    done = [r for r in runs if r.done]
    missing = check_finished(sweep, runs)
    if not done:
        raise PublishError(f"{sweep.root}: none of the sweep's {len(runs)} runs is finished; nothing to publish")
    if missing and not partial:
        shown = "\n  ".join(missing[:20]) + (f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise PublishError(
            f"{sweep.root} is not finished ({len(done)} of {len(runs)} runs done); missing:\n  {shown}\n"
            f"finish it (./run_all.sh --profile {sweep.name} resumes), or add --partial to publish the "
            f"{len(done)} finished runs only")
    if dest.exists() and not partial:
        for entry in dest.iterdir():
            if entry.name not in KEPT:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    written = 0
    for run in done:
        target = dest / "runs" / run.run_dir.name
        if target.exists():
            shutil.rmtree(target)
        written += len(copy_filtered(run.run_dir, target))
    for entry in sorted(sweep.root.iterdir()):
        if entry.name not in REWRITTEN | KEPT | EXCLUDED_DIRS:
            written += len(copy_filtered(entry, dest / entry.name))
    from experiments.launcher.report import write_summary_csv

    dest_runs = load_sweep(sweep_name, str(dest)).runs(extra)
    write_summary_csv(dest, dest_runs, [])
    known = {r.run_dir.name for r in dest_runs}
    stale = sorted(p.name for p in (dest / "runs").iterdir() if p.is_dir() and p.name not in known)
    log(f"published {len(done)} of {len(runs)} runs of sweep {sweep.name} from {sweep.root} to {dest} "
        f"({written} files; no checkpoints, submitit logs or git-ignored files)")
    if missing:
        log(f"left out (not finished): {len(missing)}: " + "; ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    if stale:
        log(f"{dest}/runs also holds {len(stale)} runs of an earlier publish that this sweep no longer lists: "
            + ", ".join(stale[:5]) + (" ..." if len(stale) > 5 else "") + " (a full publish removes them)")
    if analyse:
        from analysis.report import SUMMARY, build

        build(dest, log=lambda line: None)
        log(f"tables and figures of {dest} rewritten (python -m analysis {dest})")
        summary = dest / "tables" / SUMMARY
        if summary.exists():  # the headline lines (best rates, accuracy vs dense) for the README
            log(f"{summary}:\n" + "\n".join(line for line in summary.read_text().splitlines() if line.startswith("- ")))
    log(f"next: say in {dest}/README.md what was run and left out, then git add {dest}")
    return dest


@dataclass
class PublishArgs:
    sweep: str = ""  # the sweep (a name in experiments/sweeps/ or a path) whose runs are published (required)
    root: Optional[str] = None  # where the runs are; default runs/<sweep name>
    to: Optional[str] = None  # the destination; default results/<sweep name>
    launcher: Dict[str, Any] = field(default_factory=dict)  # accepted and ignored: where runs were launched does not name them


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from experiments.common.cli import fail, parse
    from experiments.config import run_keys

    try:
        args, extra, flags = parse(PublishArgs, argv, doc=__doc__, run_keys=run_keys, flags=("--partial",),
                                   shorthands={"launcher": "launcher.name"})
        if not args.sweep:
            raise ConfigError("sweep=<name> is required")
    except ConfigError as e:
        return fail(e, "experiments.publish")
    try:
        publish(args.sweep, args.root, args.to, tuple(extra), "--partial" in flags)
    except (PublishError, ConfigError) as e:
        print(f"publish refused: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
