"""Data-parallel GRPO across processes (DESIGN §6): ``torchrun --nproc_per_node=N -m experiments.train ...``.

Under torchrun (``WORLD_SIZE`` > 1) the process group is initialized from the environment (nccl on
CUDA, gloo on CPU, ``dist.backend`` to force one). Every rank draws the same prompts for a step
(the data order is seeded) and takes its contiguous share, ``prompts_per_step / N`` whole groups,
so rewards and advantages stay per group. Each rank divides its loss by the completion-token count
of the *global* batch, so the sum over ranks of the accumulated gradients equals a one-process
run's gradient of the same global batch; every reduction here is a sum. Rank 0 alone writes the
run directory (config, metrics, samples, checkpoints); evaluation is split over the ranks.

Strategies (``dist.strategy``, registry :data:`STRATEGIES`):

* ``ddp`` — weights replicated; once per step, after the last micro-batch, ``Method.reduce_gradients``
  all-reduces what the method needs: every trainable ``.grad`` by default, the m × r sketches plus
  the small dense gradients for ``logra``. (The semantics of torch DDP with ``no_sync`` on all but
  the last micro-batch; torch's ``DistributedDataParallel`` wrapper itself is not used, because the
  loop calls the model's submodules — the decoder, the head — which the wrapper's forward cannot see.)
* ``fsdp2`` — ``fully_shard`` on every decoder layer and the root (dim-0 row shards). FSDP
  reduce-scatters the dense gradients in backward; ``logra``'s sketches are all-reduced once per
  step and each rank's RowAdam update D_k A touches only its own rows (A rebuilt from its seed).
  Rollouts and evaluation run on the whole weights (gathered once per phase, then resharded).
* ``deepspeed`` — DeepSpeed ZeRO (``dist.deepspeed_config``, default ``zero2``) wraps methods whose
  optimizer acts elementwise on the trainable tensors (``Method.elementwise_optimizer``: dense
  AdamW). ``logra`` is refused: ZeRO flattens the parameters into per-rank partitions and steps the
  optimizer on those flat buffers, where a weight's rows, its m × r sketch and D A do not exist.

``dist.seeded_groups=true`` samples each prompt group from its own seed (seed, step, global group
index), one ``generate`` call per group: rollouts then do not depend on the number of ranks (the
equality tests of 1 and 2 ranks rely on it), at the cost of smaller generate batches.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from experiments.rl.checkpoint import list_checkpoints

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class DistConfig:
    strategy: str = "ddp"  # under torchrun with WORLD_SIZE > 1: ddp (replicated, reduce once per step) | fsdp2 (row-sharded weights) | deepspeed (ZeRO)
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    deepspeed_config: str = "zero2"  # dist.strategy=deepspeed: a JSON in experiments/configs/deepspeed/ or a path
    seeded_groups: bool = False  # sample each prompt group from its own seed: rollouts independent of the rank count (slower: one generate per group)


STRATEGIES: dict[str, type["DataParallel"]] = {}


def register_strategy(name: str):
    def wrap(cls):
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return wrap


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_strategy(cfg, method_cls) -> "DataParallel":
    """The strategy of run config ``cfg`` (a :class:`DataParallel` of one process without torchrun);
    initializes the default process group from torchrun's environment and checks what the strategy
    cannot run, before any model loads."""
    c = cfg.dist
    if c.strategy not in STRATEGIES:
        raise ValueError(f"unknown dist.strategy {c.strategy!r}; registered: {sorted(STRATEGIES)}")
    if world_size() <= 1 and not dist.is_initialized():
        return DataParallel(cfg)
    if not dist.is_initialized():
        cuda = cfg.device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = c.backend if c.backend != "auto" else ("nccl" if cuda else "gloo")
        dist.init_process_group(backend)
    strategy = STRATEGIES[c.strategy](cfg)
    strategy.check(cfg, method_cls)
    return strategy


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class _NullWriter:
    """Stands in for the metrics writer on ranks other than 0."""

    def write(self, record: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


@register_strategy("ddp")
class DataParallel:
    """Replicated weights; the method's gradients (or sketches) summed once per step. With one
    process every collective is the identity, so the trainer runs the same code either way."""

    name = "ddp"
    requires_shared_engine = False  # True: rollout engines with their own policy copy are refused
    step_control_ok = True
    resumable = True  # False: its checkpoints cannot restore the sharded optimizer state

    def __init__(self, cfg):
        self.cfg = cfg
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group = None  # the default process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check(self, cfg, method_cls) -> None:
        """Refuse, with the reason, what this strategy cannot run (called before the model loads)."""
        n = self.world_size
        if cfg.train.prompts_per_step % n:
            raise ValueError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
                             f"{n} ranks: each rank trains on whole prompt groups")
        if not method_cls.supports_data_parallel:
            raise ValueError(f"method {method_cls.name!r} cannot run data-parallel: it applies its update inside "
                             "backward, before the ranks' gradients could be summed")
        if self.requires_shared_engine and cfg.rollout.engine != "shared":
            raise ValueError(f"dist.strategy={self.name} samples from the sharded training module itself: "
                             f"use rollout.engine=shared (got {cfg.rollout.engine!r})")
        enabled = cfg.step_control.enabled
        if not self.step_control_ok and (method_cls.step_control_default if enabled is None else enabled):
            raise ValueError(f"predicted-KL step control is not supported under dist.strategy={self.name} "
                             "(its forward-mode pass runs through unsharded modules): set step_control.enabled=false")
        if cfg.resume and not self.resumable and list_checkpoints(Path(cfg.out_dir)):  # a fresh dir just starts
            raise ValueError(f"resuming {cfg.out_dir} is not supported under dist.strategy={self.name}: its checkpoints "
                             "hold the gathered weights but not the sharded optimizer state")

    # ---- model and method ---------------------------------------------------------------------
    def wrap(self, model: nn.Module, method) -> nn.Module:
        """Called between ``method.prepare`` and ``method.build_optimizer`` (e.g. to shard)."""
        return model

    def attach(self, method):
        """Called after ``build_optimizer``; returns the method the trainer drives."""
        return method

    def metrics_writer(self, make: Callable):
        return make() if self.is_main else _NullWriter()

    # ---- collectives --------------------------------------------------------------------------
    def all_sum(self, *values: float) -> list[float]:
        """Σ over ranks of each number (float64)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def weighted_mean(self, value: float, weight: float) -> float:
        """Σ value·weight / Σ weight over ranks (a mean over every rank's tokens)."""
        total, w = self.all_sum(value * weight if weight else 0.0, weight)
        return total / w if w else 0.0

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors (same shape on every rank) concatenated along dim 0, in rank order."""
        if not self.distributed:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def reduce_gradients(self, method) -> dict[str, float]:
        """Once per update: the method's reduction; logs the bytes it all-reduced."""
        if not self.distributed:
            return {}
        t0 = time.perf_counter()
        nbytes = method.reduce_gradients(self.group)
        if nbytes is None:  # the engine reduced inside backward
            return {}
        return {"dist/allreduce_bytes": float(nbytes), "time/allreduce_s": time.perf_counter() - t0}

    # ---- data ---------------------------------------------------------------------------------
    def shard(self, items: list) -> list:
        """This rank's contiguous share of a list whose length the rank count divides."""
        k = len(items) // self.world_size
        return items[self.rank * k : (self.rank + 1) * k]

    def shard_padded(self, items: list) -> tuple[list, int]:
        """This rank's share of any list, padded with repeats of its first item to ⌈len / N⌉ so every
        rank makes the same number of calls; returns (items, how many are real)."""
        if not items:
            return [], 0
        k = -(-len(items) // self.world_size)
        mine = items[self.rank * k : (self.rank + 1) * k]
        return mine + [items[0]] * (k - len(mine)), len(mine)

    def group_seed(self, seed: int, step: int, index: int) -> int:
        """The sampling seed of prompt group ``index`` (global) of ``step`` (dist.seeded_groups)."""
        return (seed * 1_000_003 + step * 10_007 + index) % (2**63)

    def generate(self, engine, prompts: list[str], n: int, step: int):
        """The rollouts of this rank's prompts; with ``dist.seeded_groups`` one seeded call per group."""
        if not self.cfg.dist.seeded_groups:
            return engine.generate(prompts, n=n)
        from experiments.rl.rollout import Rollouts

        first = self.rank * len(prompts)
        parts = []
        for j, prompt in enumerate(prompts):
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
                torch.manual_seed(self.group_seed(self.cfg.seed, step, first + j))
                parts.append(engine.generate([prompt], n=n))
        return Rollouts.cat(parts, engine.tokenizer.pad_token_id)

    def full_weights(self, model: nn.Module):
        """Context in which ``model`` holds its whole weights (rollouts, evaluation)."""
        return nullcontext()

    def micro_batches(self, rows: torch.Tensor, size: int) -> tuple[list[torch.Tensor], int]:
        """``rows`` (this rank's trained row indices) cut into micro-batches of ``size``, padded by
        :meth:`even_micro_batches`; returns (micro-batches, how many are real). The trainer trains the
        padding ones with weight 0."""
        micro = [rows[i : i + size] for i in range(0, len(rows), size)]
        return self.even_micro_batches(micro), len(micro)

    def even_micro_batches(self, micro: list[torch.Tensor]) -> list[torch.Tensor]:
        """Micro-batches padded (with repeats of a real row, trained with weight 0) to the largest
        count on any rank, where every forward/backward is a collective (FSDP); else unchanged."""
        return micro

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module, method) -> tuple[nn.Module, dict]:
        """(a module whose state_dict is the whole model, the method's state) for rank 0 to save."""
        return model, method.state_dict()


