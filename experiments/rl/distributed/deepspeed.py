"""``deepspeed``: DeepSpeed ZeRO (``dist.deepspeed_config``, default ``zero2``) around the method's torch optimizer.

It wraps methods whose optimizer acts elementwise on the trainable tensors
(``Method.elementwise_optimizer``: dense AdamW). ``logra`` is refused: ZeRO flattens the parameters
into per-rank partitions and steps the optimizer on those flat buffers, where a weight's rows, its
m × r sketch and D A do not exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from experiments.rl.distributed.base import DataParallel, _StateDictModule, _tie, register_strategy

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@register_strategy("deepspeed")
class DeepSpeed(DataParallel):
    """DeepSpeed ZeRO (stage from ``dist.deepspeed_config``) around the method's torch optimizer."""

    requires_shared_engine = True
    step_control_ok = False
    resumable = False

    def check(self, cfg, method_cls) -> None:
        if not method_cls.elementwise_optimizer:
            raise ValueError(
                f"method {method_cls.name!r} cannot run under dist.strategy=deepspeed: ZeRO flattens the parameters "
                "into per-rank partitions and steps the optimizer on those flat buffers, so a per-matrix update "
                "(a weight's rows, its m x r sketch, D A; GaLore's projections) has no place in it. "
                "Use dist.strategy=ddp or fsdp2 (FSDP shards whole rows, which the sketch update keeps local).")
        super().check(cfg, method_cls)
        self.ds_config = load_deepspeed_config(cfg.dist.deepspeed_config)

    def attach(self, method):
        import deepspeed

        ds = dict(self.ds_config)
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  gradient_clipping=float(getattr(method.cfg, "max_grad_norm", 0.0)),
                  zero_allow_untested_optimizer=True)
        ds.pop("train_batch_size", None)
        engine, _, _, _ = deepspeed.initialize(model=method.model, optimizer=method.optimizer, config=ds,
                                               dist_init_required=False)
        return DeepSpeedMethod(method, engine, self.world_size)

    def checkpoint_state(self, model: nn.Module, method) -> tuple[nn.Module, dict]:
        # ZeRO keeps the weights as views of flat buffers: save standalone copies
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return _StateDictModule(_tie(model, state)), method.state_dict()


def load_deepspeed_config(name: str) -> dict:
    path = Path(name)
    if not path.is_file():
        path = CONFIG_DIR / "deepspeed" / (name if name.endswith(".json") else name + ".json")
    if not path.is_file():
        raise ValueError(f"DeepSpeed config {name!r} not found (looked in . and {CONFIG_DIR / 'deepspeed'})")
    return json.loads(path.read_text())


class DeepSpeedMethod:
    """The method, driven through a DeepSpeed engine: backward, gradient reduction (ZeRO reduces
    in backward, averaging over ranks — hence the loss × N), clipping and the step are the engine's."""

    def __init__(self, method, engine, world: int):
        self.inner, self.engine, self.world = method, engine, world
        self.model = method.model

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def reduce_gradients(self, group=None) -> None:
        return None  # ZeRO reduced the gradients inside backward

    def step(self) -> dict[str, float]:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"step/grad_norm": float(norm)} if norm is not None else {}

    def state_dict(self) -> dict:
        return {"note": "deepspeed: the partitioned optimizer state is not saved"}
