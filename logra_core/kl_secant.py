"""The KL of an update measured at one trial scale: the step controller's cheap path (docs/design.md §3.2).

The exact predictor (:mod:`logra_core.kl_predictor`) evaluates the second-order term ½ΔᵀFΔ with a
forward-mode tangent through the decoder: about 3.35 forwards of its probe. This path instead runs
the probe at the trial weights θ + εΔ and measures the KL there, exactly (every vocabulary entry):

    K(ε) = mean_t KL(p_t(θ) ‖ p_t(θ + εΔ)),        KL̂(1) = K(ε) / ε²,

two plain forwards (θ and θ + εΔ; no tangents, the fast attention kernel). K(ε)/ε² is the exact
predictor's KL̂(1) up to terms of order ε (K(s) = s²·½ΔᵀFΔ + O(s³)), so the two agree as ε → 0, and at
ε = s, the scale finally applied, K(ε) *is* the realized KL on the probe. The controller therefore
measures at ε = the previous step's scale (consecutive updates need similar shrinking): the
applied s = ε·√(κ / K(ε)) lands on κ up to the change of K(s)/s² between ε and s, which is what
the second-order prediction ignores anyway.

The trial weights are never formed: a low-rank ΔW = D A adds ε·(x Aᵀ)Dᵀ to the output of every
``nn.Linear`` holding W (ε·D[ids] A for an ``nn.Embedding``), a dense Δ of an embedding adds
ε·Δ[ids], other dense Δ (norms) stand in for their parameter as p + εΔ while its module runs (a copy
of those small tensors, :func:`logra_core.layerwise.substitute`). The head's logits are
z = h Wᵀ + ε Σ_i g_i U_iᵀ (the update's pieces of a tied head,
:func:`logra_core.kl_predictor.head_delta`), capped like the model's (Gemma-2's softcap).

A row-sharded model (FSDP2) runs the same way without a whole copy of anything big
(:mod:`logra_core.layerwise`): the update's factors and dense Δ arrive as
:class:`logra_core.distributed.RowShard` (this rank's rows: a linear's D is gathered when its module
runs, an embedding's rows are looked up), the decoder is called directly (FSDP2 unshards one layer at
a time; the embedding's rows are looked up) and the head's sums run vocabulary-parallel.

Precision: the logit difference is taken between two forwards in the model's dtype; in bf16 its
rounding adds a bias of order ½Var(rounding noise of z) to K(ε) (docs/speed.md states the measured
size); the exact path's tangent has none, and stays the reference.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from logra_core.distributed import whole
from logra_core.kl_predictor import LowRank, _decoder, head_delta, owners_by_weight, streamed_kl
from logra_core.layerwise import head_group, pieces_local, sharded_forward, substitute, vocab_parallel_kl
from logra_core.shared_context import context_plan, shared_context_forward


def _add_rows(delta: torch.Tensor, at: float):
    """A forward hook adding at·Δ[ids] to an nn.Embedding's output (a fresh gather) in place."""
    def hook(module, args, out):
        return out.add_(delta[args[0]].to(out.dtype), alpha=at)
    return hook


def _add_lowrank(D: torch.Tensor, A: torch.Tensor, at: float, embedding: bool):
    """A forward hook adding at·(x Aᵀ) Dᵀ (an nn.Linear's input x) or at·D[ids] A (an nn.Embedding's) to the
    module's output in place: the scale goes on the r-column factor, the product is accumulated into the
    output (one pass over it, no temporary of its size where the dtypes agree). ``D`` may be a
    RowShard: gathered (a linear's m × r) or looked up (an embedding's rows) when the module runs."""
    def hook(module, args, out):
        if embedding:
            g, U = D[args[0]].reshape(-1, D.shape[-1]).to(A.dtype), A
        else:
            x = args[0]
            g, U = x.reshape(-1, x.shape[-1]).to(A.dtype) @ A.t(), whole(D).to(A.dtype).t()
        g.mul_(at)  # a fresh T × r tensor in both cases (an index gather, a product)
        flat = out.view(-1, out.shape[-1])
        if flat.dtype == U.dtype:
            flat.addmm_(g, U)
        else:
            flat.add_((g @ U).to(flat.dtype))
        return out
    return hook


