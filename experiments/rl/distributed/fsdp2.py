"""``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root (dim-0 row shards).

No rank, and no host process, holds a whole copy of the model (docs/distributed.md, "fsdp2"):

* **load** (:meth:`FSDP2.build_model`, :meth:`FSDP2.build_reference`): the skeleton is sharded on the meta
  device, then each rank allocates and reads only its own rows (experiments/rl/materialize.py);
* **step**: FSDP reduce-scatters the dense gradients in backward; ``logra``'s sketches are reduced once
  per step and each rank's RowAdam update D_k A touches only its own rows (A rebuilt from its seed).
  The chunked LM head (``train.logprob_chunk > 0``) runs inside the root module's forward
  (:func:`~experiments.rl.distributed.base.through_root`), where FSDP gathers the head and embedding
  and from which its backward reduce-scatters their gradients: no tokens × vocab logits exist;
* **KL prediction** (:meth:`FSDP2.predict_kl`): the secant predictor rides on FSDP2's own per-layer
  forward (logra_core/layerwise.py: one layer whole at a time, the update's factors as this rank's rows,
  the head's sums vocabulary-parallel); every rank runs the same forwards, with or without a probe;
* **sync** (:class:`GatheringSender`): an engine copy per rank (``rollout.engine=hf|vllm``) starts from an
  unfilled skeleton and follows the trainer: each sketched weight's L = −η·s·D with its rows gathered (A
  from the seed), changed dense tensors gathered one at a time as the receiver reads them; the checksum
  is the ranks' on-device digests of their own rows, summed (logra_core/digest.py);
* **checkpoints** are sharded (``torch.distributed.checkpoint``, :mod:`experiments.rl.sharded_checkpoint`):
  each rank writes its model shards and its rows of the method state; a run resumes on the same world
  size or in one process.

Rollouts and evaluation on the trainer's own module (``rollout.engine=shared``) still gather the whole
weights (:meth:`FSDP2.full_weights`); an engine with its own copy is what avoids that.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from experiments.rl.distributed.base import DataParallel, _StateDictModule, _tie, register_strategy
from experiments.rl.sharded_checkpoint import is_sharded, save_sharded
from logra_core.distributed import RowShard, gather_rows, local_rows
from logra_core.sync import LowRankOp, SyncSender, _Tensors, op_header


class _ShardedTensors(_Tensors):
    """The sender's tensors of a row-sharded model: each rank digests the rows it holds (a tensor
    every rank holds whole counts on rank 0 only) and :meth:`reduce` sums the ranks' digests."""

    def __init__(self, model: nn.Module, group=None):
        super().__init__(model)
        self.group = group
        self.rank = dist.get_rank(group)

    def entries(self, names):
        out = super().entries(names)
        if self.rank == 0:
            return out
        return [(key, t if local_rows(self.params[key.split("@", 1)[0]]) is not None else t[:0], offset, meta)
                for key, t, offset, meta in out]

    def reduce(self, sums: torch.Tensor) -> torch.Tensor:
        wire = sums.to(_comm_device(self.group))
        dist.all_reduce(wire, group=self.group)  # int64 sums of values below 2³²: exact for any rank count
        return wire


