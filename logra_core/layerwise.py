"""Forwards of a row-sharded model without its whole weights (docs/distributed.md, "fsdp2").

The KL predictor and the realized-KL measurement run extra forwards of the policy. Under FSDP2 the
decoder layers unshard themselves one at a time in their own forward, but the root's parameters
(the embedding, the final norm, an LM head) are gathered only by the root module's forward, all at
once — for a 256k-token vocabulary the biggest tensor of the model. The forwards here call the
decoder directly instead, and:

* an ``nn.Embedding`` whose weight is still a row-sharded DTensor when it runs looks its rows up
  (:func:`logra_core.distributed.lookup_rows`: the ranks' token ids are exchanged, never the table);
* any other parameter still sharded when its module runs (the final norm's) is gathered for that
  call and dropped after it (:func:`substitute`);
* the LM head's KL sums run vocabulary-parallel (:func:`vocab_parallel_kl`): each rank takes its own
  rows of the head for every rank's tokens (their hidden states are all-gathered: tokens × d) and the
  online-softmax sums of the parts are merged (:func:`logra_core.kl_predictor.merge_kl_stats`).

So at most one decoder layer (FSDP2's unit) is whole at a time. Every helper that communicates is a
collective: every rank must run the same forwards (the same number of decoder calls, each module in
the same order), with or without tokens of its own. A model without DTensors runs unchanged.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from logra_core.distributed import RowShard, all_gather_varying, local, lookup_rows
from logra_core.kl_predictor import kl_from_stats, kl_stats, merge_kl_stats


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (a row-sharded FSDP2 model)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def substitute(module: nn.Module, name: str, value: Callable[[torch.Tensor], Optional[torch.Tensor]]):
    """Hooks under which ``module.<name>`` is ``value(current)`` while the module runs (``current``: the
    parameter it holds at that moment; None keeps it), restored after. Returns the handles."""
    saved = []

    def pre(mod, args):
        current = mod._parameters[name]
        new = value(current)
        saved.append(current if new is not None else None)
        if new is not None:
            mod._parameters[name] = new

    def post(mod, args, out):
        old = saved.pop()
        if old is not None:
            mod._parameters[name] = old
        return out

    # post-hooks prepended: substitutions of one parameter nest, the last installed undone first
    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, prepend=True)]


def _gather_if_sharded(current: torch.Tensor) -> Optional[torch.Tensor]:
    return current.full_tensor() if isinstance(current, DTensor) else None


@contextmanager
def sharded_forward(module: nn.Module):
    """Within it, ``module``'s parameters that are still row-sharded DTensors when their module runs are
    used without gathering the model: an embedding's rows are looked up, any other such parameter is
    gathered for the call (module docstring). Hooks only where a DTensor parameter exists."""
    with ExitStack() as stack:
        for m in module.modules():
            names = [n for n, p in m.named_parameters(recurse=False) if isinstance(p, DTensor)]
            if not names:
                continue
            if isinstance(m, nn.Embedding) and "forward" not in vars(m):
                original = m.forward

                def forward(ids, _m=m, _original=original):
                    w = _m.weight
                    return lookup_rows(local(w), w, ids) if isinstance(w, DTensor) else _original(ids)

                m.forward = forward
                stack.callback(vars(m).pop, "forward")
                names = [n for n in names if n != "weight"]
            for n in names:
                for handle in substitute(m, n, _gather_if_sharded):
                    stack.callback(handle.remove)
        yield


def pieces_local(pieces: Sequence) -> list:
    """The head update's pieces as this rank holds them: a RowShard's own rows (D's, or a dense Δ's);
    A of a low-rank piece stays whole."""
    out = []
    for p in pieces:
        if isinstance(p, tuple):
            D, A = p
            out.append((D.local if isinstance(D, RowShard) else local(D), A))
        else:
            out.append(p.local if isinstance(p, RowShard) else local(p))
    return out


def vocab_parallel_kl(h_old: torch.Tensor, W_old: torch.Tensor, h_new: torch.Tensor, W_new: torch.Tensor,
                      chunk: int = 256, softcap: Optional[float] = None, pieces: Sequence = (), at: float = 1.0,
                      group=None) -> torch.Tensor:
    """Per-token KL(p_old ‖ p_new) [T] of this rank's tokens (as :func:`logra_core.kl_predictor.streamed_kl`)
    where ``W_old``, ``W_new`` and the dense/low-rank ``pieces`` hold this rank's rows of the head: every
    rank's hidden states are all-gathered, each rank sums its vocabulary rows for all of them
    (:func:`~logra_core.kl_predictor.kl_stats`), and the ranks' sums are all-gathered and merged. Memory:
    (Σ_k T_k) × d per side and 4 sums per token and rank; no head row moves."""
    parts_old, parts_new = all_gather_varying(h_old, group), all_gather_varying(h_new, group)
    stats = kl_stats(torch.cat(parts_old), W_old, torch.cat(parts_new), W_new, chunk, softcap, pieces, at)
    stacked = torch.stack(stats)
    everyone = [torch.empty_like(stacked) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, stacked.contiguous(), group=group)
    kl = kl_from_stats(*merge_kl_stats([tuple(e) for e in everyone]))
    start = sum(p.shape[0] for p in parts_old[: dist.get_rank(group)])
    return kl[start : start + h_old.shape[0]]


def head_group(head_weight: torch.Tensor):
    """The process group a row-sharded head is sharded over."""
    return head_weight.device_mesh.get_group()
