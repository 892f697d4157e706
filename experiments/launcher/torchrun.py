"""A multi-GPU run inside a job: ``torchrun`` as a subprocess, and the scheduler's signals passed on.

A job with ``gpus_per_node`` > 1 (or ``nodes`` > 1) runs ``torchrun ... -m experiments.train`` in a
subprocess (one per node). SLURM signals every process of a job step (proctrack linuxproc and cgroup
alike): the time-limit warning and submitit's preemption signal (SIGUSR2) would also reach torchrun
and the ranks, whose default action for it is to die. So torchrun is started with SIGUSR1 and SIGUSR2
ignored (the ranks inherit that until the trainer installs its own SIGUSR1 handler); the job's process
keeps submitit's signal for itself and passes it on as SIGUSR1 to torchrun's process group — again
every few seconds while torchrun runs, for a rank that was still loading the first time. Each rank
then finishes its step, every rank writes its part of one checkpoint and they exit
(docs/fault_tolerance.md); the job hands over to submitit's requeue (:mod:`experiments.launcher.jobs`).
SIGTERM keeps torchrun's own handling (it passes SIGTERM on to the ranks).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Optional

REFORWARD_S = 5.0  # pass the signal on again this often while torchrun runs


def torchrun_command(overrides: list[str], gpus: int, nodes: int = 1, port: int = 29500) -> list[str]:
    """The command of a multi-GPU run (docs/distributed.md): every rank gets the same args.

    One node: ``torchrun --standalone --nproc_per_node=G -m experiments.train <args>``. Several
    nodes: one task per node (srun), rendezvous at the first host of the allocation."""
    if nodes <= 1:
        head = ["torchrun", "--standalone", f"--nproc_per_node={gpus}"]
    else:
        host = os.environ.get("LOGRA_RDZV_HOST") or "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"
        head = ["torchrun", "--nnodes=" + os.environ.get("SLURM_NNODES", str(nodes)), f"--nproc_per_node={gpus}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={host}:{port}", "--rdzv_id=" + os.environ.get("SLURM_JOB_ID", "logra")]
    return head + ["-m", "experiments.train"] + list(overrides)


def first_host() -> str:
    """The first host of the SLURM allocation (the rendezvous of a multi-node job)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30).stdout
        return out.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "localhost"


def _ignore_user_signals() -> None:  # in the child, before exec: inherited by torchrun and its ranks
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def run(cmd: list[str], listen: Optional[signal.Signals] = None) -> tuple[int, bool]:
    """Run a :func:`torchrun_command` with this interpreter (``python -m torch.distributed.run``, so
    the job's own environment runs it); returns (exit code, whether ``listen`` came meanwhile).

    With ``listen`` (submitit's signal in a submitit job) that signal is caught here and passed on as
    SIGUSR1 to torchrun's process group; without it torchrun runs as a plain subprocess."""
    if cmd and cmd[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
    print("[launch] " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if listen is None:
        return subprocess.run(cmd).returncode, False
    told: list[float] = []
    group: list[int] = []  # torchrun's process group, once started

    def forward(signum, frame):
        if not told:
            print(f"[launch] {signal.Signals(signum).name}: the ranks checkpoint at the end of their step", flush=True)
        told.append(time.time())
        if group:
            _signal_group(group[0])

    old = signal.signal(listen, forward)  # before the start: a signal in between is not lost
    try:
        proc = subprocess.Popen(cmd, preexec_fn=_ignore_user_signals, start_new_session=True)
        group.append(proc.pid)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                if told and time.time() - told[-1] > REFORWARD_S:
                    told.append(time.time())
                    _signal_group(proc.pid)
        except BaseException:
            _signal_group(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    finally:
        signal.signal(listen, old)
    return proc.returncode, bool(told)


def _signal_group(pgid: int, sig: signal.Signals = signal.SIGUSR1) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