def trial_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                        position_ids: Optional[torch.Tensor] = None, lowrank: Optional[LowRank] = None,
                        dense: Optional[dict[str, torch.Tensor]] = None, at: float = 1.0, positions=None,
                        share_context: bool = True) -> torch.Tensor:
    """Last hidden states at θ + at·Δ (T × d at ``positions``), no grad, no weight of Δ's size formed.

    ``share_context``: compute the context the rows share (the chat header, a prompt group's prompt)
    once, by :func:`logra_core.shared_context.shared_context_forward` (same states up to floating-point
    reordering; the plain forward where :func:`~logra_core.shared_context.context_plan` does not apply)."""
    lowrank, dense = lowrank or {}, dense or {}
    if positions is not None and positions.dim() == 2 and bool(positions.any()):
        end = int(positions.any(0).nonzero()[-1]) + 1  # a causal decoder: columns after the last read one change nothing read
        input_ids, positions = input_ids[:, :end], positions[:, :end]
        attention_mask = attention_mask[:, :end] if attention_mask is not None else None
        position_ids = position_ids[:, :end] if position_ids is not None else None
    decoder = _decoder(model)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = out_emb.weight if out_emb is not None else None
    names_in_decoder = {id(p): n for n, p in decoder.named_parameters()}
    owners_of = owners_by_weight(decoder)
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(sharded_forward(decoder))  # a row-sharded model: no whole embedding (first: its hooks run first)
        for name, (D, A) in lowrank.items():
            weight = model.get_submodule(name).weight
            owners = owners_of.get(id(weight), [])
            if not owners and weight is not head:
                raise ValueError(f"lowrank[{name!r}]: its weight is used by no nn.Linear/nn.Embedding of the model")
            for module in owners:
                hook = _add_lowrank(D, A, at, isinstance(module, nn.Embedding))
                stack.callback(module.register_forward_hook(hook).remove)
        holders = {}  # id(parameter) -> the modules holding it directly, with its name there
        for m in decoder.modules():
            for n, q in m.named_parameters(recurse=False):
                holders.setdefault(id(q), []).append((m, n))
        for name, delta in dense.items():
            p = model.get_parameter(name)
            if p is head and id(p) not in names_in_decoder:
                continue  # an untied head: the logits take it (trial_kl_terms)
            if id(p) not in names_in_decoder:
                raise ValueError(f"dense[{name!r}]: a parameter neither of the decoder nor of the LM head")
            embeddings = [m for m in owners_of.get(id(p), []) if isinstance(m, nn.Embedding)]
            if embeddings and len(embeddings) == len(owners_of.get(id(p), [])):
                for module in embeddings:  # ε·Δ[ids]: no copy of the vocabulary-sized table
                    stack.callback(module.register_forward_hook(_add_rows(delta, at)).remove)
                continue
            for module, local_name in holders[id(p)]:  # p + εΔ while the module runs
                for handle in substitute(module, local_name, _plus(delta, at)):
                    stack.callback(handle.remove)
        plan = context_plan(input_ids, attention_mask, position_ids, positions, getattr(model, "config", None)) \
            if share_context else None
        if plan is not None:
            return shared_context_forward(decoder, input_ids, attention_mask, position_ids, positions, plan)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
    return out.reshape(-1, out.shape[-1]) if positions is None else out[positions]


def _plus(delta, at: float):
    """The value p + at·Δ of a parameter p (as its module holds it when it runs) under a dense Δ (a
    RowShard's rows gathered when it runs)."""
    def value(current: torch.Tensor) -> torch.Tensor:
        return current.detach() + at * whole(delta).to(current.dtype)
    return value


def shifted_kl(h_old: torch.Tensor, h_new: torch.Tensor, W: torch.Tensor, pieces: list, at: float = 1.0,
               chunk: int = 256, softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token KL(p_old ‖ p_new) [T] for z_old = h_old Wᵀ and z_new = h_new (W + at·ΔW)ᵀ, where ΔW is
    the sum of ``pieces`` (dense V × d tensors or low-rank (D, A)): one pass over the head's vocabulary
    (:func:`logra_core.kl_predictor.streamed_kl`; a tiny step's KL keeps its relative precision, W + at·ΔW
    is formed one block of the head at a time where W is fp32/fp64, a bf16 ΔW enters as its own product).
    """
    return streamed_kl(h_old, W, h_new, W, chunk, softcap, pieces, at)


def trial_kl_terms(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                   position_ids: Optional[torch.Tensor] = None, lowrank: Optional[LowRank] = None,
                   dense: Optional[dict[str, torch.Tensor]] = None, positions=None, chunk: int = 256,
                   temperature: float = 1.0, at: float = 1.0, h_old: Optional[torch.Tensor] = None,
                   share_context: bool = True) -> torch.Tensor:
    """Per-token KL(p_t(θ) ‖ p_t(θ + at·Δ)) / at² [T] at ``positions`` (row-major), at temperature T
    (logits z/T: h and the head's pieces enter divided by T) — the secant reading of KL̂(1).

    ``h_old``: the last hidden states at θ at ``positions`` (T × d, before 1/T) when the caller kept
    them from a forward it ran anyway (:class:`experiments.rl.probe_capture.ProbeCapture`); else one
    more forward computes them, by the same path as the trial's (``share_context``: see
    :func:`trial_hidden_states`), so that both carry the same rounding."""
    if not at > 0:
        raise ValueError(f"trial_kl_terms: the trial scale must be > 0, got {at}")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("trial_kl_terms assumes an LM head without bias")
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if temperature != 1.0 and softcap:
        raise ValueError("trial_kl_terms: a sampling temperature != 1 with final-logit softcapping is not supported")
    if h_old is None:
        h_old = trial_hidden_states(model, input_ids, attention_mask, position_ids, positions=positions,
                                    share_context=share_context)
    h_new = trial_hidden_states(model, input_ids, attention_mask, position_ids, lowrank, dense, at, positions,
                                share_context)
    if temperature != 1.0:
        h_old, h_new = h_old / temperature, h_new / temperature
    W, pieces = head.weight.detach(), head_delta(model, lowrank, dense)
    if isinstance(W, DTensor):  # a row-sharded head: each rank sums its vocabulary rows for every rank's tokens
        kl = vocab_parallel_kl(h_old, W.to_local(), h_new, W.to_local(), chunk, softcap, pieces_local(pieces), at,
                               head_group(W))
    else:
        kl = shifted_kl(h_old, h_new, W, pieces, at, chunk, softcap)
    return kl / at**2
