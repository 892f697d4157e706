"""Low-rank policy synchronization from trainer to rollout engine, bit for bit (docs/design.md §3.3).

After each applied step the trainer emits a :class:`SyncPayload` and a receiver replays it on its
own copy of the policy:

* ``lowrank[name] = LowRankOp``: a sketched weight moved by W ← W + L A, where L (m × r) is the
  factor exactly as the trainer multiplied it (−η·s·D, already scaled and cast) and A (r × n) is
  rebuilt by the receiver from ``spec`` = (seed, layer, step, kind, rows, cols) through
  :func:`logra_core.sketch.projection` — or sent as ``basis`` where no seed rebuilds it (the svd
  variant). Decoupled weight decay rides along as a factor. Both sides call :func:`apply_lowrank`,
  the same operations in the same dtype, so they stay equal bit for bit;
* ``values[name]``: the new value of any other changed tensor (norms, an unsketched embedding,
  LoRA adapters, every weight of dense AdamW). A new value costs the bytes of a delta and is equal by
  construction, where re-adding a float delta would round differently.

Low-precision weights (docs/precision.md, :mod:`logra_core.precision`): an op carries the trainer's
``master`` mode, and both sides merge it with :func:`logra_core.precision.merge_lowrank_`:

* ``fp32``: W = bf16(M) for an fp32 master M, so the receiver keeps the same fp32 master for every
  sketched weight of a non-fp32 dtype (memory: 4 bytes per such number);
* ``kahan``: W and its bf16 compensation C move together, and C is m × n, too big to send each
  step. The receiver keeps its own C (2 bytes per such number), created as zeros at the first
  update exactly as the trainer creates its own, and replays the same fp32 arithmetic, so its
  W and C stay equal to the trainer's bit for bit (the checksum covers C);
* ``stochastic``: no buffer; the op carries the rounding key (seed, step, layer) and the receiver
  draws the same counter-based random bits (0 extra bytes);
* ``none``: no buffer, round to nearest.

Buffers (masters or compensations, ``masters`` below) are created from the receiver's own copy at
the first update, as the trainer creates its own; a full resync carries the trainer's. fp32 weights
ignore the mode.

Integrity: ``version`` counts applied steps, and ``checksum`` is a digest (:mod:`logra_core.digest`) of
the trainer's tensors (and masters) that the payload touched, taken after the step, on the device
where they live and shard by shard (a row-sharded sender sums its ranks' digests with one small
all-reduce: no weight is gathered or copied to the host to be verified). A receiver applies a
payload only on top of ``version − 1`` and checks the digest of its own tensors afterwards; a gap or
a mismatch makes :meth:`SyncReceiver.receive` return False, and the sender answers with a full
payload (every tensor and master). Nothing drifts silently.

Values and ops travel as :class:`Streamed` mappings: each tensor (each op's L) is produced when the
receiver (or a transport) reads it — cloned, or gathered from its shards — and dropped after use, so
a full resync holds one extra tensor at a time, not a second model, and a step's payload from a
sharded trainer one gathered L at a time. A receiver that refuses a payload still reads it through
(:func:`drain`), since a sharded sender's ranks gather each tensor together.

Parts (:class:`Part`, :class:`PartReceiver`): a receiver may hold only a part of each of the
trainer's tensors — rows of an inference engine's fused parameter (vLLM's q/k/v), or one
tensor-parallel shard: a column-parallel layer's rows (its rows of L, all of A) or a row-parallel
layer's columns (all of L, its columns of A), :func:`shard_op`. A part merges at its global element
positions (:func:`apply_lowrank_part`), so it equals its slice of the whole merge bit for bit in every
master mode, and digests at its global positions (:func:`part_digest`), so the shards' digests add up.

Transport is the receiver's business: in process (call :meth:`SyncReceiver.receive`), to another
process over a gloo :class:`Channel` (:func:`send_payload` / :func:`recv_payload`: a pickled
header, then each tensor, received when the receiver reads it), or into an inference engine.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from logra_core.digest import checksum, digests, tensor_digest
from logra_core.distributed import local, local_rows
from logra_core.precision import merge_lowrank_, merge_lowrank_block_, new_buffer, round_key
from logra_core.sketch import projection


@dataclass
class LowRankOp:
    """W ← (1 − decay)·W + L A  (``decay_first``), or W ← W + L A, then W ← W − decay·W."""

    left: torch.Tensor  # L (m × r): the factor as multiplied, scale and learning rate folded in
    spec: Optional[tuple] = None  # (seed, layer, step, kind, rows, cols) rebuilding A, or None
    basis: Optional[torch.Tensor] = None  # A itself (r × n) when no spec rebuilds it
    decay: float = 0.0
    decay_first: bool = True
    master: str = "fp32"  # how a low-precision weight takes it (logra_core.precision.MASTERS)
    rounding: Optional[tuple] = None  # (seed, step, layer) keying the stochastic rounding
    columns: Optional[tuple] = None  # (c0, c1): this shard's columns of A (a row-parallel shard, :func:`shard_op`)

    def right(self, device) -> torch.Tensor:
        if self.basis is not None:
            return self.basis
        seed, layer, step, kind, rows, cols = self.spec
        a = projection(rows, cols, seed, layer, step, kind, device=device)
        return a if self.columns is None else a[:, self.columns[0] : self.columns[1]]

    def nbytes(self) -> int:
        return _nbytes(self.left) + (_nbytes(self.basis) if self.basis is not None else 0)


def apply_lowrank(target: torch.Tensor, op: LowRankOp, right: Optional[torch.Tensor] = None,
                  buffer: Optional[torch.Tensor] = None, offset: int = 0) -> None:
    """The one update both trainer and receiver run on a sketched weight: ``target`` (its rows on
    this rank, the first at global element ``offset``) with ``buffer``, its master or compensation."""
    right = op.right(target.device) if right is None else right
    key = round_key(*op.rounding) if op.rounding is not None else 0
    merge_lowrank_(target, op.left, right, op.decay, op.decay_first, op.master, buffer, key, offset)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Streamed(Mapping):
    """Tensors by name, each made by ``fetch(name)`` when read (a clone, or a gather of its shards) and
    not kept: iterating a full payload holds one extra tensor at a time. ``meta[name]`` = (shape,
    dtype) answers sizes without fetching. Every rank of a sharded sender reads the names in the same
    order (sorted), since a fetch may be a collective."""

    def __init__(self, meta: dict[str, tuple], fetch: Callable[[str], torch.Tensor]):
        self.meta, self._fetch = {n: meta[n] for n in sorted(meta)}, fetch

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.meta:
            raise KeyError(name)
        return self._fetch(name)

    def __contains__(self, name: object) -> bool:  # from the header: Mapping's default would fetch
        return name in self.meta

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)


class StreamedOps(Streamed):
    """Low-rank ops by name, each made by ``fetch(name)`` when read (a sharded sender gathers its L then)
    and not kept; ``meta[name]`` is the op's header: the op with ``left`` (and ``basis``) as (shape,
    dtype), what a transport's header sends and sizes are read from."""


