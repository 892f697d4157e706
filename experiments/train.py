"""One GRPO run: ``python -m experiments.train [config=<yaml>] [key=value ...]``.

Examples:
    python -m experiments.train method=dense task=arith model=smollm2-135m-instruct train.steps=20 out_dir=runs/dense
    python -m experiments.train config=arith_dense out_dir=runs/a resume=true
    python -m experiments.train --show method=dense        # print the resolved config and exit
    torchrun --nproc_per_node=2 -m experiments.train method=logra dist.strategy=ddp out_dir=runs/dp   # data-parallel

Exit codes: 0 done; 2 config error; 143 preempted (SIGTERM/SIGUSR1: a checkpoint was written, rerun
with resume=true, as submitit's requeue does); any other: an error (traceback on stderr).
"""

from __future__ import annotations

import sys

from experiments.config import ConfigError, build_config, describe, to_yaml


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Keys, defaults and meanings (override any as key=value):\n")
        print(describe())
        return 0
    show = "--show" in argv
    argv = [a for a in argv if a != "--show"]
    try:
        cfg = build_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if show:
        print(to_yaml(cfg))
        return 0
    from experiments.rl.trainer import PREEMPTED_EXIT, GRPOTrainer, Preempted  # heavy imports only after the config is valid

    from experiments.rl.distributed import shutdown

    try:
        trainer = GRPOTrainer(cfg)
        metrics = trainer.train()
    except Preempted as e:
        print(f"preempted: {e}", flush=True)
        return PREEMPTED_EXIT
    finally:
        shutdown()  # under torchrun: leave the process group cleanly
    last_eval = [m for m in metrics if "eval/accuracy" in m]
    if last_eval:
        print(f"eval/accuracy: step {last_eval[0]['step']} {last_eval[0]['eval/accuracy']:.3f} -> "
              f"step {last_eval[-1]['step']} {last_eval[-1]['eval/accuracy']:.3f}")
    print(f"run directory: {cfg.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
