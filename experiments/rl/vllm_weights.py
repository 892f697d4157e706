"""How sync payloads reach the weights a vLLM engine computes with (docs/distributed.md, "vLLM engine").

Two paths behind one interface (``receive``, ``resident``, ``state_dict``), picked by
``rollout.vllm.weights`` (:data:`WEIGHT_PATHS`):

* ``inplace`` (vLLM's CUDA build, where parameters are ordinary tensors): a
  :class:`~logra_core.sync.PartReceiver` on views into vLLM's own parameters — the rows of the fused
  ``qkv_proj`` / ``gate_up_proj``, the (padded) embedding that a tied head shares
  (:mod:`experiments.rl.vllm_layout`). A low-rank op W ← W + L A runs where the weight lives, rebuilding
  A from its seed; the digest of every touched view is taken on the GPU under the trainer's names. No
  shadow copy, no reload, no host copy; the receiver keeps only what its master mode needs (fp32: a
  4-byte master, kahan: the 2-byte compensation, stochastic / none: nothing). Addresses never change,
  so captured CUDA graphs stay valid.
* ``reload`` (vLLM's CPU build, which repacks every linear weight for oneDNN: a ``(0,)`` parameter, nothing
  to edit in place): the payload is replayed on a *shadow* copy of the policy (bit-exact, checksummed)
  and the touched layers are pushed whole through ``collective_rpc("reload_weights")`` — q/k/v and
  gate/up together, a weight with its bias (a partial push leaves the rest of the layer uninitialized);
  a tied head's packed copy is rebuilt after the embedding; the engine resets its prefix cache.

Functions named ``_worker_*`` run inside vLLM's worker (``collective_rpc`` passes the worker first; in
process, so tensors and callables pass by reference).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from experiments.rl.rollout import copy_policy
from experiments.rl.vllm_layout import PACKED, layout, views
from logra_core.sync import PartReceiver, SyncPayload, SyncReceiver

WEIGHT_PATHS: dict[str, type] = {}


def register_path(name: str):
    def wrap(cls):
        WEIGHT_PATHS[name] = cls
        return cls
    return wrap


@register_path("inplace")
class InPlaceWeights:
    """Payloads applied to vLLM's own parameters through views (tensor_parallel_size = 1)."""

    load_format = "dummy"  # vLLM starts from random weights; the first (full) sync fills them
    writes_weights = False

    def __init__(self, model, factory: Optional[Callable] = None):
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a DTensor's shape is global
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.embedding = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
        self.receiver: Optional[PartReceiver] = None

    def attach(self, llm) -> None:
        model = llm.collective_rpc(_worker_model)[0]
        self.params = dict(model.named_parameters())  # a tied head is the embedding's parameter (listed once)
        packed = {k: tuple(v) for k, v in (getattr(model, "packed_modules_mapping", None) or PACKED).items()}
        slots = layout(self.shapes, packed=packed)
        unfilled = sorted(set(self.params) - {s.target for s in slots.values()})
        if unfilled:  # they would keep vLLM's dummy weights
            raise ValueError(f"vLLM parameters no trainer tensor fills: {unfilled[:5]}; use rollout.vllm.weights=reload")
        self.receiver = PartReceiver(views(slots, self.params), {n: s.part for n, s in slots.items()})
        self.tied_head = "lm_head" if self.tied else ""  # vLLM's head module, sharing the embedding's parameter

    @property
    def last_error(self) -> str:
        return self.receiver.last_error

    def receive(self, payload: SyncPayload, llm) -> bool:
        return self.receiver.receive(payload)

    def resident(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.receiver.tensors.masters.values()]

    def buffers(self) -> list[torch.Tensor]:
        return list(self.receiver.tensors.masters.values())

    def state_dict(self, llm, tied: bool = False) -> dict[str, torch.Tensor]:
        """vLLM's weights by HF name (views, cloned); ``tied``: the head as vLLM's head module holds it."""
        out = {n: v.detach().clone() for n, v in self.receiver.tensors.params.items()}
        if tied and self.tied_head:
            out[self.tied_head + ".weight"] = out[self.embedding]
        return out


