"""Train functions for tests/test_launch.py, importable from launched subprocesses (tests.launch_fakes)."""

import os
from pathlib import Path


def fake_train(cfg) -> list[dict]:
    """Count calls in <out_dir>/calls.txt; fail when the seed is listed in $LOGRA_FAKE_FAIL."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    calls = out / "calls.txt"
    calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
    if str(cfg.seed) in os.environ.get("LOGRA_FAKE_FAIL", "").split(","):
        raise RuntimeError(f"planned failure of seed {cfg.seed}")
    return [{"step": cfg.train.steps}]


def preempted_train(cfg) -> list[dict]:
    from experiments.launcher.jobs import RunPreempted

    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    raise RunPreempted("SIGTERM")


def toy_train(cfg) -> list[dict]:
    """The real trainer, with the toy task registered (a subprocess does not import conftest)."""
    import tests.toy_task  # noqa: F401
    from experiments.launcher.jobs import train_run

    return train_run(cfg)


def listening_train(cfg) -> list[dict]:
    """Like the trainer: on SIGUSR1 finish the step, then raise Preempted; here the job gets submitit's signal."""
    import signal

    from experiments.launcher.jobs import RunPreempted
    from submitit.core.job_environment import JobEnvironment

    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    told = []
    signal.signal(signal.SIGUSR1, lambda s, f: told.append(s))
    try:
        os.kill(os.getpid(), JobEnvironment._usr_sig())  # the time limit is near
        if told:
            (Path(cfg.out_dir) / "told.txt").write_text("SIGUSR1")
            raise RunPreempted("checkpointed after SIGUSR1")
        return [{"step": 0}]
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def paced_train(cfg) -> list[dict]:
    """The real trainer (toy task); in the SLURM attempt $LOGRA_PACED_ATTEMPT (SLURM_RESTART_COUNT:
    0, then 1 after the first requeue, ...) each step is followed by $LOGRA_STEP_PAUSE seconds of
    sleep: an attempt that lasts until a scheduler's periodic time-limit check without using the CPU.
    The pause changes no number the run computes."""
    import time

    import tests.toy_task  # noqa: F401
    from experiments.launcher.jobs import train_run
    from experiments.rl.trainer import GRPOTrainer

    paced = os.environ.get("SLURM_RESTART_COUNT", "0") == os.environ.get("LOGRA_PACED_ATTEMPT", "0")
    pause, step = float(os.environ.get("LOGRA_STEP_PAUSE", "0")) if paced else 0.0, GRPOTrainer.train_step

    def paced(self):
        record = step(self)
        time.sleep(pause)
        return record

    GRPOTrainer.train_step = paced
    return train_run(cfg)


def died_train(cfg) -> list[dict]:
    """A job that dies without a word (as the kernel's OOM killer would end it): no result, no traceback."""
    import signal

    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    os.kill(os.getpid(), signal.SIGKILL)


def job_environment() -> dict:
    """What a job sees of its allocation."""
    keys = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID")
    return {k: os.environ.get(k) for k in keys}