def _meta(t: torch.Tensor) -> tuple:
    """What the header says of a tensor: shape and dtype."""
    return tuple(t.shape), t.dtype


def op_header(op: LowRankOp, rows: Optional[int] = None) -> LowRankOp:
    """``op`` with its tensors as (shape, dtype); ``rows``: L's rows once gathered whole (else its own)."""
    shape, dtype = _meta(op.left)
    left = (shape if rows is None else (rows, *shape[1:]), dtype)
    return replace(op, left=left, basis=None if op.basis is None else _meta(op.basis))


def _meta_bytes(meta: tuple) -> int:
    shape, dtype = meta
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _mapping_bytes(values: Mapping) -> int:
    if isinstance(values, Streamed):
        return sum(_meta_bytes(m) for m in values.meta.values())
    return sum(_nbytes(t) for t in values.values())


def _headers(ops: Mapping) -> dict[str, LowRankOp]:
    return dict(ops.meta) if isinstance(ops, StreamedOps) else {n: op_header(op) for n, op in ops.items()}


def _ops_bytes(ops: Mapping) -> int:
    return sum(_meta_bytes(h.left) + (_meta_bytes(h.basis) if h.basis is not None else 0) for h in _headers(ops).values())


def drain(payload: "SyncPayload") -> None:
    """Read every streamed op and tensor of ``payload`` and drop it, in the order a receiver reads them:
    what a receiver that refuses a payload does, since a sharded sender's ranks gather them together."""
    for part in (payload.lowrank, payload.values, payload.masters):
        for _ in part.values():
            pass


