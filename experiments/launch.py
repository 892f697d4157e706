"""Launch a sweep: ``python -m experiments.launch sweep=<yaml or name> [launcher=local|slurm|debug] [--dry-run]``.

Examples:
    python -m experiments.launch sweep=quick                      # experiments/sweeps/quick.yaml, local processes
    python -m experiments.launch sweep=cpu launcher.max_parallel=2
    python -m experiments.launch sweep=paper launcher=slurm launcher.partition=gpu launcher.account=me
    python -m experiments.launch sweep=paper --dry-run            # the plan + per-GPU memory prediction per job
    python -m experiments.launch sweep=my_sweep.yaml root=/scratch/me/results train.steps=5

Arguments: ``sweep=`` (required), ``launcher=<name>``, ``launcher.<key>=<value>`` (max_parallel,
partition, account, gpus_per_node, cpus_per_task, nodes, timeout_min, mem_gb, wait, poll_s, lost_after_s, ...),
``root=<dir>`` (default runs/<sweep name>, git-ignored; ``python -m experiments.publish`` copies a
finished root into results/<sweep name>), ``--dry-run``, ``--memory`` (the planner's prediction in the
dry run); any other ``key=value`` is a run-config key (``python -m experiments.train --help``), an
override applied to every run (it changes the runs' keys, hence their directories). A sweep's
``grid``/``ablations`` pick a method with overrides as run-config keys: ``{method: logra, logra.rank: 32}``.

Runs already marked complete (``done.json``) are skipped; the others run (or resume from their
checkpoints). A failing run is reported with its log path and the others go on; the exit code is 1
when any run failed, and rerunning the same command runs only those.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from experiments.common.cli import parse as parse_cli
from experiments.common.config import ConfigError


@dataclass
class LaunchArgs:
    sweep: str = ""  # a sweep YAML: a path or a name in experiments/sweeps/ (required)
    root: Optional[str] = None  # the results root; default: the sweep's root, else results/<sweep name>
    launcher: Dict[str, Any] = field(default_factory=dict)  # launcher=<debug|local|slurm> and launcher.<key>=<value> (over the sweep's launcher section)


def parse(argv: list[str]) -> dict:
    from experiments.config import run_keys

    args, extra, flags = parse_cli(LaunchArgs, argv, doc=__doc__, run_keys=run_keys, flags=("--dry-run", "-n", "--memory"),
                                   shorthands={"launcher": "launcher.name"})
    if not args.sweep:
        raise ConfigError("sweep=<yaml or name> is required (e.g. sweep=quick)")
    return {"sweep": args.sweep, "root": args.root, "dry_run": bool({"--dry-run", "-n"} & flags),
            "launcher": dict(args.launcher), "extra": extra, "show_memory": True if "--memory" in flags else None}


def run_after(sweep, dry_run: bool) -> bool:
    """Run the sweep's ``after:`` commands (each skipped when its ``creates`` file exists)."""
    from experiments.launcher.report import after_args

    ok = True
    for step in sweep.after:
        label = step.get("name", step["module"])
        creates = step.get("creates")
        if creates and Path(str(creates).format(root=sweep.root)).exists():
            print(f"[  skipped] {label}: {str(creates).format(root=sweep.root)} exists")
            continue
        if importlib.util.find_spec(step["module"]) is None:
            print(f"[unavailable] {label}: module {step['module']} is not in this tree yet; skipped")
            continue
        cmd = [sys.executable, "-m", step["module"], *after_args(step, sweep)]
        print(f"[  running] {label}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            print(f"[   failed] {label}: exit code {rc}")
            ok = False
    return ok


def main(argv: list[str] | None = None, train_fn=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
        from experiments.launcher.executors import check_launcher, launch
        from experiments.launcher.report import print_plan, print_summary, write_summary_csv
        from experiments.launcher.sweep import load_sweep

        sweep = load_sweep(args["sweep"], args["root"])
        launcher = {**sweep.launcher, **args["launcher"]}
        launcher.setdefault("name", "local")
        check_launcher(launcher)
        runs = sweep.runs(tuple(args["extra"]))
    except (ConfigError, ValueError) as e:
        print(f"launch error: {e}", file=sys.stderr)
        return 2
    show_memory = args["show_memory"] if args["show_memory"] is not None else bool(sweep.planner)
    if args["dry_run"]:
        print_plan(sweep, runs, launcher, show_memory)
        return 0
    skipped = [r for r in runs if r.done]
    todo = [r for r in runs if not r.done]
    print(f"sweep {sweep.name}: {len(runs)} runs ({len(skipped)} done, skipped; {len(todo)} to run) "
          f"with launcher {launcher['name']} -> {sweep.root}/runs", flush=True)
    for run in skipped:
        print(f"[  skipped] {run.label} (done)")
    outcomes = launch(todo, launcher, train_fn) if todo else []
    print_summary(outcomes, skipped)
    path = write_summary_csv(sweep.root, runs, outcomes)
    print(f"run summary: {path}")
    failed = any(o.status in ("failed", "preempted") for o in outcomes)
    after_ok = run_after(sweep, dry_run=False) if sweep.after else True
    return 1 if failed or not after_ok else 0


if __name__ == "__main__":
    sys.exit(main())
