"""Weight digests computed where the tensors live, shard by shard (docs/design.md, "Weight sync").

Weight sync verifies after every step that a receiver's copy equals the trainer's. Copying the
touched weights to the host to hash them costs their bytes in host traffic on both sides every step
(with LoGRA every sketched weight is touched every step), and a row-sharded trainer would first have
to gather them. This digest is instead a weighted sum that torch computes on the tensor's own
device, that splits over row shards exactly, and whose only host traffic is 8 bytes per tensor.

A tensor is read as 32-bit words w_i: its bytes as int32 for 4- and 8-byte dtypes (an 8-byte element
is two words), each element sign-extended to 32 bits for 1- and 2-byte dtypes; i runs over the
words of the *logical* tensor in row-major order. With B = :data:`BLOCK` = 2¹⁶,

    D = Σ_i w_i · c_i  (mod 2³²),      c_i = T[i mod B] + u(s, ⌊i / B⌋),

T a fixed table of odd constants and u an even 32-bit hash (SplitMix64, Steele, Lea & Flood 2014)
of the tensor's salt s (its name) and the block index, so every c_i is odd and depends on the
position. Integer products and sums wrap modulo 2³² (int32) or 2⁶⁴ (int64) on every device torch
runs on, and a modular sum does not depend on the order of its terms: every device, kernel and
shard layout gives the same bits. Hence:

* **Any one-word change is detected, always**: a change δ ≢ 0 (mod 2³²) of one word changes D by
  δ·c_i, and c_i is odd (invertible modulo 2³²), so D changes. Several changes cancel only when
  Σ δ_i c_i ≡ 0 (mod 2³²), which for unstructured corruption happens with probability about 2⁻³²
  per tensor (c varies with the position, so swapped rows or shifted blocks are no easier). It
  guards against corruption and drift, not against an adversary.
* **Shards add up**: a row shard holding the logical words [o, o + n) contributes their terms; the
  ranks' contributions summed (one int64 all-reduce per sync for all tensors) equal the whole
  tensor's D. A receiver holding whole tensors, or views into fused ones (a slice of rows keeps
  its logical order), computes the same D locally.
* **Cost**: about three passes over the tensor's words on its device (one int32 product with the
  table, two int32 sums, all wrapping modulo 2³²), in groups of at most :data:`GROUP_BLOCKS` blocks (the temporaries are a few
  MB, never the tensor's size). The host receives one int64 per tensor; names, shapes, dtypes and
  the sums are hashed there by BLAKE2b into the payload's checksum string (:func:`checksum`).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Iterable, Optional

import torch

BLOCK = 1 << 16  # words per block of the table T
GROUP_BLOCKS = 16  # blocks hashed at once (the temporaries: a few of 16 × 2¹⁶ words)
MASK32 = (1 << 32) - 1
_M64 = (1 << 64) - 1
_TABLES: dict[torch.device, torch.Tensor] = {}


def _splitmix64(x: int) -> int:
    """SplitMix64's output function of a 64-bit integer (Python ints, exact)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _signed32(x: int) -> int:
    x &= MASK32
    return x - (1 << 32) if x >> 31 else x


def salt(name: str) -> int:
    """The tensor's salt: CRC-32 of its name (equal contents under two names get different digests)."""
    return zlib.crc32(name.encode())


def table(device) -> torch.Tensor:
    """T: :data:`BLOCK` odd int32 constants, T[j] = low 32 bits of SplitMix64(j), made odd (cached per device)."""
    device = torch.device(device)
    if device not in _TABLES:
        values = [_signed32(_splitmix64(j) | 1) for j in range(BLOCK)]
        _TABLES[device] = torch.tensor(values, dtype=torch.int32, device=device)
    return _TABLES[device]


def block_term(s: int, block: int) -> int:
    """u(s, b): an even 32-bit value, the block's share of every c_i in it (as a signed int)."""
    return _signed32(_splitmix64((s << 32) ^ block) << 1)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's 32-bit words (int32), flat in row-major order (a copy only where it must convert)."""
    flat = t.reshape(-1)
    size = t.element_size()
    if t.dtype == torch.bool:
        return flat.to(torch.int32)
    if size >= 4:
        return flat.view(torch.int32)
    return flat.view({1: torch.int8, 2: torch.int16}[size]).to(torch.int32)


