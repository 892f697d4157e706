"""The ``slurm`` executor: a sweep's runs as one SLURM job array, through submitit.

Submission. The runs that are neither done nor still queued or running go out as one job array
(``sbatch --array=0-<n-1>%<max_parallel>``: at most ``launcher.max_parallel`` tasks at once, no
limit by default), one task per run, with the sweep's ``launcher:`` options (:data:`SLURM_KEYS`);
a single run is a plain job. The array's files (sbatch script, pickles, logs) live in
``<root>/submitit/<job>_<task>/``, and each run directory records its task in ``submitted.json``
(job id, log paths). A rerun skips runs whose task is still pending or running.

Waiting (``launcher.wait=true``): every ``poll_s`` one ``sacct`` call reads the state of every task;
a task is over when its result file exists or sacct says it ended (submitit's ``job.result()`` then
gives the run's outcome or the error and its log). A task that has left the queue (``squeue`` no
longer lists it) while sacct has no record of its end is reported failed after ``lost_after_s``:
on a cluster without accounting (``AccountingStorageType=accounting_storage/none``) submitit would
wait for such a job's result forever. Measured on a real scheduler: ``scripts/slurm_local.sh`` and
the ``slurm`` test tier (docs/usage.md).
"""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional
from unittest import mock

import submitit
from tqdm.auto import tqdm

from experiments.launcher.jobs import write_failure
from experiments.launcher.outcomes import Outcome, collect, make_job, print_line

# The sweep's launcher: keys (besides name, max_parallel, wait, max_num_timeout) and the submitit parameter each sets.
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
ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED", "REQUEUE_HOLD",
          "REQUEUE_FED")
SUBMITTED = "submitted.json"  # <run dir>/submitted.json: the task that runs it


def slurm_parameters(name: str, launcher: dict) -> dict:
    params = {"name": name, "tasks_per_node": 1, "timeout_min": 60 * 24}
    for key, value in launcher.items():
        if key in SLURM_KEYS and value is not None:
            params[SLURM_KEYS[key]] = value
    if launcher.get("max_parallel"):
        params["slurm_array_parallelism"] = int(launcher["max_parallel"])
    return params


@contextmanager
def _pretend_slurm():
    """submitit's SlurmExecutor refuses to exist without ``srun``; rendering a script needs no cluster."""
    with mock.patch.object(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2)):
        yield


def slurm_executor(folder: Path, name: str, launcher: dict, render_only: bool = False) -> submitit.AutoExecutor:
    timeouts = int(launcher.get("max_num_timeout", 3))
    with _pretend_slurm() if render_only else nullcontext():
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=timeouts)
    ex.update_parameters(**slurm_parameters(name, launcher))
    return ex


def array_folder(run) -> Path:
    """``<root>/submitit/%j``: submitit puts each task's files in ``<root>/submitit/<job>_<task>/``."""
    return run.run_dir.parent.parent / "submitit" / "%j"


def render_sbatch(run, launcher: dict) -> str:
    """The sbatch script submitit would submit for ``run`` alone (no cluster needed)."""
    ex = slurm_executor(array_folder(run), run.label, launcher, render_only=True)
    inner = ex._executor
    return inner._make_submission_file_text(inner._submitit_command_str, "render")


def job_of(run) -> Optional[submitit.SlurmJob]:
    """The task recorded in ``<run dir>/submitted.json``, or None."""
    path = run.run_dir / SUBMITTED
    if not path.exists():
        return None
    info = json.loads(path.read_text())
    return submitit.SlurmJob(folder=info["folder"], job_id=info["job_id"])