@register_path("reload")
class ReloadWeights:
    """A shadow copy receives the payload; the touched layers are reloaded into vLLM whole."""

    load_format = "auto"
    writes_weights = True  # vLLM loads the shadow's weights from the model folder

    def __init__(self, model, factory: Optional[Callable] = None):
        self.shadow = copy_policy(model, factory)  # FSDP2: a skeleton the first full sync fills
        self.receiver = SyncReceiver(self.shadow)
        self.params = dict(self.shadow.named_parameters())
        self.embedding = next(n for n, p in self.params.items() if p is self.shadow.get_input_embeddings().weight)
        self.push_s = 0.0  # seconds spent in the last push into vLLM

    def attach(self, llm) -> None:
        self.fused, self.tied_head = llm.collective_rpc(_worker_layout)[0]
        # the reloader warns about every layer a partial push leaves alone (and the tied head, rebuilt
        # below); what vLLM computes with is checked by reading it back (tests/test_vllm_engine.py)
        for part in ("inplace", "layerwise"):
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{part}").setLevel(logging.ERROR)

    @property
    def last_error(self) -> str:
        return self.receiver.last_error

    def receive(self, payload: SyncPayload, llm) -> bool:
        if not self.receiver.receive(payload):
            return False  # the shadow may be half-updated: the full payload that follows pushes all
        self.push(payload.touched(), llm)
        return True

    @torch.no_grad()
    def push(self, names: list[str], llm) -> None:
        """Reload the shadow's ``names`` into vLLM, each with the rest of its fused group."""
        t0 = time.perf_counter()
        send = list(dict.fromkeys(m for n in names for m in self.fused.get(n, (n,)) if m in self.params))
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=[(n, self.params[n].detach()) for n in send]))
        if self.tied_head and self.embedding in send:
            llm.collective_rpc(_worker_repack_head, args=(self.tied_head,))
        self.push_s = time.perf_counter() - t0

    def resident(self) -> list[torch.Tensor]:
        return [*self.shadow.parameters(), *self.receiver.tensors.masters.values()]

    def buffers(self) -> list[torch.Tensor]:
        return self.resident()

    def state_dict(self, llm, tied: bool = False) -> dict[str, torch.Tensor]:
        """The weights vLLM computes with, read back, by HF parameter name (a linear layer's weight by
        running its packed kernel on an identity matrix). ``tied``: add the tied LM head as read back
        from its own packed copy, under the head's name."""
        vocab = self.params[self.embedding].shape[0]
        weights = llm.collective_rpc(_worker_read_weights, args=(vocab,))[0]
        out = {n: weights[n] for n in self.params}
        if tied and self.tied_head:
            out[self.tied_head + ".weight"] = weights[self.tied_head + ".weight"]
        return out


# ---- run inside the vLLM worker --------------------------------------------------------------------
def _worker_model(worker):
    return worker.model_runner.get_model()


def _worker_layout(worker) -> tuple[dict[str, tuple[str, ...]], str]:
    """HF tensor name -> the HF names of every tensor of its vLLM layer, reloaded together (a layer is
    re-processed once all of its tensors have arrived: q/k/v, gate/up, a weight with its bias); and
    the tied LM head's module name ("" if none)."""
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {})
    groups = {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part in packed[leaf]] if leaf in packed else [name]
        group = tuple(f"{part}.{p}" for p, _ in module.named_parameters(recurse=False) for part in parts)
        groups.update({n: group for n in group})
    tied = ""
    if getattr(model.config, "tie_word_embeddings", False):
        tied = next((n for n, m in model.named_modules() if type(m).__name__ == "ParallelLMHead"), "")
    return groups, tied


def _worker_repack_head(worker, head: str) -> None:
    """Rebuild the tied head's packed copy from the (reloaded) embedding it shares its weight with."""
    layer = worker.model_runner.get_model().get_submodule(head)
    layer.quant_method.process_weights_after_loading(layer)


@torch.no_grad()
def _worker_read_weights(worker, vocab: int) -> dict[str, torch.Tensor]:
    """Every weight as the kernels use it: a linear (or LM head) by its packed kernel applied to the
    identity without bias, x = I → y = I Wᵀ = Wᵀ (exact: each output sums one product w·1 and zeros),
    split into the HF tensors of a fused layer; an embedding's first ``vocab`` rows (vLLM pads the
    vocabulary); the rest (norms, biases) as stored. The identity is made on the worker's device."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = worker.model_runner.get_model()
    device = getattr(worker, "device", None) or torch.device("cpu")
    packed = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        if isinstance(module, LinearBase):
            width = getattr(module, "input_size_per_partition", module.input_size)
            eye = torch.eye(width, dtype=worker.model_config.dtype, device=device)
            weight = module.quant_method.apply(module, eye).t()
            if leaf in packed:
                for suffix, t in (("weight", weight), ("bias", getattr(module, "bias", None))):
                    if t is not None:
                        parts = t.split(list(module.output_sizes), dim=0)
                        out.update({f"{prefix}.{p}.{suffix}": w.contiguous()
                                    for p, w in zip(packed[leaf], parts, strict=True)})
            else:
                out[name + ".weight"] = weight.contiguous()
        elif isinstance(module, ParallelLMHead):
            eye = torch.eye(module.embedding_dim, dtype=worker.model_config.dtype, device=device)
            out[name + ".weight"] = module.quant_method.apply(module, eye).t()[:vocab].contiguous()
        elif isinstance(module, VocabParallelEmbedding):
            out[name + ".weight"] = module.weight[:vocab].clone()
    for name, p in model.named_parameters():  # the rest, a tied weight under its first name
        out.setdefault(name, p.detach().clone())
    return out
