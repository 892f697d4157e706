"""Fused Triton kernel for the per-token second-order KL terms (docs/design.md §3.2); optional (needs triton).

For z = h Wᵀ (h: T × d, W: V × d) and δz = g₁ U₁ᵀ + g₂ U₂ᵀ (g_i: T × k_i, U_i: V × k_i; the second
pair optional), each program takes BLOCK_T tokens and streams the vocabulary in BLOCK_V tiles. A
tile's z and δz are computed in the kernel with ``tl.dot`` from h/W and g/U tiles and then dropped,
so no T × V tensor exists. The softmax is online: with the running max m, the per-token state is
the weight w = Σ_v e^{z_v − m}, the weighted mean μ = Σ_v e^{z_v − m} δz_v / w and the weighted sum
of squares M = Σ_v e^{z_v − m} (δz_v − μ)². A tile's (m', w', μ', M') merges in as (Chan et al.,
"Updating formulae and a pairwise algorithm for computing sample variances", 1979)

    a = e^{m − m*}, b = e^{m' − m*}, m* = max(m, m'),   Δμ = μ' − μ,
    w ← a w + b w',   μ ← μ + Δμ · b w' / w,   M ← a M + b M' + Δμ² · (a w)(b w') / w,

and the output is ½ M / w = ½ (Σ p δz² − (Σ p δz)²). Centring per tile, instead of accumulating
Σ e δz and Σ e δz², keeps the difference of two large sums out of fp32 (δz may share a big offset).

Runs on CUDA, and on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how CI checks it against :func:`logra_core.kl_predictor.kl_terms_reference`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_tiles(acc, a_ptr, s_at, s_ak, b_ptr, s_bv, s_bk, rows, cols, T, V, K,
               BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a[rows] b[cols]ᵀ for a: T × K, b: V × K, K in BLOCK_K steps (masked entries read as 0)."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * s_at + ks[None, :] * s_ak,
                    mask=(rows[:, None] < T) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + cols[None, :] * s_bv + ks[:, None] * s_bk,
                    mask=(cols[None, :] < V) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=PRECISION)
    return acc


@triton.jit
def _kl_terms_kernel(h_ptr, w_ptr, g1_ptr, u1_ptr, g2_ptr, u2_ptr, out_ptr, T, V, D, K1, K2,
                     s_ht, s_hd, s_wv, s_wd, s_g1t, s_g1k, s_u1v, s_u1k, s_g2t, s_g2k, s_u2v, s_u2k,
                     BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_K1: tl.constexpr, BLOCK_K2: tl.constexpr, TWO_PAIRS: tl.constexpr,
                     PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    w = tl.zeros((BLOCK_T,), tl.float32)
    mu = tl.zeros((BLOCK_T,), tl.float32)
    M = tl.zeros((BLOCK_T,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        z = _dot_tiles(z, h_ptr, s_ht, s_hd, w_ptr, s_wv, s_wd, rows, cols, T, V, D,
                       BLOCK_T, BLOCK_V, BLOCK_D, PRECISION)
        dz = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        dz = _dot_tiles(dz, g1_ptr, s_g1t, s_g1k, u1_ptr, s_u1v, s_u1k, rows, cols, T, V, K1,
                        BLOCK_T, BLOCK_V, BLOCK_K1, PRECISION)
        if TWO_PAIRS:
            dz = _dot_tiles(dz, g2_ptr, s_g2t, s_g2k, u2_ptr, s_u2v, s_u2k, rows, cols, T, V, K2,
                            BLOCK_T, BLOCK_V, BLOCK_K2, PRECISION)
        z = tl.where(cols[None, :] < V, z, float("-inf"))  # masked columns get weight e^{-inf} = 0
        m_tile = tl.max(z, axis=1)  # finite: every tile holds at least one real column
        e = tl.exp(z - m_tile[:, None])
        w_tile = tl.sum(e, axis=1)
        mu_tile = tl.sum(e * dz, axis=1) / w_tile
        c = dz - mu_tile[:, None]
        M_tile = tl.sum(e * c * c, axis=1)
        m_new = tl.maximum(m, m_tile)
        wa = w * tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
        wb = w_tile * tl.exp(m_tile - m_new)
        w_new = wa + wb
        d_mu = mu_tile - mu
        mu = mu + d_mu * (wb / w_new)
        M = M * tl.exp(m - m_new) + M_tile * tl.exp(m_tile - m_new) + d_mu * d_mu * (wa * wb / w_new)
        w, m = w_new, m_new
    tl.store(out_ptr + rows, 0.5 * M / w, mask=rows < T)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))  # tl.dot needs every dimension >= 16


def kl_terms_triton(h: torch.Tensor, W: torch.Tensor, g: Sequence[torch.Tensor], U: Sequence[torch.Tensor],
                    block_t: int = 32, block_v: int = 128) -> torch.Tensor:
    """Per-token ½(Σ_v p_v δz_v² − (Σ_v p_v δz_v)²) [T] (fp32), z = h Wᵀ, δz = Σ_i g_i U_iᵀ.

    h: T × d, W: V × d, g_i: T × k_i, U_i: V × k_i (fp32, fp16 or bf16; each token-side factor is
    cast to its weight's dtype). More than two (g, U) pairs are merged into two by concatenation.
    fp32 dots use 3×TF32 (about fp32 accuracy); 16-bit ones accumulate in fp32.
    """
    g, U = list(g), list(U)
    if len(g) > 2:  # δz = g₁U₁ᵀ + [g₂ … g_n][U₂ … U_n]ᵀ
        g, U = [g[0], torch.cat(g[1:], dim=1)], [U[0], torch.cat([u.to(U[1].dtype) for u in U[1:]], dim=1)]
    h = h.to(W.dtype)
    g = [gi.to(Ui.dtype) for gi, Ui in zip(g, U)]
    two = len(g) == 2
    g2, U2 = (g[1], U[1]) if two else (g[0], U[0])
    T, d = h.shape
    V = W.shape[0]
    out = torch.empty(T, dtype=torch.float32, device=h.device)
    precision = "ieee" if torch.version.hip else "tf32x3"
    grid = (triton.cdiv(T, block_t),)
    _kl_terms_kernel[grid](
        h, W, g[0], U[0], g2, U2, out, T, V, d, g[0].shape[1], g2.shape[1],
        h.stride(0), h.stride(1), W.stride(0), W.stride(1), g[0].stride(0), g[0].stride(1),
        U[0].stride(0), U[0].stride(1), g2.stride(0), g2.stride(1), U2.stride(0), U2.stride(1),
        BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_D=_block(d, 64), BLOCK_K1=_block(g[0].shape[1], 64),
        BLOCK_K2=_block(g2.shape[1], 64), TWO_PAIRS=two, PRECISION=precision)
    return out
