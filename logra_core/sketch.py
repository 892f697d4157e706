"""Gradient sketches of linear layers: S = G Aᵀ without ever forming the dense gradient G.

For a linear layer y = x Wᵀ + b with W ∈ R^{m×n} (m = out_features rows, n = in_features), input
X (tokens × n) and output gradient H (tokens × m), the weight gradient is G = Hᵀ X (m × n). With a
random projection A ∈ R^{r×n} (r ≪ n) the sketch is

    S = G Aᵀ = Hᵀ (X Aᵀ)      (m × r),

so backward only needs the projected input X Aᵀ (tokens × r), saved in forward instead of X.
Because A is fixed within a step, S accumulates exactly over micro-batches: Σᵢ Gᵢ Aᵀ = (Σᵢ Gᵢ) Aᵀ.
With E[Aᵀ A] = I (Rademacher or Gaussian entries of variance 1/r) the projected-back sketch is
unbiased, E_A[S A] = G E[Aᵀ A] = G, and so is ‖S‖² for ‖G‖². The optimizer's step D A is not an
unbiased estimate of anything dense: D normalises each row of S (at t = 1, D_i = √r·S_i/‖S_i‖₂,
:mod:`logra_core.optimizer`), so a row of D A has norm ≈ √n, of which only ≈ √r lies along the
gradient row (the rest spreads over A's random r-dimensional row space); in expectation it is
about √(r/n) times a dense row-normalised step (docs/design.md §3.1, "Learning rates").

A is never stored: Philox-4x32-10, a counter-based generator keyed by the seed with (element block,
layer, step) as the counter, regenerates the same bits on any device and in any process, so a
rollout engine can rebuild it from three integers; distinct (layer, step) never share a stream.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

_M32 = 0xFFFFFFFF
DEFAULT_TARGETS = (r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$",)

# Philox-4x32-10 (Salmon, Moraes, Dror & Shaw, 2011, "Parallel random numbers: as easy as 1, 2, 3"):
# multipliers and Weyl key increments of the Random123 reference.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(counter: tuple, key: tuple[int, int], rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox-4x32: four 32-bit words out per 128-bit counter (c0, c1, c2, c3) under a 64-bit key.

    ``counter``: four int64 tensors (broadcastable) or ints holding values in [0, 2³²); ``key``:
    two ints in [0, 2³²). Each round, with (hiₖ, loₖ) the 64-bit product Mₖ·c split in halves,

        (c0, c1, c2, c3) ← (hi₁ ⊕ c1 ⊕ k0,  lo₁,  hi₀ ⊕ c3 ⊕ k1,  lo₀),   hi₀,lo₀ = M₀·c0,  hi₁,lo₁ = M₁·c2,

    and the key advances by the Weyl constants. For a fixed key it is a bijection of the counter,
    so distinct counters never give a shared stream. Products of two 32-bit values wrap modulo 2⁶⁴ in
    int64 identically on every device and the masked halves are exact: the same bits on CPU and CUDA.
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]
        c0, c1, c2, c3 = ((p1 >> 32) & _M32) ^ c1 ^ k0, p1 & _M32, ((p0 >> 32) & _M32) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def projection_words(n: int, seed: int, layer: int, step: int, device=None) -> torch.Tensor:
    """The n 32-bit words (int64 tensor) a projection is built from: Philox-4x32-10 with key = seed
    and counter = (block, layer, step, 0), four words per block. Every (layer, step) has its own
    counters, so no two projections of a run share a word sequence."""
    for name, v, limit in (("seed", seed, 2**64), ("layer", layer, 2**32), ("step", step, 2**32)):
        if not 0 <= v < limit:
            raise ValueError(f"{name} must be in [0, {limit}), got {v}")
    blocks = torch.arange(-(-n // 4), dtype=torch.int64, device=device)
    words = philox4x32((blocks, layer, step, 0), (seed & _M32, seed >> 32))
    return torch.stack(words, dim=1).reshape(-1)[:n]


def projection(rows: int, cols: int, seed: int, layer: int, step: int, kind: str = "rademacher",
               device=None, dtype=torch.float32) -> torch.Tensor:
    """A ∈ R^{rows×cols} with E[Aᵀ A] = I, a pure function of (seed, layer, step).

    rademacher: entries ±1/√rows, one bit each: entry i is bit i mod 32 of word ⌊i/32⌋ (every bit of a
    Philox word is uniform and independent, so one word serves 32 signs: 32× fewer Philox rounds than
    a word per sign). gaussian: N(0, 1/rows) by Box–Muller from two 24-bit uniforms per entry (words i
    and n + i). Words: :func:`projection_words`.
    """
    n = rows * cols
    if kind == "rademacher":
        words = projection_words(-(-n // 32), seed, layer, step, device)
        shifts = torch.arange(32, dtype=torch.int64, device=words.device)
        bits = ((words.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n]  # 0 or 1
        a = (1.0 - 2.0 * bits.to(torch.float32)) / math.sqrt(rows)
    elif kind == "gaussian":
        u = projection_words(2 * n, seed, layer, step, device) >> 8  # 24-bit uniforms
        u1 = (u[:n].to(torch.float64) + 0.5) / 2**24
        u2 = (u[n:].to(torch.float64) + 0.5) / 2**24
        a = (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2) / math.sqrt(rows)).to(torch.float32)
    else:
        raise ValueError(f"unknown projection kind {kind!r}: rademacher | gaussian")
    return a.view(rows, cols).to(dtype)


@dataclass
class SketchState:
    """What one sketched layer carries: its identity, the current A, and the accumulating sketch."""

    layer: int  # index of the layer among the sketched ones (part of A's seed)
    rank: int  # r
    seed: int = 0
    kind: str = "rademacher"
    step: int = 0  # the optimizer step A belongs to; set by the optimizer
    sketch: Optional[torch.Tensor] = None  # S (m × r), fp32, accumulated over micro-batches
    basis: Optional[torch.Tensor] = None  # A (r × n); cached for the current step only
    basis_step: int = -1
    fixed_basis: Optional[torch.Tensor] = None  # a given A that overrides the hashed one (tests, fixed-subspace variants)
    # What backward accumulates into ``sketch`` (the svd variant switches it per step):
    #   "right": S = G Aᵀ (m × r) from the saved X Aᵀ — the default, no dense gradient;
    #   "left":  S = Uᵀ G (r × n) = (H U)ᵀ X with U = fixed_basis (m × r), from the saved X;
    #   "dense": S = G (m × n) — only at the svd variant's refresh steps, to take its SVD.
    mode: str = "right"

    def projection(self, cols: int, device) -> torch.Tensor:
        if self.fixed_basis is not None:
            return self.fixed_basis
        if self.basis is None or self.basis_step != self.step or self.basis.device != torch.device(device):
            self.basis = projection(self.rank, cols, self.seed, self.layer, self.step, self.kind, device=device)
            self.basis_step = self.step
        return self.basis


class _SketchedLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b; backward: dx = H W, db = Σ H, the sketch grows (see ``SketchState.mode``),
    and W gets no gradient. In the default "right" mode only X Aᵀ (tokens × r) is saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, basis, state: SketchState):
        ctx.state, ctx.mode = state, state.mode
        x2 = x.reshape(-1, x.shape[-1])
        saved = x2.to(basis.dtype) @ basis.t() if state.mode == "right" else x2  # tokens × r, or tokens × n
        ctx.save_for_backward(saved, weight, basis)
        ctx.has_bias = bias is not None
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        saved, weight, basis = ctx.saved_tensors
        h = grad_out.reshape(-1, grad_out.shape[-1])  # tokens × m
        if ctx.mode == "right":
            contribution = h.t().to(saved.dtype) @ saved  # Hᵀ (X Aᵀ): m × r
        elif ctx.mode == "left":
            contribution = (h.to(basis.dtype) @ basis).t() @ saved.to(basis.dtype)  # (H U)ᵀ X: r × n
        else:
            contribution = h.t().float() @ saved.float()  # the dense G: m × n
        state = ctx.state
        if state.sketch is None:
            state.sketch = contribution.float()
        else:
            state.sketch.add_(contribution)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_b = h.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None, None


class SketchedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient is sketched. Same parameters, same checkpoint keys.

    Installed by switching the class of an existing module (:func:`install`), so the parameter
    objects, their names and any hooks stay as they were.
    """

    sketch_state: SketchState

    def forward(self, x):
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return nn.functional.linear(x, self.weight, self.bias)
        state = self.sketch_state
        basis = state.projection(self.in_features, self.weight.device) if state.mode != "dense" else self.weight.new_empty(0, 0)
        return _SketchedLinearFn.apply(x, self.weight, self.bias, basis, self.sketch_state)


