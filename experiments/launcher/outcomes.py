"""What every executor returns and prints: one :class:`Outcome` per run, the job of a run, and the
outcome of a finished submitit job (local process or SLURM task) with its log."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from experiments.launcher.jobs import TrainJob, write_failure
from experiments.launcher.sweep import Run


@dataclass
class Outcome:
    run: Run
    status: str  # done | skipped | failed | submitted | running | preempted
    log: Optional[Path] = None
    detail: str = ""


def make_job(run: Run, launcher: dict, train_fn=None) -> TrainJob:
    kw = {"train_fn": train_fn} if train_fn is not None else {}
    return TrainJob(run.overrides, run.run_dir, gpus=int(launcher.get("gpus_per_node") or 1), nodes=int(launcher.get("nodes") or 1), **kw)


def print_line(bar, outcome: Outcome) -> None:
    """One line per outcome (through tqdm's ``write``, so a progress bar stays intact)."""
    where = f"  log: {outcome.log}" if outcome.log and outcome.status in ("failed", "preempted") else ""
    detail = f"  ({outcome.detail})" if outcome.detail else ""
    bar.write(f"[{outcome.status:>9}] {outcome.run.label}{detail}{where}")


def collect(run: Run, job, t0: float) -> Outcome:
    """The outcome of a finished submitit job: done, or failed/preempted with its log."""
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
