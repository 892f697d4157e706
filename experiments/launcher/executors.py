"""Where jobs run: ``debug`` (in this process, one after another), ``local`` (submitit's
LocalExecutor: one process per run, at most ``max_parallel`` at once) and ``slurm`` (one job array
through submitit; the SLURM options come from the sweep's ``launcher:`` section:
:mod:`experiments.launcher.slurm`).

Every executor returns one :class:`Outcome` per run; a failing run is reported with its log path and
never stops the others.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, Iterable

import submitit
from tqdm.auto import tqdm

from experiments.launcher.jobs import RunPreempted, write_failure
from experiments.launcher.outcomes import Outcome, collect, make_job, print_line
from experiments.launcher.slurm import SLURM_KEYS, render_sbatch, run_slurm  # noqa: F401  (render_sbatch: re-exported)
from experiments.launcher.sweep import Run

# max_parallel: runs at once (local processes; the slurm array's limit); wait: slurm blocks until the runs end,
# polling every poll_s, and reports a job that left the queue with no trace in sacct after lost_after_s
LAUNCHER_KEYS = set(SLURM_KEYS) | {"name", "max_parallel", "wait", "max_num_timeout", "poll_s", "lost_after_s"}


def check_launcher(cfg: dict) -> None:
    unknown = set(cfg) - LAUNCHER_KEYS
    if unknown:
        raise ValueError(f"unknown launcher keys {sorted(unknown)}; known: {sorted(LAUNCHER_KEYS)}")


# ---- debug: in-process, sequential ------------------------------------------------------------
def run_debug(runs: list[Run], launcher: dict, train_fn=None) -> list[Outcome]:
    outcomes = []
    bar = tqdm(total=len(runs), desc="runs", unit="run", dynamic_ncols=True)
    for run in runs:
        bar.write(f"[  running] {run.label}")
        t0 = time.time()
        try:
            make_job(run, launcher, train_fn)()
            out = Outcome(run, "done", detail=f"{time.time() - t0:.0f} s")
        except RunPreempted as e:
            out = Outcome(run, "preempted", write_failure(run.run_dir, traceback.format_exc()), str(e))
        except Exception as e:  # noqa: BLE001  (isolation: one failing run never stops the others)
            out = Outcome(run, "failed", write_failure(run.run_dir, traceback.format_exc()), f"{type(e).__name__}: {e}"[:300])
        print_line(bar, out)
        outcomes.append(out)
        bar.update(1)
    bar.close()
    return outcomes


# ---- local: submitit LocalExecutor, throttled ---------------------------------------------------
def local_executor(run: Run, launcher: dict) -> submitit.LocalExecutor:
    ex = submitit.LocalExecutor(folder=run.run_dir / "submitit", max_num_timeout=int(launcher.get("max_num_timeout", 3)))
    ex.update_parameters(timeout_min=float(launcher.get("timeout_min", 7 * 24 * 60)), gpus_per_node=0, tasks_per_node=1)
    return ex


def run_local(runs: list[Run], launcher: dict, train_fn=None, poll_s: float = 1.0) -> list[Outcome]:
    """One process per run (submitit LocalExecutor), ``launcher.max_parallel`` (default 1) at once."""
    limit = max(1, int(launcher.get("max_parallel", 1)))
    queue, active, outcomes = list(runs), [], []
    bar = tqdm(total=len(runs), desc="runs", unit="run", dynamic_ncols=True)
    try:
        while queue or active:
            while queue and len(active) < limit:
                run = queue.pop(0)
                job = local_executor(run, launcher).submit(make_job(run, launcher, train_fn))
                bar.write(f"[  running] {run.label}  (pid {job.job_id}, log {job.paths.stdout})")
                active.append((run, job, time.time()))
            time.sleep(poll_s)
            for item in [a for a in active if a[1].done()]:
                active.remove(item)
                run, job, t0 = item
                out = collect(run, job, t0)
                print_line(bar, out)
                outcomes.append(out)
                bar.update(1)
    except KeyboardInterrupt:
        for run, job, _ in active:
            job.cancel()
        raise
    finally:
        bar.close()
    return outcomes


EXECUTORS: dict[str, Callable[..., list[Outcome]]] = {"debug": run_debug, "local": run_local, "slurm": run_slurm}


def launch(runs: Iterable[Run], launcher: dict, train_fn=None) -> list[Outcome]:
    name = launcher.get("name", "local")
    if name not in EXECUTORS:
        raise ValueError(f"unknown launcher {name!r}; known: {sorted(EXECUTORS)}")
    check_launcher(launcher)
    return EXECUTORS[name](list(runs), launcher, train_fn)
