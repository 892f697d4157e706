"""Data-parallel GRPO across processes (docs/design.md §6): ``torchrun --nproc_per_node=N -m experiments.train ...``.

Under torchrun (``WORLD_SIZE`` > 1) the process group is initialized from the environment (nccl on
CUDA, gloo on CPU, ``dist.backend`` to force one). Every rank draws the same prompts for a step
(the data order is seeded) and takes its contiguous share, ``prompts_per_step / N`` whole groups,
so rewards and advantages stay per group. Each rank divides its loss by the completion-token count
of the *global* batch, so the sum over ranks of the accumulated gradients equals a one-process
run's gradient of the same global batch; every reduction here is a sum. Rank 0 alone writes the
run directory (config, metrics, samples, checkpoints; under fsdp2 every rank writes its checkpoint
shards); evaluation is split over the ranks.

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
  The chunked LM head (``train.logprob_chunk > 0``) runs inside the root module's forward
  (:func:`through_root`), where FSDP gathers the head and embedding and from which its backward
  reduce-scatters their gradients: no tokens × vocab logits exist on any rank. Step control
  (:meth:`FSDP2.predict_kl`) predicts on the gathered weights: each rank's low-rank hooks get a
  layer's whole D (an all-gather of the m × r factor rows) and A from its seed, the dense Δ of
  sharded tensors is gathered, each rank probes its share and the prediction is the token-weighted
  mean over ranks, as under ddp. A rollout engine with its own copy (``rollout.engine=hf|vllm``: one
  engine per rank) starts from a fresh skeleton and follows the trainer through
  :class:`GatheringSender` payloads: each sketched weight's L = −η·s·D with its rows gathered from
  their owners (A from the seed), the changed dense tensors gathered whole; the checksum is taken
  on the gathered tensors, so every rank's copy is verified against the same digest. Checkpoints are
  sharded (``torch.distributed.checkpoint``, :mod:`experiments.rl.sharded_checkpoint`): each rank
  writes its model shards and its rows of the method state; a run resumes on the same world size
  (tests/test_distributed.py: weights within 1e-6, the same step scales and losses), or in one process.
* ``deepspeed`` — DeepSpeed ZeRO (``dist.deepspeed_config``, default ``zero2``) wraps methods whose
  optimizer acts elementwise on the trainable tensors (``Method.elementwise_optimizer``: dense
  AdamW). ``logra`` is refused: ZeRO flattens the parameters into per-rank partitions and steps the
  optimizer on those flat buffers, where a weight's rows, its m × r sketch and D A do not exist.

``dist.seeded_groups=true`` samples each prompt group from its own seed (seed, step, global group
index), one ``generate`` call per group: rollouts then do not depend on the number of ranks (the
equality tests of 1 and 2 ranks rely on it), at the cost of smaller generate batches.
"""

from __future__ import annotations

import dataclasses
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
from torch.distributed.tensor import DTensor

from experiments.rl.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from experiments.rl.sharded_checkpoint import is_sharded, load_sharded, save_sharded
from logra_core.distributed import gather_rows
from logra_core.sync import SyncSender

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


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class GatheringSender(SyncSender):
    """Sync payloads of whole tensors from a row-sharded (FSDP2) trainer, identical on every rank.

    A step's low-rank op on a sharded weight carries this rank's rows of L; the payload gets every
    rank's rows (:func:`logra_core.distributed.gather_rows`, m × r), with A still rebuilt from its
    seed by the receiver. Changed dense tensors, fp32 masters (row shards of the weight they shadow)
    and, for the checksum, the touched weights are gathered whole. Every rank must call
    :meth:`delta` / :meth:`full` together (collectives in the same order: the names sorted).
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.sharded = dict(self.tensors.params)

    def _gathered(self, names) -> dict[str, torch.Tensor]:
        return {n: _whole(self.sharded[n].detach()) for n in sorted(names)}

    def _masters(self, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: gather_rows(masters[n], self.sharded[n]) for n in sorted(masters)}

    def delta(self, lowrank, changed, masters):
        lowrank = {n: dataclasses.replace(lowrank[n], left=gather_rows(lowrank[n].left, self.sharded[n]))
                   for n in sorted(lowrank)}
        masters = self._masters(masters)
        self.tensors.params = self._gathered(set(lowrank) | set(changed))
        try:
            return super().delta(lowrank, changed, masters)
        finally:
            self.tensors.params = self.sharded

    def full(self, masters=None):
        masters = self._masters(masters) if masters is not None else None
        self.tensors.params = self._gathered(self.sharded)
        try:
            return super().full(masters)
        finally:
            self.tensors.params = self.sharded


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


    def sync_sender(self, model: nn.Module) -> SyncSender:
        return GatheringSender(model) if self.distributed else SyncSender(model)

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

    def predict_kl(self, model: nn.Module, inputs: dict | None, update, chunk: int, population: int | None = None,
                   temperature: float = 1.0, predictor: str = "exact", at: float = 1.0, h_old=None, weights=None,
                   share_context: bool = True):
        """The KL predictor on the gathered weights (a collective: every rank calls it, with or
        without a probe). A low-rank ΔW = D A of a row-sharded weight enters with its whole D, the
        ranks' rows all-gathered (m × r: small), and the same A on every rank (rebuilt from the
        seed); a dense Δ that is a row-sharded DTensor is gathered whole."""
        from logra_core.kl_predictor import predict_kl, predict_kl_sampled

        if not self.distributed:
            return super().predict_kl(model, inputs, update, chunk, population, temperature, predictor, at, h_old, weights,
                                      share_context)
        lowrank = {}
        for name, (D, A) in update.lowrank.items():
            weight = model.get_submodule(name).weight
            lowrank[name] = (gather_rows(D, weight), A)
        dense = {name: (d.full_tensor() if isinstance(d, DTensor) else d) for name, d in update.dense.items()}
        row_weights, weight_mean = weights or (None, 1.0)
        with self.full_weights(model):  # gathering is a collective: ranks without a probe take part
            if population is not None:
                return predict_kl_sampled(model, **inputs, lowrank=lowrank, dense=dense, chunk=chunk,
                                          population=population, temperature=temperature, predictor=predictor,
                                          at=at, h_old=h_old, row_weights=row_weights,
                                          weight_mean=weight_mean, share_context=share_context) if inputs else (0.0, 0.0)
            return predict_kl(model, **inputs, lowrank=lowrank, dense=dense, chunk=chunk,
                              temperature=temperature) if inputs else 0.0

    def even_micro_batches(self, micro: list[torch.Tensor]) -> list[torch.Tensor]:
        most = self._max(len(micro))
        filler = micro[0][:1] if micro else torch.zeros(1, dtype=torch.long)
        return micro + [filler] * (most - len(micro))

    def _max(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def save_checkpoint(self, run_dir: Path, step: int, model: nn.Module, method, trainer_state: dict, keep: int) -> None:
        """Sharded (experiments/rl/sharded_checkpoint.py): every rank writes its own shards of the
        model and of the method state (DCP), nothing is gathered."""
        if not self.distributed:
            return super().save_checkpoint(run_dir, step, model, method, trainer_state, keep)
        save_sharded(run_dir, step, model, method, trainer_state, keep=keep)

    def load_checkpoint(self, path: Path, model: nn.Module, method) -> dict:
        if self.distributed and not is_sharded(path):
            raise ValueError(f"{path} holds whole weights written by one process; resuming it sharded over "
                             f"{self.world_size} ranks is not supported: resume it with one process, or start anew")
        return super().load_checkpoint(path, model, method)

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
