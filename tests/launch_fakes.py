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