def _tie(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (standalone copies) with tied weights made one tensor again, as safetensors expects."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in state:
            state[name] = state[first.setdefault(id(p), name)]
    return state


class _StateDictModule(nn.Module):
    """A module that only answers ``state_dict()`` (what safetensors' ``save_model`` asks)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):
        return dict(self._state)


@register_strategy("fsdp2")
class FSDP2(DataParallel):
    """``torch.distributed.fsdp.fully_shard`` on each decoder layer and the root (rows sharded)."""

    requires_shared_engine = True
    step_control_ok = False
    resumable = False

    def check(self, cfg, method_cls) -> None:
        super().check(cfg, method_cls)
        if cfg.train.logprob_chunk > 0:
            raise ValueError("dist.strategy=fsdp2 needs train.logprob_chunk=0: the chunked LM-head path calls the decoder "
                             "and the head's weight directly, outside the root module's forward, where FSDP gathers them")

    def wrap(self, model: nn.Module, method) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        if not self.distributed:
            return model
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError("dist.strategy=fsdp2 needs an HF decoder with model.model.layers")
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        # Sums, not means, across ranks (the loss is already normalized by the global token count);
        # gloo has no PREMUL_SUM, so a plain SUM.
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
        for layer in layers:
            layer.set_gradient_divide_factor(1.0)
            layer.set_force_sum_reduction_for_comms(True)
        self.model = model
        return model

    @contextmanager
    def full_weights(self, model: nn.Module):
        """Gather every layer's weights once (a collective), keep them through generation's many
        forwards (whose count differs between ranks), reshard after."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    def even_micro_batches(self, micro: list[torch.Tensor]) -> list[torch.Tensor]:
        most = self._max(len(micro))
        filler = micro[0][:1] if micro else torch.zeros(1, dtype=torch.long)
        return micro + [filler] * (most - len(micro))

    def _max(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def checkpoint_state(self, model: nn.Module, method) -> tuple[nn.Module, dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _StateDictModule(_tie(model, full)), {"note": "fsdp2: the sharded optimizer state is not saved"}


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