def squeue_state(job_id: str) -> Optional[str]:
    """The task's state while the controller lists it (pending, running, completing), else None."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    states = out.stdout.split()
    return states[0] if out.returncode == 0 and states else None


def state_of(job: submitit.SlurmJob, mode: str = "force") -> str:
    """sacct's state of a task; squeue's while sacct has none (no accounting, or not recorded yet)."""
    state = job.watcher.get_state(job.job_id, mode=mode)
    if state == "UNKNOWN":
        state = squeue_state(job.job_id) or "UNKNOWN"
    return state.split()[0].upper()


def submit(runs: list, launcher: dict, train_fn=None) -> list[tuple]:
    """Submit ``runs`` as one array; returns (run, job, submit time) per run."""
    root = runs[0].run_dir.parent.parent
    name = runs[0].label if len(runs) == 1 else root.name
    ex = slurm_executor(array_folder(runs[0]), name, launcher)
    with ex.batch():
        jobs = [ex.submit(make_job(run, launcher, train_fn)) for run in runs]
    now = time.time()
    for run, job in zip(runs, jobs):
        run.run_dir.mkdir(parents=True, exist_ok=True)
        record = {"job_id": job.job_id, "folder": str(array_folder(run)), "stdout": str(job.paths.stdout),
                  "stderr": str(job.paths.stderr), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (run.run_dir / SUBMITTED).write_text(json.dumps(record, indent=1))
    return [(run, job, now) for run, job in zip(runs, jobs)]


def wait(jobs: list[tuple], poll_s: float = 5.0, lost_after_s: float = 60.0, bar=None) -> list:
    """Block until every (run, job, t0) has ended; one :class:`Outcome` per run (see the module doc)."""
    pending, lost_since, outcomes = list(jobs), {}, []
    while pending:
        submitit.SlurmJob.watcher.update()  # one sacct call for every task still registered
        for item in list(pending):
            run, job, t0 = item
            if job.paths.result_pickle.exists() or job.watcher.is_done(job.job_id, mode="cache"):
                out = collect(run, job, t0)
            elif job.watcher.get_state(job.job_id, mode="cache") == "UNKNOWN" and squeue_state(job.job_id) is None:
                first = lost_since.setdefault(job.job_id, time.time())
                if time.time() - first < lost_after_s:
                    continue
                why = (f"job {job.job_id} left the queue without a result ({job.paths.result_pickle} is missing) and sacct "
                       f"has no record of how it ended (no accounting on this cluster?); waited {lost_after_s:.0f} s")
                log = write_failure(run.run_dir, f"{why}\n\nlogs: {job.paths.stdout}\n      {job.paths.stderr}\n")
                out = Outcome(run, "failed", job.paths.stderr if job.paths.stderr.exists() else log, why)
            else:
                lost_since.pop(job.job_id, None)
                continue
            pending.remove(item)
            outcomes.append(out)
            if bar is not None:
                bar(out)
        if pending:
            time.sleep(poll_s)
    return outcomes


def run_slurm(runs: list, launcher: dict, train_fn=None) -> list:
    """Submit every run not already queued or running as one array; with ``launcher.wait`` block and collect."""
    outcomes, todo = [], []
    known = {run.run_dir: job_of(run) for run in runs}  # every recorded task registered first: one sacct call for all
    if any(known.values()):
        submitit.SlurmJob.watcher.update()
    for run in runs:
        job = known[run.run_dir]
        state = state_of(job, mode="cache") if job is not None else None
        if state in ACTIVE:
            out = Outcome(run, "running", detail=f"job {job.job_id} already {state}")
            print_line(tqdm, out)
            outcomes.append(out)
        else:
            todo.append(run)
    submitted = submit(todo, launcher, train_fn) if todo else []
    for run, job, _ in submitted:
        print_line(tqdm, Outcome(run, "submitted", job.paths.stderr, f"job {job.job_id}"))
    limit = f", at most {launcher['max_parallel']} at once" if launcher.get("max_parallel") else ""
    if submitted:
        print(f"submitted {len(submitted)} runs as job {submitted[0][1].job_id.split('_')[0]}{limit}; "
              f"logs in {array_folder(submitted[0][0]).parent}/", flush=True)
    if not launcher.get("wait"):
        return outcomes + [Outcome(run, "submitted", job.paths.stderr, f"job {job.job_id}") for run, job, _ in submitted]
    return outcomes + wait(submitted, poll_s=float(launcher.get("poll_s", 5)),
                           lost_after_s=float(launcher.get("lost_after_s", 60)), bar=lambda o: print_line(tqdm, o))