def _span(words: torch.Tensor, start: int, s: int) -> torch.Tensor:
    """Σ w_i c_i mod 2³² (an int32 0-d tensor) of ``words``, whose first word is logical word ``start``.
    Products and sums stay in int32, wrapping modulo 2³² (what D is taken modulo)."""
    T, n = table(words.device), words.numel()
    total = torch.zeros((), dtype=torch.int32, device=words.device)
    product = torch.empty(min(n, GROUP_BLOCKS * BLOCK), dtype=torch.int32, device=words.device)
    i = 0
    while i < n:
        g = start + i  # logical index of words[i]
        j = g % BLOCK
        if j or n - i < BLOCK:  # a partial block: up to the next block boundary or the end
            k = min(BLOCK - j, n - i)
            piece = words[i : i + k]
            total += torch.mul(piece, T[j : j + k], out=product[:k]).sum(dtype=torch.int32)
            total += piece.sum(dtype=torch.int32) * block_term(s, g // BLOCK)
            i += k
            continue
        blocks = min(GROUP_BLOCKS, (n - i) // BLOCK)  # whole blocks, several at once
        piece = words[i : i + blocks * BLOCK].view(blocks, BLOCK)
        terms = torch.tensor([block_term(s, g // BLOCK + b) for b in range(blocks)], dtype=torch.int32,
                             device=words.device)
        total += torch.mul(piece, T, out=product[: blocks * BLOCK].view(blocks, BLOCK)).sum(dtype=torch.int32)
        total += (piece.sum(1, dtype=torch.int32) * terms).sum(dtype=torch.int32)
        i += blocks * BLOCK
    return total


@torch.no_grad()
def tensor_digest(t: torch.Tensor, name: str, offset: int = 0) -> torch.Tensor:
    """D of ``t`` as a 0-d int64 tensor on ``t``'s device, in [0, 2³²); ``offset``: the logical index
    of ``t``'s first *element* (a row shard of a bigger tensor: its first row × the row length)."""
    s, t = salt(name), t.detach()
    per_element = max(1, t.element_size() // 4)
    if t.is_contiguous() or t.dim() < 2:
        total = _span(_words(t.contiguous()), offset * per_element, s)
    else:  # a strided view (a column slice): its rows in contiguous groups
        rows = t.reshape(t.shape[0], -1) if t.dim() > 2 else t
        step = max(1, GROUP_BLOCKS * BLOCK // max(1, rows.shape[1] * per_element))
        total = torch.zeros((), dtype=torch.int32, device=t.device)
        for r in range(0, rows.shape[0], step):
            total += _span(_words(rows[r : r + step].contiguous()), (offset + r * rows.shape[1]) * per_element, s)
    return total.to(torch.int64).bitwise_and_(MASK32)


def digests(named: Iterable[tuple[str, torch.Tensor, int]], device: Optional[torch.device] = None) -> torch.Tensor:
    """The digests of ``(name, tensor, offset)`` items, stacked in their order: an int64 vector on
    ``device`` (default: the first tensor's), each element computed on its own tensor's device."""
    parts = [tensor_digest(t, name, offset) for name, t, offset in named]
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=device)
    device = device or parts[0].device
    return torch.stack([p.to(device) for p in parts])


def checksum(names: list[str], sums: torch.Tensor, meta: dict[str, tuple]) -> str:
    """The checksum string: BLAKE2b over each name, its ``meta`` (shape, dtype) and its digest
    (taken mod 2³², so shard sums may be passed unreduced). The one host transfer: ``sums``, 8 B per tensor."""
    values = sums.tolist()
    if len(values) != len(names):
        raise ValueError(f"checksum: {len(names)} names for {len(values)} digests")
    h = hashlib.blake2b(digest_size=16)
    for name, value in zip(names, values):
        h.update(name.encode())
        h.update(repr(meta.get(name, ())).encode())
        h.update((value & MASK32).to_bytes(4, "little"))
    return h.hexdigest()