def select_linears(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> list[tuple[str, nn.Linear]]:
    """``(name, module)`` of every ``nn.Linear`` whose name matches one of the regexes ``targets``."""
    patterns = [re.compile(t) for t in targets]
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(p.search(n) for p in patterns)]


class _SketchedEmbeddingFn(torch.autograd.Function):
    """out = W[ids]; backward: S[v] += Σ_{t: ids_t = v} (∂L/∂out_t) Aᵀ, and no gradient for W.

    The dense embedding gradient G (V × d) has row v = Σ_{t: ids_t = v} ∂L/∂out_t, so this is
    exactly S = G Aᵀ (V × r), scattered from the (tokens × r) projected output gradient. As in
    ``nn.Embedding``, the row ``padding_idx`` (when set) receives nothing from the lookup.
    """

    @staticmethod
    def forward(ctx, ids, weight, basis, state: SketchState, padding_idx):
        ctx.save_for_backward(ids, basis)
        ctx.state, ctx.num_rows, ctx.padding_idx = state, weight.shape[0], padding_idx
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        ids, basis = ctx.saved_tensors
        state = ctx.state
        projected = grad_out.reshape(-1, grad_out.shape[-1]).to(basis.dtype) @ basis.t()  # tokens × r
        if ctx.padding_idx is not None:
            projected = projected.masked_fill((ids.reshape(-1) == ctx.padding_idx).unsqueeze(1), 0.0)
        if state.sketch is None:
            state.sketch = torch.zeros(ctx.num_rows, basis.shape[0], dtype=torch.float32, device=basis.device)
        state.sketch.index_add_(0, ids.reshape(-1), projected.float())
        return None, None, None, None, None


class SketchedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight gradient is sketched (and so is a tied LM head's)."""

    sketch_state: SketchState

    def forward(self, ids):
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return nn.functional.embedding(ids, self.weight, self.padding_idx)
        basis = self.sketch_state.projection(self.embedding_dim, self.weight.device)
        return _SketchedEmbeddingFn.apply(ids, self.weight, basis, self.sketch_state, self.padding_idx)


def _attach(module: nn.Module, cls: type, state: SketchState) -> None:
    module.__class__ = cls
    module.sketch_state = state
    module.weight.sketch_state = state  # found by code that sees only the weight (the chunked head)


def install(model: nn.Module, rank: int, seed: int = 0, targets: Iterable[str] = DEFAULT_TARGETS,
            kind: str = "rademacher", embeddings: bool = False) -> dict[str, nn.Module]:
    """Sketch the selected linears of ``model`` (and its input embedding with ``embeddings``).

    Returns the sketched modules by name. Modules change class in place (:class:`SketchedLinear`,
    :class:`SketchedEmbedding`), so parameters, names and checkpoint keys stay as they were. An LM
    head tied to the embedding shares the embedding's sketch state (one V × r sketch receives
    both gradients); it is sketched exactly when the embedding is. A rank above a layer's input
    width is refused.
    """
    emb = model.get_input_embeddings() if embeddings else None
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    chosen = []
    for name, module in select_linears(model, targets):
        if id(module.weight) in embedding_weights:
            if embeddings:
                continue  # a tied head: sketched with the embedding below
            raise ValueError(f"{name} shares its weight with an embedding (tied): sketch it with embeddings=True")
        chosen.append((name, module))
    if not chosen and emb is None:
        raise ValueError(f"no nn.Linear in the model matches targets {list(targets)}")
    out = {}
    for layer, (name, module) in enumerate(chosen):
        if rank > module.in_features:
            raise ValueError(f"sketch rank {rank} exceeds {name}'s input width {module.in_features}")
        _attach(module, SketchedLinear, SketchState(layer=layer, rank=rank, seed=seed, kind=kind))
        out[name] = module
    if emb is not None:
        if rank > emb.embedding_dim:
            raise ValueError(f"sketch rank {rank} exceeds the embedding width {emb.embedding_dim}")
        state = SketchState(layer=len(chosen), rank=rank, seed=seed, kind=kind)
        names = {id(m): n for n, m in model.named_modules()}
        _attach(emb, SketchedEmbedding, state)
        out[names[id(emb)]] = emb
        for name, module in model.named_modules():  # a head tied to the embedding
            if isinstance(module, nn.Linear) and module.weight is emb.weight:
                _attach(module, SketchedLinear, state)
                out[name] = module
    return out