def _comm_device(group=None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


class GatheringSender(SyncSender):
    """Sync payloads of whole tensors from a row-sharded (FSDP2) trainer, identical on every rank.

    A step's low-rank op on a sharded weight carries this rank's rows of L; the payload gets every
    rank's rows (:func:`logra_core.distributed.gather_rows`, m × r), with A still rebuilt from its
    seed by the receiver. Each op's L, and the values of changed dense tensors (and, in a full
    payload, of every tensor and master), are gathered whole one at a time, when the receiver reads
    them (:class:`logra_core.sync.StreamedOps`, :class:`logra_core.sync.Streamed`). The checksum is the
    sum of the ranks' digests of their own rows (:mod:`logra_core.digest`): nothing is gathered to
    verify. Every rank must call
    :meth:`delta` / :meth:`full` and read the payload together (collectives in the same order: the
    names sorted).
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.tensors = _ShardedTensors(model)

    def whole(self, name: str) -> torch.Tensor:
        p = self.tensors.params[name].detach()
        return p.full_tensor() if isinstance(p, DTensor) else p.clone()

    def whole_master(self, name: str) -> torch.Tensor:
        return gather_rows(self.tensors.masters[name], self.tensors.params[name]).clone()

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def whole_op(self, name: str, op: LowRankOp) -> LowRankOp:
        return dataclasses.replace(op, left=gather_rows(op.left, self.tensors.params[name]))

    def header(self, name: str, op: LowRankOp) -> LowRankOp:
        return op_header(op, rows=self.tensors.params[name].shape[0])


def _row_shard(t: torch.Tensor, like: torch.Tensor):
    """``t`` (this rank's rows, or a DTensor) as a RowShard laid out like ``like``; a tensor held whole as is."""
    if isinstance(t, DTensor):
        return RowShard(t.to_local(), t)
    return RowShard(t, like) if local_rows(like) is not None else t


def _dummy_probe(model: nn.Module) -> dict[str, torch.Tensor]:
    """A one-token probe that reads no position: what a rank without probe rows runs, so that it takes
    part in every collective of the others' forwards."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.zeros_like(ids),
                positions=torch.zeros_like(ids, dtype=torch.bool))


@register_strategy("fsdp2")
class FSDP2(DataParallel):
    """``torch.distributed.fsdp.fully_shard`` on each decoder layer and the root (rows sharded)."""


    def sync_sender(self, model: nn.Module) -> SyncSender:
        return GatheringSender(model) if self.distributed else SyncSender(model)

    def build_model(self, skeleton: nn.Module, source, method, device, model_cfg) -> nn.Module:
        """Sharded materialization: ``method.prepare`` on the skeleton (meta device), ``fully_shard``, then
        each rank allocates and reads only its own rows (experiments/rl/materialize.py) — no rank and no
        host process ever holds the whole model."""
        if not self.distributed:
            return super().build_model(skeleton, source, method, device, model_cfg)

        def shard_and_load(model: nn.Module, method) -> nn.Module:
            return self._placed(self.wrap(model, method), source, device, model_cfg)

        return method.setup(skeleton, wrap=shard_and_load)

    def build_reference(self, skeleton: nn.Module, source, device, model_cfg) -> nn.Module:
        if not self.distributed:
            return super().build_reference(skeleton, source, device, model_cfg)
        model = self._placed(self._shard(skeleton), source, device, model_cfg)
        return model.eval().requires_grad_(False)

    def release(self, model: nn.Module) -> None:
        if self.distributed:
            model.reshard()  # FSDP2 keeps the root gathered after a forward, expecting a backward

    @staticmethod
    def _placed(model: nn.Module, source, device, model_cfg) -> nn.Module:
        from experiments.rl.materialize import materialize
        from experiments.rl.models import finish

        return finish(materialize(model, source, device), model_cfg)

    @staticmethod
    def _shard(model: nn.Module) -> nn.Module:
        """``fully_shard`` on every decoder layer and the root; gradients summed, not averaged."""
        from torch.distributed.fsdp import fully_shard

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
        return model

    def wrap(self, model: nn.Module, method) -> nn.Module:
        if not self.distributed:
            return model
        self.model = self._shard(model)
        return self.model

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

    def check(self, cfg, method_cls) -> None:
        super().check(cfg, method_cls)
        if self.distributed and method_cls.adds_parameters:
            raise ValueError(
                f"method {method_cls.name!r} cannot run under dist.strategy=fsdp2 with several ranks: each rank builds "
                "its shards of the model from the checkpoint's rows (experiments/rl/materialize.py), and the parameters "
                "this method adds (adapters) have no sharded initializer. Use dist.strategy=ddp (its adapters are small).")
        enabled = cfg.step_control.enabled
        control = method_cls.step_control_default if enabled is None else enabled
        if self.distributed and control and cfg.step_control.predictor != "secant":
            raise ValueError(
                f"step_control.predictor={cfg.step_control.predictor!r} is not supported under dist.strategy=fsdp2 with "
                "several ranks: its forward-mode tangents enter every dense update as a dual parameter of the whole "
                "decoder, which FSDP2 replaces with its own unsharded parameters layer by layer. Use the default "
                "step_control.predictor=secant (it rides on FSDP2's per-layer forward).")

    def predict_kl(self, model: nn.Module, inputs: dict | None, update, chunk: int, population: int | None = None,
                   temperature: float = 1.0, predictor: str = "secant", at: float = 1.0, h_old=None, weights=None,
                   share_context: bool = True):
        """The secant KL predictor through FSDP2's own per-layer forward (a collective: every rank calls
        it, with or without a probe; :mod:`logra_core.layerwise`). The update enters as this rank's rows
        (:class:`logra_core.distributed.RowShard`): a layer's D (m × r) is gathered when the layer runs, an
        embedding's rows are looked up, a dense Δ is gathered when its module runs (norms: small); the
        head's sums run vocabulary-parallel. So no more than one decoder layer is whole at a time. Every
        rank runs the same decoder calls: a rank without a probe runs a one-token dummy; the probe's
        shared context is used only where it gives every rank the same number of calls; the probe's
        hidden states at θ are recomputed on every rank unless every rank kept them."""
        from logra_core.kl_predictor import predict_kl_sampled
        from logra_core.shared_context import context_plan

        if not self.distributed:
            return super().predict_kl(model, inputs, update, chunk, population, temperature, predictor, at, h_old, weights,
                                      share_context)
        if predictor != "secant" or population is None:
            raise ValueError("under fsdp2 the KL is predicted by the secant predictor over a probe (see FSDP2.check)")
        model.reshard()  # nothing of the root left gathered by an earlier forward
        lowrank = {name: (_row_shard(D, model.get_submodule(name).weight), A) for name, (D, A) in update.lowrank.items()}
        dense = {name: _row_shard(d, d) for name, d in update.dense.items()}
        probe = inputs or _dummy_probe(model)
        plan = context_plan(probe["input_ids"], probe["attention_mask"], probe["position_ids"], probe["positions"],
                            getattr(model, "config", None)) if share_context and inputs else None
        calls = plan.calls if plan is not None else 1
        share_context = share_context and self._max(calls) == -self._max(-calls)  # the same count on every rank
        if self._max(int(h_old is None)):  # some rank has no kept states: every rank recomputes (the same calls)
            h_old = None
        row_weights, weight_mean = weights or (None, 1.0)
        out = predict_kl_sampled(model, **probe, lowrank=lowrank, dense=dense, chunk=chunk, population=population,
                                 temperature=temperature, predictor=predictor, at=at, h_old=h_old,
                                 row_weights=row_weights, weight_mean=weight_mean, share_context=share_context)
        return out if inputs else (0.0, 0.0)

    def even_probes(self, batches: list[dict], model: nn.Module) -> list[dict]:
        if not self.distributed:
            return batches
        return batches + [_dummy_probe(model)] * (self._max(len(batches)) - len(batches))

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