@dataclass
class SyncPayload:
    version: int
    full: bool = False  # every tensor (a resync or the first sync); else a step's changes
    lowrank: Mapping[str, LowRankOp] = field(default_factory=dict)  # a dict, or StreamedOps (fetched when read)
    values: Mapping[str, torch.Tensor] = field(default_factory=dict)  # a dict, or Streamed (fetched when read)
    masters: Mapping[str, torch.Tensor] = field(default_factory=dict)  # masters / compensations (full payloads only)
    checksum: str = ""

    def nbytes(self) -> int:
        """Bytes of tensor data the payload carries."""
        return _ops_bytes(self.lowrank) + _mapping_bytes(self.values) + _mapping_bytes(self.masters)

    def touched(self) -> list[str]:
        return sorted(set(self.lowrank) | set(self.values))


def full_bytes(model: nn.Module) -> int:
    """Bytes a full-weight sync sends: every parameter once (a tied weight once)."""
    return sum(_nbytes(p) for _, p in model.named_parameters())


class _Tensors:
    """Parameters by name (a tied weight under its first name) and the buffers kept beside them
    (fp32 masters or Kahan compensations, :mod:`logra_core.precision`), with their digests.

    A parameter may be a row shard (a DTensor: this rank holds some rows; a master holds the same
    rows as a plain tensor): its digest is then this rank's share, which :meth:`reduce` sums over
    the ranks (the identity here; a sharded sender overrides it)."""

    def __init__(self, model: nn.Module):
        self.params = {n: p for n, p in model.named_parameters()}
        self.masters: dict[str, torch.Tensor] = {}

    def entries(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor, int, tuple]]:
        """(digest key, the tensor held here, its first element's logical index, (global shape, dtype))."""
        out = []
        for n in names:
            p = self.params[n]
            rows = local_rows(p)
            offset = rows.start * (p[0].numel() if p.dim() > 1 else 1) if rows is not None else 0
            out.append((n, local(p).detach(), offset, (tuple(p.shape), p.dtype)))
            if n in self.masters:
                m = self.masters[n]
                out.append((n + "@master", m, offset, (tuple(p.shape), m.dtype)))
        return out

    def reduce(self, sums: torch.Tensor) -> torch.Tensor:
        return sums

    def checksum(self, names: Iterable[str]) -> str:
        entries = self.entries(names)
        sums = self.reduce(digests((key, t, offset) for key, t, offset, _ in entries))
        return checksum([e[0] for e in entries], sums, {e[0]: e[3] for e in entries})


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


