"""How a low-rank update lands in a low-precision weight: LoGRA's ``master`` modes (docs/precision.md).

A sketched weight W (m × n) moves by W ← (1 − λ)W + L A (or (1 − λ)(W + L A)), L = −η·s·D (m × r),
A (r × n). In bf16 (8 significant bits: spacing 2⁻⁷ ≈ 7.8e-3 at 1.0) an update of 1e-5 is below
half the spacing of any weight larger than ~2.6e-3 and rounds away, so a bf16 weight needs one of:

* ``fp32``       — an fp32 master M (4 B per element): M ← update(M), W ← round(M). The reference.
* ``kahan``      — a bf16 compensation C beside W (2 B per element) holding the rounding error of W:
                   X = W + C (in fp32), X ← update(X), W ← round(X), C ← round(X − W). W + C is a
                   double-bf16 number with ~16 significant bits, so the small steps add up instead of
                   vanishing (compensated summation: Kahan, 1965; Zamirai et al., 2020, "Revisiting
                   BFloat16 Training").
* ``stochastic`` — no buffer: W ← SR(update(W)), rounding up or down with probabilities that make
                   E[SR(x)] = x, so the small steps add up in expectation. The random bits are a
                   counter-based hash of (seed, step, layer, element index) in plain torch integer
                   arithmetic — the same bits on any device — so a receiver replaying the update
                   draws the same rounding (:func:`round_key`, :func:`stochastic_round_bf16`).
* ``none``       — W ← round-to-nearest(update(W)): what bf16 loses.

The update itself runs in fp32 on a row block of at most :data:`CHUNK_ELEMENTS` elements at a time
(one m' × n fp32 temporary, plus int64 random bits for ``stochastic``), never a model-sized one.
fp32 and fp64 weights ignore the mode: W ← update(W) in place, bit for bit today's fp32 path.
"""

from __future__ import annotations

from typing import Optional

import torch

MASTERS = ("fp32", "kahan", "stochastic", "none")
BUFFERED = {"fp32": "master", "kahan": "compensation"}  # mode -> the buffer it keeps beside W
CHUNK_ELEMENTS = 1 << 22  # elements per row block of the merge (16 MiB of fp32 temporary)
_M32 = 0xFFFFFFFF
_SALT = 0x5F3759DF  # keeps the rounding bits apart from anything else hashed from (seed, step, layer)


def full_precision(t: torch.Tensor) -> bool:
    """fp32/fp64 tensors take every update exactly as computed; no mode applies."""
    return t.dtype in (torch.float32, torch.float64)


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the update is computed in: the weight's own when full precision, else fp32."""
    return weight.dtype if full_precision(weight) else torch.float32


def new_buffer(weight: torch.Tensor, master: str) -> Optional[torch.Tensor]:
    """The buffer ``master`` keeps beside a low-precision weight (fp32 copy, or zero compensation), or None."""
    if master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    if full_precision(weight) or master not in BUFFERED:
        return None
    return weight.detach().float().clone() if master == "fp32" else torch.zeros_like(weight)


def low_rank_update_(target: torch.Tensor, left: torch.Tensor, right: torch.Tensor, decay: float = 0.0,
                     decay_first: bool = True) -> None:
    """target ← (1 − λ)·target + L A (``decay_first``), or target ← (target + L A)·(1 − λ), in place."""
    if decay and decay_first:
        target.mul_(1 - decay)
    target.addmm_(left.to(target.dtype), right.to(target.dtype))
    if decay and not decay_first:
        target.add_(target, alpha=-decay)


