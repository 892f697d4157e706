"""Entry for the multi-process tests: ``torchrun ... tests/dist_entry.py '<json list of override lists>'``.

Runs each GRPO run in turn in the same process group (one interpreter start per rank for all of
them), with the toy task registered. Not a test module itself.

A run whose rollout engine holds its own copy records, after every sync, whether that copy is
``torch.equal`` to the trainer's weights gathered whole: ``<out_dir>/engine_check_rank<r>.jsonl``.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.config import build_config  # noqa: E402
from experiments.rl.distributed import shutdown  # noqa: E402
from experiments.rl.trainer import PREEMPTED_EXIT, GRPOTrainer, Preempted  # noqa: E402
from tests.toy_task import Toy  # noqa: E402,F401  (registers the toy task)

def _checked_sync(sync):
    def wrapped(self, full: bool = False):
        out = sync(self, full)
        if self.weight_sync.sender is not None:
            import torch
            from torch.distributed.tensor import DTensor

            copy = self.engine.state_dict()
            equal = True
            for name, p in self.model.named_parameters():  # full_tensor is a collective: every rank, same order
                whole = p.full_tensor() if isinstance(p, DTensor) else p
                equal &= torch.equal(copy[name], whole.detach())
            with open(Path(self.cfg.out_dir) / f"engine_check_rank{self.dist.rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": self.step, "full": full, "equal": bool(equal), **out}) + "\n")
        return out

    return wrapped


GRPOTrainer.sync = _checked_sync(GRPOTrainer.sync)

if __name__ == "__main__":
    try:
        for overrides in json.loads(sys.argv[1]):
            GRPOTrainer(build_config(overrides)).train()
    except Preempted as e:  # as python -m experiments.train does
        print(f"[dist_entry] {e}", flush=True)
        shutdown()
        sys.exit(PREEMPTED_EXIT)
    finally:
        shutdown()
