"""Data-parallel reductions for the sketch optimizer (docs/design.md §6), free of any training harness.

Data parallelism sums each rank's gradient: G = Σ_k G_k. A sketch is linear in the gradient, so
S = G Aᵀ = Σ_k G_k Aᵀ = Σ_k S_k: ranks that rebuild the same A from (seed, layer, step) all-reduce
their m × r sketches instead of m × n gradients — r/n of the bytes per sketched matrix — once per
step, after every micro-batch has been accumulated. RowAdam keeps one moment per output row, so
with W's rows sharded (FSDP's ``Shard(0)``) the update of rank k's rows, D_k A, needs only S_k,
the same rows of the sketch.

:func:`all_reduce_sum` sums a list of tensors in one flat buffer per dtype (a tensor that is
``None`` on some rank counts as zeros there and stays ``None`` where it is ``None`` on every rank);
:func:`local_rows` tells which rows of a (possibly sharded) weight this rank holds;
:func:`gather_rows` rebuilds a whole row-sharded factor (D of ΔW = D A: every rank's D_k, m × r)
from the ranks' shares.
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


def gather_rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole [m, ...] tensor of which ``t`` holds this rank's rows, sharded as FSDP shards the
    rows of ``like`` (m rows, :func:`local_rows`); ``t`` itself when ``like`` is not row-sharded.

    Every rank of ``like``'s mesh must call it (an all-gather of ⌈m / world⌉-row chunks, the last
    ranks' zero-padded); the result is bit-identical on every rank.
    """
    rows = local_rows(like)
    if rows is None:
        return t
    mesh = like.device_mesh
    group, world, m = mesh.get_group(), mesh.size(), like.shape[0]
    chunk = -(-m // world)
    if t.shape[0] != rows.stop - rows.start:
        raise ValueError(f"gather_rows: {t.shape[0]} rows given, this rank holds {rows.stop - rows.start} of {m}")
    padded = torch.nn.functional.pad(t.detach().reshape(t.shape[0], -1), (0, 0, 0, chunk - t.shape[0])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:m].view(m, *t.shape[1:])


def all_reduce_sum(tensors: Sequence[Optional[torch.Tensor]], group=None,
                   like: Optional[Sequence[Callable[[], torch.Tensor]]] = None,
                   rows: Optional[Sequence[Optional[slice]]] = None) -> tuple[list[Optional[torch.Tensor]], int]:
    """Σ over the ranks of ``group`` of each tensor, as new tensors; returns (sums, bytes all-reduced).

    ``tensors[i]`` may be None on some ranks (no backward reached it): it then enters as zeros of
    ``like[i]()``'s shape; where it is None on every rank the result is None (nothing moves for it).
    Every rank must pass the same list, in the same order, with the same shapes and dtypes. The
    tensors travel flattened into one buffer per dtype (one collective each); bytes counts the
    buffers' payload on one rank.

    ``rows[i]``, a slice (this rank's rows of a row-sharded weight, :func:`local_rows`): tensor i
    is reduce-scattered instead — this rank receives the sum of its own rows only, and no rank
    ever holds the whole summed tensor (the rows go in ⌈m / world⌉ chunks, as FSDP shards them).
    """
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    present = torch.tensor([t is not None for t in tensors], dtype=torch.int32, device=wire)  # nccl moves no CPU tensors
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
        if rows is not None and rows[i] is not None:
            by_dtype.setdefault(("scatter", t.dtype, t.device), []).append(i)
        else:
            by_dtype.setdefault((t.dtype, t.device), []).append(i)
    nbytes = 0
    for key in [k for k in by_dtype if k[0] == "scatter"]:
        idx = by_dtype.pop(key)
        nbytes += _reduce_scatter_rows([filled[i] for i in idx], [rows[i] for i in idx], out, idx, group)
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


def _reduce_scatter_rows(tensors, rows, out, idx, group) -> int:
    """Σ over ranks of each 2-d tensor, this rank's rows only, into ``out[idx[j]]``; returns the bytes
    of the buffer one rank contributes. Layout: [world, Σ_j chunk_j · cols_j], rank k's block holding
    rows [k·chunk_j, (k+1)·chunk_j) of every tensor (zero-padded past m_j)."""
    world = dist.get_world_size(group)
    blocks = []
    for t in tensors:
        m = t.shape[0]
        chunk = -(-m // world)
        padded = torch.nn.functional.pad(t.detach().reshape(m, -1), (0, 0, 0, chunk * world - m))
        blocks.append(padded.reshape(world, -1))
    buf = torch.cat(blocks, dim=1).contiguous()
    mine = torch.empty(buf.shape[1], dtype=buf.dtype, device=buf.device)
    dist.reduce_scatter_tensor(mine, buf.reshape(-1), op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for j, t in enumerate(tensors):
        m, cols = t.shape[0], t[0].numel() if t.dim() > 1 else 1
        chunk = -(-m // world)
        local_rows_j = rows[j].stop - rows[j].start
        out[idx[j]] = mine[offset : offset + chunk * cols].view(chunk, *t.shape[1:])[:local_rows_j]
        offset += chunk * cols
    return buf.numel() * buf.element_size()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def all_gather_varying(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same trailing shape and dtype, any number of rows), in rank order: one
    all-gather of the row counts, one of the tensors padded to the largest."""
    world = dist.get_world_size(group)
    count = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = _pad_rows(t.contiguous(), max(sizes))
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[:n] for p, n in zip(parts, sizes)]


def lookup_rows(local_part: torch.Tensor, like: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``whole[ids]`` of the row-sharded tensor of which ``local_part`` holds this rank's rows (laid out as
    ``like``, :func:`local_rows`), without gathering it: the ranks' distinct ids are all-gathered, each
    rank fills the rows it owns and one all-reduce sums them, so each rank receives (Σ_k |ids_k|) rows,
    not m. Every rank of ``like``'s mesh must call it (with its own ids, any number)."""
    rows = local_rows(like)
    if rows is None:
        return local_part[ids]
    group = like.device_mesh.get_group()
    flat = ids.reshape(-1).to(local_part.device)
    distinct, inverse = torch.unique(flat, return_inverse=True)
    parts = all_gather_varying(distinct, group)
    union = torch.cat(parts)
    values = torch.zeros(union.shape[0], *local_part.shape[1:], dtype=local_part.dtype, device=local_part.device)
    mine = (union >= rows.start) & (union < rows.stop)
    values[mine] = local_part[union[mine] - rows.start]
    dist.all_reduce(values, group=group)
    start = sum(p.shape[0] for p in parts[: dist.get_rank(group)])
    return values[start : start + distinct.shape[0]][inverse].view(*ids.shape, *local_part.shape[1:])


class RowShard:
    """This rank's rows of a row-sharded [m, ...] tensor (an FSDP2 weight's, or a tensor laid out like
    it: a low-rank factor D, a dense update Δ), standing in for the whole tensor where it is used:
    :meth:`whole` gathers it (a collective), ``shard[ids]`` looks rows up (:func:`lookup_rows`, a
    collective), :attr:`local` is this rank's part. ``like``: a DTensor with the layout."""

    def __init__(self, local_part: torch.Tensor, like: torch.Tensor):
        self.local, self.like = local_part, like

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.like.shape[0], *self.local.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def rows(self) -> Optional[slice]:
        return local_rows(self.like)

    def whole(self) -> torch.Tensor:
        return gather_rows(self.local, self.like)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup_rows(self.local, self.like, ids)


def whole(t) -> torch.Tensor:
    """``t`` itself, or the whole tensor a :class:`RowShard` or DTensor stands for (gathered)."""
    if isinstance(t, RowShard):
        return t.whole()
    return t.full_tensor() if _is_dtensor(t) else t
