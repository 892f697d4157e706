"""Data-parallel GRPO across processes (docs/distributed.md): ``torchrun --nproc_per_node=N -m experiments.train ...``.

Under torchrun (``WORLD_SIZE`` > 1) the process group is initialized from the environment (nccl on
CUDA, gloo on CPU, ``dist.backend`` to force one). Every rank draws the same prompts for a step
(the data order is seeded) and takes its contiguous share, ``prompts_per_step / N`` whole groups,
so rewards and advantages stay per group. Each rank divides its loss by the completion-token count
of the *global* batch, so the sum over ranks of the accumulated gradients equals a one-process
run's gradient of the same global batch; every reduction here is a sum. Rank 0 alone writes the
run directory (config, metrics, samples, checkpoints; under fsdp2 every rank writes its checkpoint
shards); evaluation is split over the ranks.

This module holds the strategy interface and the registry (``dist.strategy``, :data:`STRATEGIES`),
and ``ddp``, the interface's plain implementation:

* ``ddp`` — weights replicated; once per step, after the last micro-batch, ``Method.reduce_gradients``
  all-reduces what the method needs: every trainable ``.grad`` by default, the m × r sketches plus
  the small dense gradients for ``logra``. (The semantics of torch DDP with ``no_sync`` on all but
  the last micro-batch; torch's ``DistributedDataParallel`` wrapper itself is not used, because the
  loop calls the model's submodules — the decoder, the head — which the wrapper's forward cannot see.)

The others live in their own modules: ``fsdp2`` (:mod:`experiments.rl.distributed.fsdp2`, row-sharded
weights) and ``deepspeed`` (:mod:`experiments.rl.distributed.deepspeed`, ZeRO).

``dist.seeded_groups=true`` samples each prompt group from its own seed (seed, step, global group
index), one ``generate`` call per group: rollouts then do not depend on the number of ranks (the
equality tests of 1 and 2 ranks rely on it), at the cost of smaller generate batches.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from experiments.rl.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from experiments.rl.sharded_checkpoint import is_sharded, load_sharded
from logra_core.sync import SyncSender



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
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if world_size() <= 1 and not dist.is_initialized() and not (under_torchrun and c.strategy != "ddp"):
        return DataParallel(cfg)  # one plain process (torchrun --nproc_per_node=1 still shards under fsdp2)
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


def through_root(model: nn.Module, fn: Callable, **kwargs):
    """``fn(**kwargs)`` run as the forward of ``model`` when it is an FSDP2 module, else called directly.

    FSDP2 gathers the root's own parameters (embedding, final norm, LM head) in the root's
    forward pre-hook and reduce-scatters their gradients after the backward through that forward's
    output. A computation that calls the decoder and the head weight itself (the chunked LM head)
    therefore has to *be* the root's forward: the instance's ``forward`` is swapped for ``fn`` for
    the call, so FSDP's hooks (registered on the module, not on its forward) run around it.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return fn(**kwargs)
    had = "forward" in vars(model)
    previous = vars(model).get("forward")
    model.forward = fn
    try:
        return model(**kwargs)
    finally:
        if had:
            model.forward = previous
        else:
            del model.forward


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
    def build_model(self, skeleton: nn.Module, source, method, device, model_cfg) -> nn.Module:
        """The policy from its skeleton (experiments/rl/materialize.py): here every weight is read whole
        onto ``device``, then ``method.setup`` prepares, wraps and builds its optimizer."""
        from experiments.rl.materialize import materialize
        from experiments.rl.models import finish

        model = finish(materialize(skeleton, source, device), model_cfg)
        return method.setup(model, wrap=self.wrap)

    def build_reference(self, skeleton: nn.Module, source, device, model_cfg) -> nn.Module:
        """The frozen reference model (``train.kl_coef > 0``), placed as the policy is."""
        from experiments.rl.materialize import materialize
        from experiments.rl.models import finish

        return finish(materialize(skeleton, source, device), model_cfg).eval().requires_grad_(False)

    def release(self, model: nn.Module) -> None:
        """After a forward that no backward follows: free what the forward left gathered (FSDP's root)."""

    def wrap(self, model: nn.Module, method) -> nn.Module:
        """Called between ``method.prepare`` and ``method.build_optimizer`` (e.g. to shard)."""
        return model

    def attach(self, method):
        """Called after ``build_optimizer``; returns the method the trainer drives."""
        return method

    def metrics_writer(self, make: Callable):
        return make() if self.is_main else _NullWriter()

    # ---- collectives --------------------------------------------------------------------------
    @property
    def comm_device(self) -> torch.device:
        """Where the loop's own collectives put their tensors: the current CUDA device under nccl
        (which moves no CPU tensors), else the CPU (gloo)."""
        if self.distributed and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_sum(self, *values: float) -> list[float]:
        """Σ over ranks of each number (float64)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.comm_device)
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
        wire = t.to(self.comm_device).contiguous()
        parts = [torch.empty_like(wire) for _ in range(self.world_size)]
        dist.all_gather(parts, wire, group=self.group)
        return torch.cat(parts).to(t.device)

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

    def sync_sender(self, model: nn.Module) -> SyncSender:
        """What builds the weight-sync payloads of an engine with its own copy (:mod:`logra_core.sync`)."""
        return SyncSender(model)

    def predict_kl(self, model: nn.Module, inputs: dict | None, update, chunk: int, population: int | None = None,
                   temperature: float = 1.0, predictor: str = "exact", at: float = 1.0, h_old=None, weights=None,
                   share_context: bool = True):
        """This rank's predicted KL of ``update`` on its probe ``inputs`` (0.0 without a probe); a
        collective wherever the weights are sharded, so every rank calls it. With ``population`` (the
        sequences the probe was drawn from): (prediction, its standard error as that batch's mean,
        ``logra_core.kl_predictor.predict_kl_sampled``; ``predictor``, ``at``: its exact or secant path;
        ``weights``: (the probe rows' weights, the batch's token mean of them) for its ratio estimator;
        ``share_context``: the secant's forwards compute the probe's shared context once)."""
        from logra_core.kl_predictor import predict_kl, predict_kl_sampled

        if not inputs:
            return 0.0 if population is None else (0.0, 0.0)
        if population is not None:
            row_weights, weight_mean = weights or (None, 1.0)
            return predict_kl_sampled(model, **inputs, lowrank=update.lowrank, dense=update.dense, chunk=chunk,
                                      population=population, temperature=temperature, predictor=predictor, at=at,
                                      h_old=h_old, row_weights=row_weights, weight_mean=weight_mean,
                                      share_context=share_context)
        return predict_kl(model, **inputs, lowrank=update.lowrank, dense=update.dense, chunk=chunk, temperature=temperature)

    def even_probes(self, batches: list[dict], model: nn.Module) -> list[dict]:
        """Probe batches (model inputs with ``positions``) padded with batches that read nothing to the
        largest count on any rank, where a forward of the weights is a collective (FSDP); else unchanged."""
        return batches

    def even_micro_batches(self, micro: list[torch.Tensor]) -> list[torch.Tensor]:
        """Micro-batches padded (with repeats of a real row, trained with weight 0) to the largest
        count on any rank, where every forward/backward is a collective (FSDP); else unchanged."""
        return micro

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module, method) -> tuple[nn.Module, dict]:
        """(a module whose state_dict is the whole model, the method's state) for rank 0 to save."""
        return model, method.state_dict()

    def save_checkpoint(self, run_dir: Path, step: int, model: nn.Module, method, trainer_state: dict, keep: int) -> None:
        """Every rank calls it; rank 0 writes the whole model and the method state (experiments/rl/checkpoint.py)."""
        module, method_state = self.checkpoint_state(model, method)  # gathers shards: every rank
        if self.is_main:
            save_checkpoint(run_dir, step, module, method_state, trainer_state, keep=keep)
        self.barrier()

    def load_checkpoint(self, path: Path, model: nn.Module, method) -> dict:
        """Load a checkpoint into ``model`` and ``method`` (a sharded one too, laid out anew: a run
        sharded over N ranks resumes in one process); returns the trainer state (step, data position)."""
        if is_sharded(path):
            return load_sharded(path, model, method)
        method_state, state = load_checkpoint(path, model)  # CheckpointCorrupt on a checksum mismatch
        method.load_state_dict(method_state)
        return state


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
