"""Entry for the multi-process tests: ``torchrun ... tests/dist_entry.py '<json list of override lists>'``.

Runs each GRPO run in turn in the same process group (one interpreter start per rank for all of
them), with the toy task registered. Not a test module itself.

A run whose rollout engine holds its own copy records, after every sync, whether that copy is
``torch.equal`` to the trainer's weights gathered whole: ``<out_dir>/engine_check_rank<r>.jsonl``.
Every run records how often the strategy's ``full_weights`` (every layer gathered at once) was
entered: ``<out_dir>/full_weights_rank<r>.json``.

A run may be given as ``{"overrides": [...], "corrupt": [step, rank]}``: before the step sync after
step ``step``, one bit of rank ``rank``'s shard of the first q_proj weight is flipped (a corrupted shard
of a weight that the step moves by a low-rank op, which the sync's digest must catch).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.config import build_config  # noqa: E402
from experiments.rl.distributed import FSDP2, shutdown  # noqa: E402
from experiments.rl.trainer import PREEMPTED_EXIT, GRPOTrainer, Preempted  # noqa: E402
from tests.toy_task import Toy  # noqa: E402,F401  (registers the toy task)

CORRUPT: dict = {}  # this run's [step, rank] to corrupt, if any
FULL_WEIGHTS = [0]


def _corrupt_shard(trainer) -> None:
    import torch
    from logra_core.distributed import local

    name, p = next((n, p) for n, p in trainer.model.named_parameters() if n.endswith("q_proj.weight"))
    with torch.no_grad():
        local(p).view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    print(f"[dist_entry] rank {trainer.dist.rank}: flipped a bit of {name} before the sync after step {trainer.step + 1}",
          flush=True)


def _checked_sync(sync):
    def wrapped(self, full: bool = False):
        if not full and CORRUPT and CORRUPT["at"] == [self.step + 1, self.dist.rank]:
            _corrupt_shard(self)
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


def _counting(full_weights):
    def wrapped(self, model):
        FULL_WEIGHTS[0] += 1
        return full_weights(self, model)
    return wrapped


FSDP2.full_weights = _counting(FSDP2.full_weights)


def _run(spec) -> None:
    overrides = spec["overrides"] if isinstance(spec, dict) else spec
    CORRUPT.clear()
    if isinstance(spec, dict) and "corrupt" in spec:
        CORRUPT["at"] = list(spec["corrupt"])
    FULL_WEIGHTS[0] = 0
    trainer = GRPOTrainer(build_config(overrides))
    try:
        trainer.train()
    finally:
        out = Path(trainer.cfg.out_dir) / f"full_weights_rank{trainer.dist.rank}.json"
        out.write_text(json.dumps({"calls": FULL_WEIGHTS[0]}))


if __name__ == "__main__":
    try:
        for spec in json.loads(sys.argv[1]):
            _run(spec)
    except Preempted as e:  # as python -m experiments.train does
        print(f"[dist_entry] {e}", flush=True)
        shutdown()
        sys.exit(PREEMPTED_EXIT)
    finally:
        shutdown()
