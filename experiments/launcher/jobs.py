"""The job function: one run of a sweep, marked complete by ``done.json``, requeued on preemption.

:class:`TrainJob` is a ``submitit.helpers.Checkpointable``: when SLURM (or the local executor)
signals the end of the time limit or a preemption, submitit calls :meth:`TrainJob.checkpoint`,
which resubmits the same run with ``resume=true``; the requeued job continues from the newest
checkpoint in the run directory. The trainer, on SIGTERM/SIGUSR1, writes a checkpoint and raises
``experiments.rl.trainer.Preempted`` (``python -m experiments.train`` exits 143): the job then
hands over to submitit's requeue as if the signal had come to it. With ``gpus > 1`` the run is a
``torchrun`` subprocess (one per node) instead of an in-process call.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Union

import submitit

from experiments.common.config import flatten
from experiments.config import NOT_IDENTITY
from experiments.launcher import torchrun
from experiments.launcher.sweep import DONE
from experiments.launcher.torchrun import torchrun_command  # noqa: F401  (re-exported)

PREEMPTED_EXIT = 143  # python -m experiments.train after Preempted (128 + SIGTERM)


class RunPreempted(Exception):
    """A run stopped at a checkpoint because it was told to (signal); rerun it with resume=true."""


def train_run(cfg) -> list[dict]:
    """The default train function: one GRPO run of a resolved config."""
    from experiments.rl.trainer import GRPOTrainer

    return GRPOTrainer(cfg).train()


def _preempted_types() -> tuple:
    """The trainer's ``Preempted`` when it exists, and ours."""
    try:
        from experiments.rl.trainer import Preempted  # noqa: PLC0415
    except ImportError:
        return (RunPreempted,)
    return (RunPreempted, Preempted)


def _resolve(fn: Union[str, Callable]) -> Callable:
    if callable(fn):
        return fn
    module, _, attr = fn.partition(":")
    return getattr(importlib.import_module(module), attr)


def resume_overrides(run_dir: Path, overrides: list[str]) -> list[str]:
    """Keep a resumed run's saved values of keys outside its identity (e.g. ``log.samples``), which
    the trainer would otherwise refuse as a config change; the rest must match by construction."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.exists():
        return []
    from omegaconf import OmegaConf

    from experiments.config import build_config

    old = flatten(OmegaConf.to_container(OmegaConf.load(saved)))
    new = flatten(OmegaConf.to_container(build_config(overrides)))
    keep = []
    for k, v in old.items():
        if any(k == x or k.startswith(x + ".") for x in NOT_IDENTITY) and k not in ("out_dir", "resume") and new.get(k) != v:
            keep.append(f"{k}={json.dumps(v)}")
    return keep


class TrainJob(submitit.helpers.Checkpointable):
    """One run: ``overrides`` + ``out_dir=run_dir resume=true``; writes ``done.json`` on success.

    ``train_fn`` (a callable or ``"module:function"``) takes the resolved config; the default runs
    the GRPO trainer. ``gpus``/``nodes`` > 1 run ``torchrun`` instead of an in-process call."""

    def __init__(self, overrides: list[str], run_dir: Union[str, Path], train_fn: Union[str, Callable] = "experiments.launcher.jobs:train_run",
                 gpus: int = 1, nodes: int = 1, attempt: int = 0):
        self.overrides = list(overrides)
        self.run_dir = Path(run_dir)
        self.train_fn = train_fn
        self.gpus, self.nodes = int(gpus), int(nodes)
        self.attempt = attempt

    def args(self) -> list[str]:
        """The run's full ``key=value`` list (always resume=true: a fresh dir simply starts at step 0)."""
        return self.overrides + [f"out_dir={self.run_dir}", "resume=true"]

    def __call__(self) -> dict:
        done = self.run_dir / DONE
        if done.exists():
            return json.loads(done.read_text())
        args = self.args()
        args += resume_overrides(self.run_dir, args)
        start = time.time()
        requeue = _submitit_requeue_handler()
        if requeue is not None:  # submitit's time-limit signal goes to the trainer first, if it listens
            signal.signal(requeue[1], _forward_to_trainer(*requeue))
        try:
            if self.gpus > 1 or self.nodes > 1:
                self._torchrun(args, requeue[1] if requeue is not None else None)
                steps = None
            else:
                from experiments.config import build_config

                metrics = _resolve(self.train_fn)(build_config(args))
                steps = max((m.get("step", 0) for m in metrics or []), default=None)
        except _preempted_types() as e:
            if requeue is not None:  # hand over to submitit: checkpoint() then requeue, as on its own signal
                print(f"[launch] {self.run_dir.name}: preempted at a checkpoint; requeueing", flush=True)
                signal.signal(requeue[1], signal.SIG_IGN)  # a late second signal must not requeue twice
                requeue[0](requeue[1], None)
            raise RunPreempted(f"{self.run_dir} stopped at a checkpoint ({e}); rerun to resume") from e
        if self._rank() != 0:
            return {}
        record = {"run_dir": str(self.run_dir), "steps": steps, "wall_s": round(time.time() - start, 1),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "attempt": self.attempt}
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(done)
        return record

    def _rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", os.environ.get("SUBMITIT_LOCAL_NODEID", "0")) or 0)

    def _torchrun(self, args: list[str], listen=None) -> None:
        """The run as ``torchrun`` ranks (:mod:`experiments.launcher.torchrun`); ``listen``: submitit's
        signal, passed on to the ranks. Raises :class:`RunPreempted` when they stopped at a checkpoint."""
        if self.nodes > 1:
            os.environ.setdefault("LOGRA_RDZV_HOST", torchrun.first_host())
        rc, told = torchrun.run(torchrun_command(args, self.gpus, self.nodes), listen)
        if rc == 0:  # finished (a signal during the last step changes nothing)
            return
        if told or rc == PREEMPTED_EXIT:
            raise RunPreempted(f"torchrun exited {rc} after {'the job was signalled' if told else 'a preemption'}")
        if rc != 0:
            raise RuntimeError(f"torchrun exited with code {rc}")

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on timeout/preemption: resubmit the same run, resuming."""
        again = TrainJob(self.overrides, self.run_dir, self.train_fn, self.gpus, self.nodes, self.attempt + 1)
        return submitit.helpers.DelayedSubmission(again)


def _submitit_requeue_handler() -> Optional[tuple]:
    """submitit's checkpoint-and-requeue signal handler when running as a submitit job, else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    from submitit.core.job_environment import JobEnvironment

    sig = JobEnvironment._usr_sig()
    handler = signal.getsignal(sig)
    return (handler, sig) if callable(handler) else None


def _forward_to_trainer(submitit_handler, sig):
    """A handler for submitit's signal (SIGUSR2: the time limit is near): when the trainer listens to
    SIGUSR1 it gets the signal, checkpoints at the step boundary and raises ``Preempted`` (then
    :meth:`TrainJob.__call__` requeues); otherwise submitit checkpoints and requeues at once, and the
    requeued job resumes from the newest periodic checkpoint."""

    def handler(signum, frame):
        trainer = signal.getsignal(signal.SIGUSR1)
        if callable(trainer) and trainer is not handler:
            trainer(signal.SIGUSR1, frame)
        else:
            submitit_handler(signum, frame)

    return handler


def write_failure(run_dir: Path, text: str) -> Path:
    """Record a failed attempt's traceback in the run dir (``launch_error.txt``) and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "launch_error.txt"
    path.write_text(text)
    return path


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run jobs through python -m experiments.launch")