def merge_lowrank_(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, decay: float = 0.0,
                   decay_first: bool = True, master: str = "fp32", buffer: Optional[torch.Tensor] = None,
                   key: int = 0, offset: int = 0) -> None:
    """Apply W ← update(W) to ``weight`` (m × n, this rank's rows) in precision mode ``master``.

    ``buffer``: the mode's buffer (fp32 master / bf16 compensation, from :func:`new_buffer`);
    ``key``: :func:`round_key` of the update (``stochastic``); ``offset``: the global index of
    ``weight``'s first element (a row shard), so the rounding bits do not depend on the sharding.
    """
    if full_precision(weight):
        low_rank_update_(weight, left, right, decay, decay_first)
        return
    if master in BUFFERED and buffer is None:
        raise ValueError(f"master={master!r} needs its {BUFFERED[master]} buffer for a {weight.dtype} weight")
    if master == "fp32":
        low_rank_update_(buffer, left, right, decay, decay_first)
        weight.copy_(buffer)
        return
    if master == "stochastic" and weight.dtype != torch.bfloat16:
        raise ValueError(f"master='stochastic' rounds to bf16; the weight is {weight.dtype}")
    if master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    m, n = weight.shape
    rows = max(1, CHUNK_ELEMENTS // max(n, 1))
    for i in range(0, m, rows):
        w = weight[i : i + rows]
        exact = w.float()
        if master == "kahan":
            exact += buffer[i : i + rows].float()
        low_rank_update_(exact, left[i : i + rows], right, decay, decay_first)
        w.copy_(stochastic_round_bf16(exact, key, offset + i * n) if master == "stochastic" else exact)
        if master == "kahan":
            buffer[i : i + rows].copy_(exact.sub_(w.float()))  # the part of X that W could not hold


def merge_lowrank_block_(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, decay: float = 0.0,
                         decay_first: bool = True, master: str = "fp32", buffer: Optional[torch.Tensor] = None,
                         key: int = 0, row0: int = 0, col0: int = 0, width: Optional[int] = None) -> None:
    """:func:`merge_lowrank_` on a block of a bigger weight: ``weight`` (m' × n') holds rows
    [row0, row0 + m') and columns [col0, col0 + n') of a global m × ``width`` tensor; ``left`` is its
    rows of L (m' × r) and ``right`` its columns of A (r × n'); ``buffer`` the block of the mode's buffer.

    The result is the same block of the whole merge, bit for bit:

    * element (i, j) is global element g = (row0 + i)·width + col0 + j, and the stochastic rounding
      draws its bits at g (:func:`stochastic_round_bf16_at`);
    * the product is formed at the whole tensor's width: the block's columns are placed at their global
      positions in an m'' × width fp32 temporary (and A's columns in an r × width zero matrix), and the
      same ``addmm_`` as the whole merge runs on it. BLAS picks its kernel by shape, and a product of
      width n' can round differently from the same columns of the width-``width`` one (seen on CPU at
      n' = width / 4); an entry never depends on the values of other columns, so the zeros change nothing.

    A block of whole rows (col0 = 0, n' = width) is :func:`merge_lowrank_` with ``offset = row0·width``
    (a row-sharded weight, as under FSDP2). Rows are merged in blocks of at most
    :data:`CHUNK_ELEMENTS` // width: the temporary is the same size as the whole merge's.
    """
    m, n = weight.shape
    width = n if width is None else width
    if col0 == 0 and n == width:
        merge_lowrank_(weight, left, right, decay, decay_first, master, buffer, key, row0 * width)
        return
    if master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    full = full_precision(weight)
    if not full and master in BUFFERED and buffer is None:
        raise ValueError(f"master={master!r} needs its {BUFFERED[master]} buffer for a {weight.dtype} weight")
    if not full and master == "stochastic" and weight.dtype != torch.bfloat16:
        raise ValueError(f"master='stochastic' rounds to bf16; the weight is {weight.dtype}")
    c1 = col0 + n
    dtype = weight.dtype if full else torch.float32
    wide = torch.zeros(right.shape[0], width, dtype=right.dtype, device=right.device)
    wide[:, col0:c1] = right
    rows = max(1, CHUNK_ELEMENTS // max(width, 1))
    cols = torch.arange(col0, c1, dtype=torch.int64, device=weight.device)
    for i in range(0, m, rows):
        w = weight[i : i + rows]
        tmp = torch.zeros(w.shape[0], width, dtype=dtype, device=weight.device)
        x = tmp[:, col0:c1]
        if full:
            x.copy_(w)
        elif master == "fp32":
            x.copy_(buffer[i : i + rows])
        else:
            x.copy_(w)
            if master == "kahan":
                x += buffer[i : i + rows].float()
        low_rank_update_(tmp, left[i : i + rows], wide, decay, decay_first)
        if full:
            w.copy_(x)
        elif master == "fp32":
            buffer[i : i + rows].copy_(x)
            w.copy_(x)
        elif master == "stochastic":
            index = torch.arange(row0 + i, row0 + i + w.shape[0], dtype=torch.int64, device=weight.device)
            w.copy_(stochastic_round_bf16_at(x, key, index[:, None] * width + cols))
        else:
            w.copy_(x)
            if master == "kahan":
                buffer[i : i + rows].copy_(x.sub_(w.float()))

# ---- counter-based random bits -------------------------------------------------------------------
def _mix_int(x: int) -> int:
    """A 32-bit integer hash (the xorshift-multiply finalizer of :func:`_mix`), on a Python int."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix_int` elementwise on an int64 tensor of values in [0, 2³²), in place.

    Multipliers below 2³¹ keep every product under 2⁶³: no signed overflow, so CPU and CUDA agree."""
    x.bitwise_xor_(x >> 16)
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x31848BAB).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def round_key(seed: int, step: int, layer: int) -> int:
    """The 32-bit key of one update's rounding bits: a hash of (seed, step, layer)."""
    k = _mix_int(_SALT ^ (seed & _M32) ^ (seed >> 32))
    k = _mix_int(k ^ (step & _M32))
    return _mix_int(k ^ (layer & _M32))


def random_bits16(numel: int, key: int, offset: int = 0, device=None) -> torch.Tensor:
    """16 random bits (int32 in [0, 2¹⁶)) for elements ``offset … offset + numel − 1`` under ``key``:
    bits_i = high half of mix(mix(i ⊕ key) ⊕ key'), a pure function of (key, i)."""
    idx = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    idx.bitwise_and_(_M32).bitwise_xor_(key & _M32)
    h = _mix(_mix(idx).bitwise_xor_(_mix_int(key ^ 0x9E3779B9)))
    return (h >> 16).to(torch.int32)


def stochastic_round_bf16(x: torch.Tensor, key: int, offset: int = 0) -> torch.Tensor:
    """bf16 of fp32 ``x`` rounded stochastically: to the neighbour above |x| with probability
    (|x| − lo)/(hi − lo), else below, so E[result] = x.

    bf16 is the upper half of an fp32 bit pattern: adding a uniform 16-bit integer to the pattern's
    lower half and truncating carries into the upper half exactly with that probability (for either
    sign, the pattern being sign and magnitude). ±inf stays; NaN stays NaN.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_bf16 takes fp32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32) + random_bits16(x.numel(), key, offset, x.device).view(x.shape)
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def random_bits16_at(index: torch.Tensor, key: int) -> torch.Tensor:
    """:func:`random_bits16` at explicit element indices (an int64 tensor of any shape): the bits of
    element i are the same whichever block of the tensor asks for them."""
    idx = index.to(torch.int64).clone()
    idx.bitwise_and_(_M32).bitwise_xor_(key & _M32)
    h = _mix(_mix(idx).bitwise_xor_(_mix_int(key ^ 0x9E3779B9)))
    return (h >> 16).to(torch.int32)


def stochastic_round_bf16_at(x: torch.Tensor, key: int, index: torch.Tensor) -> torch.Tensor:
    """:func:`stochastic_round_bf16` of fp32 ``x`` with the bits of elements ``index`` (x's shape)."""
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_bf16_at takes fp32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32) + random_bits16_at(index.expand(x.shape), key)
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
