"""``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root (dim-0 row shards).

FSDP reduce-scatters the dense gradients in backward; ``logra``'s sketches are all-reduced once per
step and each rank's RowAdam update D_k A touches only its own rows (A rebuilt from its seed).
Rollouts and evaluation run on the whole weights (gathered once per phase, then resharded).
The chunked LM head (``train.logprob_chunk > 0``) runs inside the root module's forward
(:func:`~experiments.rl.distributed.base.through_root`), where FSDP gathers the head and embedding
and from which its backward reduce-scatters their gradients: no tokens × vocab logits exist on any
rank. Step control (:meth:`FSDP2.predict_kl`) predicts on the gathered weights: each rank's low-rank
hooks get a layer's whole D (an all-gather of the m × r factor rows) and A from its seed, the dense
Δ of sharded tensors is gathered, each rank probes its share and the prediction is the
token-weighted mean over ranks, as under ddp. A rollout engine with its own copy
(``rollout.engine=hf|vllm``: one engine per rank) starts from a fresh skeleton and follows the
trainer through :class:`GatheringSender` payloads: each sketched weight's L = −η·s·D with its rows
gathered from their owners (A from the seed), the changed dense tensors gathered whole; the
checksum is taken on the gathered tensors, so every rank's copy is verified against the same
digest. Checkpoints are sharded (``torch.distributed.checkpoint``,
:mod:`experiments.rl.sharded_checkpoint`): each rank writes its model shards and its rows of the
method state; a run resumes on the same world size (tests/test_distributed.py: weights within 1e-6,
the same step scales and losses), or in one process.
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
from logra_core.distributed import gather_rows
from logra_core.sync import SyncSender


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