class SyncSender:
    """Builds payloads from what the trainer's step did. ``masters``: the trainer's buffers beside
    low-precision weights (fp32 masters, Kahan compensations) by name."""

    def __init__(self, model: nn.Module):
        self.tensors = _Tensors(model)
        self.version = 0

    def whole(self, name: str) -> torch.Tensor:
        """A standalone copy of parameter ``name`` as a receiver holds it (whole)."""
        return _clone(self.tensors.params[name])

    def whole_master(self, name: str) -> torch.Tensor:
        return _clone(self.tensors.masters[name])

    def whole_op(self, name: str, op: LowRankOp) -> LowRankOp:
        """``op`` as a receiver applies it (here: as the trainer's step made it)."""
        return op

    def header(self, name: str, op: LowRankOp) -> LowRankOp:
        """What :meth:`whole_op` will make of ``op``, its tensors as (shape, dtype)."""
        return op_header(op)

    def agree(self, ok: bool) -> bool:
        """Whether every sender of this sync accepted (one process: ``ok``); a sharded sender's ranks
        must resync together, since a full payload is a collective."""
        return ok

    def delta(self, lowrank: dict[str, LowRankOp], changed: Iterable[str], masters: dict[str, torch.Tensor]) -> SyncPayload:
        """The payload of one applied step: its low-rank ops and the new values of ``changed`` tensors."""
        self.version += 1
        self.tensors.masters = dict(masters)
        plain = [n for n in changed if n not in lowrank]
        values = Streamed({n: _meta(self.tensors.params[n]) for n in plain}, self.whole)
        ops = dict(lowrank)
        lowrank = StreamedOps({n: self.header(n, op) for n, op in ops.items()}, lambda n: self.whole_op(n, ops[n]))
        payload = SyncPayload(self.version, lowrank=lowrank, values=values)
        payload.checksum = self.tensors.checksum(payload.touched())
        return payload

    def full(self, masters: Optional[dict[str, torch.Tensor]] = None) -> SyncPayload:
        """Every parameter and master at the current version, streamed (one tensor made at a time)."""
        if masters is not None:
            self.tensors.masters = dict(masters)
        params = self.tensors.params
        payload = SyncPayload(self.version, full=True,
                              values=Streamed({n: _meta(p) for n, p in params.items()}, self.whole),
                              masters=Streamed({n: (tuple(params[n].shape), m.dtype) for n, m in self.tensors.masters.items()},
                                               self.whole_master))
        payload.checksum = self.tensors.checksum(payload.touched())
        return payload


