"""Gradient sketches of linear layers: S = G Aᵀ without ever forming the dense gradient G.

For a linear layer y = x Wᵀ + b with W ∈ R^{m×n} (m = out_features rows, n = in_features), input
X (tokens × n) and output gradient H (tokens × m), the weight gradient is G = Hᵀ X (m × n). With a
random projection A ∈ R^{r×n} (r ≪ n) the sketch is

    S = G Aᵀ = Hᵀ (X Aᵀ)      (m × r),

so backward only needs the projected input X Aᵀ (tokens × r), saved in forward instead of X.
Because A is fixed within a step, S accumulates exactly over micro-batches: Σᵢ Gᵢ Aᵀ = (Σᵢ Gᵢ) Aᵀ.
With E[Aᵀ A] = I (Rademacher or Gaussian entries of variance 1/r) the update D A built from S is
an unbiased estimate of the one built from G (LoGRA paper; NVIDIA NeMo AutoModel "gradient
sketch" documentation).

A is never stored: a counter-based hash of (seed, layer, step, element index) regenerates the same
bits on any device and in any process, so a rollout engine can rebuild it from three integers.
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


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer on int64 tensors (or Python ints) holding values in [0, 2³²).

    Products wrap modulo 2⁶⁴ identically on every device; masking keeps the low 32 bits, which
    are exact, so the result is the same bit for bit on CPU and CUDA.
    """
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _key(*ints: int) -> int:
    """A 32-bit key from a few non-negative integers (the same finalizer on Python ints)."""
    h = 0x2545F491
    for v in ints:
        if v < 0:
            raise ValueError(f"seed, layer and step must be non-negative, got {v}")
        for word in (v & _M32, (v >> 32) & _M32):
            h = _fmix32((h * 0x9E3779B1 + word) & _M32)
    return h


def _hash_counter(key: int, n: int, device) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64, device=device)
    return _fmix32((i * 0x9E3779B1 + key) & _M32)


def projection(rows: int, cols: int, seed: int, layer: int, step: int, kind: str = "rademacher",
               device=None, dtype=torch.float32) -> torch.Tensor:
    """A ∈ R^{rows×cols} with E[Aᵀ A] = I, a pure function of (seed, layer, step).

    rademacher: entries ±1/√rows from one hash bit each. gaussian: N(0, 1/rows) by Box–Muller from
    two 24-bit uniforms per entry.
    """
    key = _key(seed, layer, step)
    n = rows * cols
    if kind == "rademacher":
        bits = _hash_counter(key, n, device) >> 31  # the top bit: 0 or 1
        a = (1.0 - 2.0 * bits.to(torch.float32)) / math.sqrt(rows)
    elif kind == "gaussian":
        u = _hash_counter(key, 2 * n, device) >> 8  # 24-bit uniforms
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

    def projection(self, cols: int, device) -> torch.Tensor:
        if self.fixed_basis is not None:
            return self.fixed_basis
        if self.basis is None or self.basis_step != self.step or self.basis.device != torch.device(device):
            self.basis = projection(self.rank, cols, self.seed, self.layer, self.step, self.kind, device=device)
            self.basis_step = self.step
        return self.basis


class _SketchedLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b; backward: dx = H W, S += Hᵀ (x Aᵀ), db = Σ H, and no gradient for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, basis, state: SketchState):
        ctx.state = state
        x_proj = x.reshape(-1, x.shape[-1]).to(basis.dtype) @ basis.t()  # tokens × r
        ctx.save_for_backward(x_proj, weight)
        ctx.has_bias = bias is not None
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_proj, weight = ctx.saved_tensors
        h = grad_out.reshape(-1, grad_out.shape[-1])  # tokens × m
        contribution = h.t().to(x_proj.dtype) @ x_proj  # m × r
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
        basis = self.sketch_state.projection(self.in_features, self.weight.device)
        return _SketchedLinearFn.apply(x, self.weight, self.bias, basis, self.sketch_state)


def select_linears(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> list[tuple[str, nn.Linear]]:
    """``(name, module)`` of every ``nn.Linear`` whose name matches one of the regexes ``targets``."""
    patterns = [re.compile(t) for t in targets]
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(p.search(n) for p in patterns)]


def install(model: nn.Module, rank: int, seed: int = 0, targets: Iterable[str] = DEFAULT_TARGETS,
            kind: str = "rademacher") -> dict[str, SketchedLinear]:
    """Turn the selected linears of ``model`` into :class:`SketchedLinear`; return them by name.

    Tied weights (an LM head sharing the embedding matrix) cannot be sketched: the embedding's
    gradient is dense anyway. A rank above a layer's input width is refused.
    """
    chosen = select_linears(model, targets)
    if not chosen:
        raise ValueError(f"no nn.Linear in the model matches targets {list(targets)}")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = {}
    for layer, (name, module) in enumerate(chosen):
        if id(module.weight) in embeddings:
            raise ValueError(f"{name} shares its weight with an embedding (tied); leave it out of logra targets")
        if rank > module.in_features:
            raise ValueError(f"sketch rank {rank} exceeds {name}'s input width {module.in_features}")
        module.__class__ = SketchedLinear
        module.sketch_state = SketchState(layer=layer, rank=rank, seed=seed, kind=kind)
        out[name] = module
    return out
