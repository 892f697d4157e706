"""Where jobs run: ``debug`` (in this process, one after another), ``local`` (submitit's
LocalExecutor: one process per run, at most ``max_parallel`` at once) and ``slurm`` (submitit's
AutoExecutor; the SLURM options come from the sweep's ``launcher:`` section).

Every executor returns one :class:`Outcome` per run; a failing run is reported with its log path and
never stops the others.
"""

from __future__ import annotations

import json
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional
from unittest import mock

import submitit
from tqdm.auto import tqdm

from experiments.launcher.jobs import RunPreempted, TrainJob, write_failure
from experiments.launcher.sweep import Run

# The sweep's launcher: keys (besides name, max_parallel, wait) and the submitit parameter each sets.
SLURM_KEYS = {
    "partition": "slurm_partition",
    "account": "slurm_account",
    "qos": "slurm_qos",
    "constraint": "slurm_constraint",
    "gpus_per_node": "gpus_per_node",
    "cpus_per_task": "cpus_per_task",
    "nodes": "nodes",
    "timeout_min": "timeout_min",
    "mem_gb": "mem_gb",
    "setup": "slurm_setup",
    "additional": "slurm_additional_parameters",
    "signal_delay_s": "slurm_signal_delay_s",
}
LAUNCHER_KEYS = set(SLURM_KEYS) | {"name", "max_parallel", "wait", "max_num_timeout"}


@dataclass
class Outcome:
    run: Run
    status: str  # done | skipped | failed | submitted | running | preempted
    log: Optional[Path] = None
    detail: str = ""


def check_launcher(cfg: dict) -> None:
    unknown = set(cfg) - LAUNCHER_KEYS
    if unknown:
        raise ValueError(f"unknown launcher keys {sorted(unknown)}; known: {sorted(LAUNCHER_KEYS)}")


def make_job(run: Run, launcher: dict, train_fn=None) -> TrainJob:
    kw = {"train_fn": train_fn} if train_fn is not None else {}
    return TrainJob(run.overrides, run.run_dir, gpus=int(launcher.get("gpus_per_node") or 1), nodes=int(launcher.get("nodes") or 1), **kw)


def _line(bar, outcome: Outcome) -> None:
    where = f"  log: {outcome.log}" if outcome.log and outcome.status in ("failed", "preempted") else ""
    detail = f"  ({outcome.detail})" if outcome.detail else ""
    bar.write(f"[{outcome.status:>9}] {outcome.run.label}{detail}{where}")


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
        _line(bar, out)
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
                out = _collect(run, job, t0)
                _line(bar, out)
                outcomes.append(out)
                bar.update(1)
    except KeyboardInterrupt:
        for run, job, _ in active:
            job.cancel()
        raise
    finally:
        bar.close()
    return outcomes


def _collect(run: Run, job, t0: float) -> Outcome:
    log = job.paths.stderr
    try:
        job.result()
        return Outcome(run, "done", log, f"{time.time() - t0:.0f} s")
    except Exception as e:  # noqa: BLE001  submitit re-raises the job's error as FailedJobError
        text = str(e)
        write_failure(run.run_dir, f"{text}\n\nlogs: {job.paths.stdout}\n      {job.paths.stderr}\n")
        status = "preempted" if "RunPreempted" in text or "Preempted" in text else "failed"
        last = [l for l in text.strip().splitlines() if l.strip()][-1:] or ["failed"]
        return Outcome(run, status, log, last[0][:300])


# ---- slurm: submitit AutoExecutor ---------------------------------------------------------------
def slurm_parameters(run: Run, launcher: dict) -> dict:
    params = {"name": run.label, "tasks_per_node": 1, "timeout_min": 60 * 24}
    for key, value in launcher.items():
        if key in SLURM_KEYS and value is not None:
            params[SLURM_KEYS[key]] = value
    return params


@contextmanager
def _pretend_slurm():
    """submitit's SlurmExecutor refuses to exist without ``srun``; rendering a script needs no cluster."""
    with mock.patch.object(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2)):
        yield


def slurm_executor(run: Run, launcher: dict, render_only: bool = False) -> submitit.AutoExecutor:
    folder = run.run_dir / "submitit"
    if render_only:
        with _pretend_slurm():
            ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=int(launcher.get("max_num_timeout", 3)))
    else:
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=int(launcher.get("max_num_timeout", 3)))
    ex.update_parameters(**slurm_parameters(run, launcher))
    return ex


def render_sbatch(run: Run, launcher: dict) -> str:
    """The sbatch script submitit would submit for ``run`` (no cluster needed)."""
    ex = slurm_executor(run, launcher, render_only=True)
    inner = ex._executor
    return inner._make_submission_file_text(inner._submitit_command_str, "render")


def _slurm_state(run: Run) -> Optional[str]:
    path = run.run_dir / "submitted.json"
    if not path.exists():
        return None
    job_id = json.loads(path.read_text())["job_id"]
    try:
        return submitit.SlurmJob(folder=run.run_dir / "submitit", job_id=job_id).state
    except Exception:  # noqa: BLE001  (no sacct here: treat as unknown, resubmit)
        return None


def run_slurm(runs: list[Run], launcher: dict, train_fn=None) -> list[Outcome]:
    """Submit every run not already queued or running; with ``launcher.wait`` block and collect."""
    outcomes, jobs = [], []
    bar = tqdm(total=len(runs), desc="submit", unit="run", dynamic_ncols=True)
    for run in runs:
        state = _slurm_state(run)
        if state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED"):
            out = Outcome(run, "running", detail=f"already {state}")
        else:
            job = slurm_executor(run, launcher).submit(make_job(run, launcher, train_fn))
            (run.run_dir / "submitted.json").write_text(json.dumps({"job_id": job.job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))
            jobs.append((run, job, time.time()))
            out = Outcome(run, "submitted", job.paths.stderr, f"job {job.job_id}")
        _line(bar, out)
        outcomes.append(out)
        bar.update(1)
    bar.close()
    if launcher.get("wait"):
        waited = []
        for run, job, t0 in jobs:
            job.wait()
            out = _collect(run, job, t0)
            _line(tqdm, out)
            waited.append(out)
        done = {id(o.run) for o in waited}
        outcomes = [o for o in outcomes if id(o.run) not in done] + waited
    return outcomes


EXECUTORS: dict[str, Callable[..., list[Outcome]]] = {"debug": run_debug, "local": run_local, "slurm": run_slurm}


def launch(runs: Iterable[Run], launcher: dict, train_fn=None) -> list[Outcome]:
    name = launcher.get("name", "local")
    if name not in EXECUTORS:
        raise ValueError(f"unknown launcher {name!r}; known: {sorted(EXECUTORS)}")
    check_launcher(launcher)
    return EXECUTORS[name](list(runs), launcher, train_fn)