class SyncReceiver:
    """Applies payloads to a policy copy in place. ``receive`` returns False when a full resync is needed."""

    def __init__(self, model: nn.Module):
        self.tensors = _Tensors(model)
        self.version: Optional[int] = None  # unknown until the first full payload
        self.resyncs = 0
        self.last_error = ""

    @torch.no_grad()
    def receive(self, payload: SyncPayload) -> bool:
        if payload.full:
            self._load_full(payload)
            return self._verify(payload)
        if self.version is None or payload.version != self.version + 1:
            self.last_error = f"version gap: have {self.version}, payload {payload.version}"
            drain(payload)
            return False
        params, masters = self.tensors.params, self.tensors.masters
        for name, op in payload.lowrank.items():
            p = params[name]
            if name not in masters:
                buffer = new_buffer(p, op.master)  # as the trainer's optimizer creates it
                if buffer is not None:
                    masters[name] = buffer
            self._apply(name, op, masters.get(name))
            del op  # before the next is made: one streamed op or value alive at a time
        for name, value in payload.values.items():
            self._assign(name, value)
            del value
        self.version = payload.version
        return self._verify(payload)

    def _apply(self, name: str, op: LowRankOp, buffer: Optional[torch.Tensor]) -> None:
        apply_lowrank(self.tensors.params[name], op, buffer=buffer)

    def _assign(self, name: str, value: torch.Tensor) -> None:
        """Parameter ``name`` ← ``value`` (a whole tensor as the sender holds it)."""
        self.tensors.params[name].copy_(value)

    def _take(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """What this receiver keeps of a whole master ``value`` (here: all of it)."""
        return value

    def _load_full(self, payload: SyncPayload) -> None:
        """Every tensor in place, one at a time (a streamed payload makes each when read); a master
        is copied into the buffer already kept, else the received one is kept."""
        for name, value in payload.values.items():
            self._assign(name, value)
            del value
        masters = self.tensors.masters
        for name in [n for n in masters if n not in payload.masters]:
            del masters[name]
        for name, whole in payload.masters.items():
            value = self._take(name, whole)
            if name in masters and masters[name].shape == value.shape and masters[name].dtype == value.dtype:
                masters[name].copy_(value)
            else:
                streamed = isinstance(payload.masters, Streamed) and value is whole
                masters[name] = value if streamed else value.detach().clone()
            del value, whole
        self.version = payload.version

    def _verify(self, payload: SyncPayload) -> bool:
        if self.tensors.checksum(payload.touched()) == payload.checksum:
            return True
        self.last_error = f"checksum mismatch at version {payload.version}"
        return False


# ---- shards of a tensor-parallel receiver (docs/distributed.md, "vLLM engine") -------------------
@dataclass(frozen=True)
class Part:
    """Rows [row0, row0 + rows) × columns [col0, col0 + cols) of a global tensor of ``shape`` (m × n,
    or m for a vector): what one tensor-parallel shard of an engine holds of a trainer's tensor.

    Megatron's split (Shoeybi et al., 2019): a column-parallel linear (q/k/v, gate/up, the
    vocabulary-parallel embedding and head) keeps a block of rows of W; a row-parallel one (o, down)
    a block of columns. Since W ← W + L A, a row block needs its rows of L and all of A, a column
    block all of L and its columns of A (:func:`shard_op`)."""

    shape: tuple
    row0: int = 0
    rows: int = -1  # -1: to the end
    col0: int = 0
    cols: int = -1
    replica: bool = False  # the whole tensor, held by every shard of the group (norms): digested whole on each

    @staticmethod
    def rows_of(shape: tuple, rank: int, parts: int) -> "Part":
        """Shard ``rank`` of ``parts`` equal row blocks (a column-parallel layer)."""
        m = shape[0]
        if m % parts:
            raise ValueError(f"{m} rows do not split into {parts} equal shards")
        return Part(tuple(shape), rank * (m // parts), m // parts)

    @staticmethod
    def cols_of(shape: tuple, rank: int, parts: int) -> "Part":
        """Shard ``rank`` of ``parts`` equal column blocks (a row-parallel layer)."""
        n = shape[1]
        if n % parts:
            raise ValueError(f"{n} columns do not split into {parts} equal shards")
        return Part(tuple(shape), 0, -1, rank * (n // parts), n // parts)

    @property
    def row_range(self) -> tuple[int, int]:
        return self.row0, self.shape[0] if self.rows < 0 else self.row0 + self.rows

    @property
    def col_range(self) -> tuple[int, int]:
        n = self.shape[1] if len(self.shape) > 1 else 1
        return self.col0, n if self.cols < 0 else self.col0 + self.cols

    @property
    def whole_rows(self) -> bool:
        """Whether the part is a block of whole rows (contiguous in the global tensor)."""
        return len(self.shape) < 2 or self.col_range == (0, self.shape[1])

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This part of the whole tensor (a view)."""
        r0, r1 = self.row_range
        if len(self.shape) < 2:
            return whole[r0:r1]
        c0, c1 = self.col_range
        return whole[r0:r1, c0:c1]


def shard_op(op: LowRankOp, part: Part) -> LowRankOp:
    """The op a shard holding ``part`` of the weight needs: its rows of L, and its columns of A (a
    sent basis is sliced; a seeded A is rebuilt whole by the receiver and sliced, ``columns``)."""
    r0, r1 = part.row_range
    c0, c1 = part.col_range
    left = op.left[r0:r1]
    if part.whole_rows:
        return replace(op, left=left)
    basis = None if op.basis is None else op.basis[:, c0:c1]
    return replace(op, left=left, basis=basis, columns=None if basis is not None else (c0, c1))


def apply_lowrank_part(target: torch.Tensor, op: LowRankOp, part: Part,
                       buffer: Optional[torch.Tensor] = None) -> None:
    """:func:`apply_lowrank` on a shard: ``target`` holds ``part`` of the weight and ``op`` is the shard's
    (:func:`shard_op`). The result equals ``part`` of the whole merge bit for bit in every master mode:
    the stochastic rounding draws at the global element positions (:func:`merge_lowrank_block_`)."""
    r0, _ = part.row_range
    c0, _ = part.col_range
    key = round_key(*op.rounding) if op.rounding is not None else 0
    merge_lowrank_block_(target, op.left, op.right(target.device), op.decay, op.decay_first, op.master, buffer,
                         key, r0, c0, part.shape[1])


def part_digest(t: torch.Tensor, name: str, part: Part) -> torch.Tensor:
    """The digest share of ``t`` = ``part`` of tensor ``name``: its words at their global positions, so
    the shares of a partition add up (mod 2³²) to the whole tensor's digest. A block of whole rows is
    one contiguous span; a column block is digested row by row (one span each)."""
    r0, r1 = part.row_range
    if part.whole_rows:
        row = t[0].numel() if t.dim() > 1 else 1
        return tensor_digest(t, name, r0 * row)
    c0, _ = part.col_range
    width = part.shape[1]
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for i in range(r1 - r0):
        total += tensor_digest(t[i], name, (r0 + i) * width + c0)
    return total.bitwise_and_((1 << 32) - 1)


class _Parts(_Tensors):
    """A receiver's tensors when they are parts of the trainer's: ``views[name]`` holds ``parts[name]``
    of the trainer's tensor ``name`` (a block of rows of a fused vLLM parameter, a TP shard). Digests
    are taken at the global positions; ``reduce`` sums the shards' digests (one process: itself)."""

    def __init__(self, views: dict[str, torch.Tensor], parts: dict[str, Part], reduce=None):
        self.params, self.parts = dict(views), dict(parts)
        self.masters: dict[str, torch.Tensor] = {}
        if reduce is not None:
            self.reduce = reduce

    def checksum(self, names: Iterable[str]) -> str:
        """Shards' digests are summed over the group (``reduce``, the same entries on every shard); a
        replica's is its own whole digest, so each shard's copy of a replicated tensor is checked itself."""
        keys, sums, meta, replica = [], [], {}, []
        for n in names:
            p, part = self.params[n], self.parts[n]
            items = [(n, p.detach())] + ([(n + "@master", self.masters[n])] if n in self.masters else [])
            for key, t in items:
                keys.append(key)
                sums.append(part_digest(t, key, part))
                meta[key] = (tuple(part.shape), t.dtype)
                replica.append(part.replica)
        if not sums:
            return checksum(keys, torch.zeros(0, dtype=torch.int64), meta)
        device = sums[0].device
        stacked = torch.stack([x.to(device) for x in sums])
        shard = torch.tensor([not r for r in replica], device=device)
        reduced = self.reduce(stacked * shard)  # replicas enter the group's sum as 0
        return checksum(keys, torch.where(shard, reduced, stacked), meta)


class PartReceiver(SyncReceiver):
    """A :class:`SyncReceiver` whose tensors are parts of the trainer's (:class:`Part`): views into an
    engine's own parameters (vLLM's fused q/k/v rows, a tensor-parallel shard). Each op is cut to the
    part (:func:`shard_op`) and merged at the part's global positions (:func:`apply_lowrank_part`);
    whole values and masters are cut to the part; buffers (masters, compensations) are created per
    part, of the part's size. A payload that carries already-cut ops (a TP sender) sets ``cut=True``."""

    def __init__(self, views: dict[str, torch.Tensor], parts: dict[str, Part], reduce=None, cut: bool = False):
        self.tensors = _Parts(views, parts, reduce)
        self.version: Optional[int] = None
        self.resyncs = 0
        self.last_error = ""
        self.cut = cut

    def _apply(self, name: str, op: LowRankOp, buffer: Optional[torch.Tensor]) -> None:
        part = self.tensors.parts[name]
        apply_lowrank_part(self.tensors.params[name], op if self.cut else shard_op(op, part), part, buffer)

    def _assign(self, name: str, value: torch.Tensor) -> None:
        self.tensors.params[name].copy_(self.tensors.parts[name].take(value))

    def _take(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return self.tensors.parts[name].take(value)


# ---- torch.distributed transport ----------------------------------------------------------------
class Channel:
    """A point-to-point link between two processes: its own gloo process group over a TCP store, so
    it needs no default process group and coexists with one (a trainer under torchrun).

    Rank 0 hosts the store at ``port``. Objects travel pickled (a length, then the bytes); tensors
    by ``send``/``recv`` into buffers of known shape. (On GPU an NCCL group would carry CUDA
    tensors the same way; this class is the CPU path.)
    """

    def __init__(self, port: int, rank: int, host: str = "127.0.0.1", timeout_s: float = 600.0):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, 2, rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, rank, 2, timeout)
        self.peer = 1 - rank

    def send_tensor(self, t: torch.Tensor) -> None:
        self.pg.send([t.detach().contiguous().cpu()], self.peer, 0).wait()

    def recv_tensor(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self.pg.recv([t], self.peer, 0).wait()
        return t

    def send_obj(self, obj) -> None:
        buf = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.send_tensor(torch.tensor([len(buf)], dtype=torch.int64))
        self.send_tensor(torch.frombuffer(bytearray(buf), dtype=torch.uint8))

    def recv_obj(self):
        n = int(self.recv_tensor((1,), torch.int64))
        return pickle.loads(self.recv_tensor((n,), torch.uint8).numpy().tobytes())


def _metas(values: Mapping) -> dict[str, tuple]:
    return dict(values.meta) if isinstance(values, Streamed) else {n: _meta(t) for n, t in values.items()}


def send_payload(payload: SyncPayload, channel: Channel) -> None:
    """A pickled header (names, shapes, dtypes, specs), then every tensor of the payload, one at a time."""
    header = SyncPayload(
        payload.version, payload.full,
        lowrank=_headers(payload.lowrank),
        values=_metas(payload.values), masters=_metas(payload.masters), checksum=payload.checksum)
    channel.send_obj(header)
    for t in _tensors_of(payload):
        channel.send_tensor(t)


class _Incoming:
    """A payload's tensors as they arrive on a channel, in :func:`_tensors_of`'s order, each received when
    a receiver reads it — which it does in that order (ops, values, masters; names sorted)."""

    def __init__(self, channel: Channel, header: SyncPayload):
        self.channel = channel
        self.order = iter([("op", n) for n in sorted(header.lowrank)] + [("value", n) for n in sorted(header.values)]
                          + [("master", n) for n in sorted(header.masters)])

    def take(self, kind: str, name: str, *metas: tuple) -> list[torch.Tensor]:
        coming = next(self.order, None)
        if coming != (kind, name):
            raise RuntimeError(f"sync payload read out of order: {kind} {name!r} asked for, the channel holds {coming}")
        return [self.channel.recv_tensor(*meta) for meta in metas]


def recv_payload(channel: Channel) -> SyncPayload:
    """The payload :func:`send_payload` sends, streamed: its header now, each op and tensor received when
    the receiver reads it, so a full payload holds one extra tensor at a time on this side too."""
    header: SyncPayload = channel.recv_obj()
    incoming = _Incoming(channel, header)
    ops, values, masters = dict(header.lowrank), dict(header.values), dict(header.masters)

    def op(name: str) -> LowRankOp:
        h = ops[name]
        left, *basis = incoming.take("op", name, h.left, *([h.basis] if h.basis is not None else []))
        return replace(h, left=left, basis=basis[0] if basis else None)

    return SyncPayload(header.version, header.full, lowrank=StreamedOps(ops, op),
                       values=Streamed(values, lambda n: incoming.take("value", n, values[n])[0]),
                       masters=Streamed(masters, lambda n: incoming.take("master", n, masters[n])[0]),
                       checksum=header.checksum)


def _tensors_of(payload: SyncPayload) -> Iterator[torch.Tensor]:
    """The payload's tensors in the order :func:`recv_payload` reads them, made one at a time."""
    for name in sorted(payload.lowrank):
        op = payload.lowrank[name]
        yield op.left
        if op.basis is not None:
            yield op.basis
    for n in sorted(payload.values):
        yield payload.values[n]
    for n in sorted(payload.masters):
        yield payload.masters[n]
