"""Data-parallel reductions for the sketch optimizer (DESIGN §6), free of any training harness.

Data parallelism sums each rank's gradient: G = Σ_k G_k. A sketch is linear in the gradient, so
S = G Aᵀ = Σ_k G_k Aᵀ = Σ_k S_k: ranks that rebuild the same A from (seed, layer, step) all-reduce
their m × r sketches instead of m × n gradients — r/n of the bytes per sketched matrix — once per
step, after every micro-batch has been accumulated. RowAdam keeps one moment per output row, so
with W's rows sharded (FSDP's ``Shard(0)``) the update of rank k's rows, D_k A, needs only S_k,
the same rows of the sketch.

:func:`all_reduce_sum` sums a list of tensors in one flat buffer per dtype (a tensor that is
``None`` on some rank counts as zeros there and stays ``None`` where it is ``None`` on every rank);
:func:`local_rows` tells which rows of a (possibly sharded) weight this rank holds.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a view sharing its storage), else ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


def local_rows(p: torch.Tensor) -> Optional[slice]:
    """The rows of the global tensor ``p`` that this rank holds, or None when it holds all of them.

    FSDP2 shards dim 0 as ``torch.chunk`` does: chunks of ⌈m / world⌉ rows, the last ones shorter
    or empty; a replicated (or plain) tensor is held whole.
    """
    if not _is_dtensor(p):
        return None
    placements = p.placements
    if len(placements) != 1:
        raise NotImplementedError(f"sharding over a {len(placements)}-d device mesh is not supported (1-d FSDP only)")
    placement = placements[0]
    if placement.is_replicate():
        return None
    if not (placement.is_shard() and placement.dim == 0):
        raise NotImplementedError(f"a sketched weight must be replicated or row-sharded (Shard(0)), got {placement}")
    mesh = p.device_mesh
    world, coord = mesh.size(), mesh.get_local_rank()
    rows = p.shape[0]
    chunk = -(-rows // world)
    start = min(coord * chunk, rows)
    return slice(start, start + local(p).shape[0])


def all_reduce_sum(tensors: Sequence[Optional[torch.Tensor]], group=None,
                   like: Optional[Sequence[Callable[[], torch.Tensor]]] = None) -> tuple[list[Optional[torch.Tensor]], int]:
    """Σ over the ranks of ``group`` of each tensor, as new tensors; returns (sums, bytes all-reduced).

    ``tensors[i]`` may be None on some ranks (no backward reached it): it then enters as zeros of
    ``like[i]()``'s shape; where it is None on every rank the result is None (nothing moves for it).
    Every rank must pass the same list, in the same order, with the same shapes and dtypes. The
    tensors travel flattened into one buffer per dtype (one collective each); bytes counts the
    buffers' payload on one rank.
    """
    present = torch.tensor([t is not None for t in tensors], dtype=torch.int32)
    if len(tensors):
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)  # gloo and nccl both have MAX on int32
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    by_dtype: dict[tuple, list[int]] = {}
    filled = []
    for i, t in enumerate(tensors):
        if not present[i]:
            filled.append(None)
            continue
        if t is None:
            if like is None:
                raise ValueError(f"tensor {i} is None on this rank but not on another: pass like=")
            t = torch.zeros_like(like[i]())
        filled.append(t)
        by_dtype.setdefault((t.dtype, t.device), []).append(i)
    nbytes = 0
    for (dtype, device), idx in by_dtype.items():
        flat = torch.cat([filled[i].detach().reshape(-1) for i in idx])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        nbytes += flat.numel() * flat.element_size()
        offset = 0
        for i in idx:
            n = filled[i].numel()
            out[i] = flat[offset : offset + n].view_as(filled[i])
            offset += n
    return out, nbytes
