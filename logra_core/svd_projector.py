"""The ``projection: svd`` variant: GaLore's fixed top-r gradient subspace (Zhao et al., 2024).

Every ``refresh_every`` steps the layer's gradient G (m × n) is formed once and decomposed,
G = U Σ Vᵀ. For m ≥ n the subspace is the top-r right singular vectors P = V[:, :r]ᵀ (r × n) and
the layer sketches R = G Pᵀ (m × r) — the same "right" sketch as LoGRA's, with P in place of the
random A; for m < n it is the top-r left singular vectors U_r (m × r) and the layer sketches
L = U_rᵀ G (r × n) from its saved input ("left" mode). Between refreshes no dense gradient exists.
Adam runs element-wise in the r-dimensional space and the normalized step is projected back
(N P on the right, U_r N on the left) and scaled by ``scale`` — GaLoreAdamW's update, step for step.

At a refresh the Adam moments live in the old subspace: ``keep`` leaves them (GaLore's choice),
``reset`` zeroes them, ``rotate`` maps the first moment into the new basis with
R = P_old P_newᵀ (right) or U_newᵀ U_old (left), and the second moment with R∘R (a common
approximation: exact only when R is a permutation).
"""

from __future__ import annotations

import torch

MOMENTS = ("keep", "reset", "rotate")


class SVDProjector:
    def __init__(self, shape: torch.Size, rank: int):
        self.rows, self.cols = shape
        self.rank = rank
        self.side = "right" if self.rows >= self.cols else "left"
        self.basis: torch.Tensor | None = None  # P (r × n) or U_r (m × r)

    def refresh(self, grad: torch.Tensor) -> torch.Tensor | None:
        """New basis from the dense gradient; returns the old one (or None at the first refresh)."""
        old = self.basis
        u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
        basis = vh[: self.rank] if self.side == "right" else u[:, : self.rank]
        # a compact copy in the factor's own (LAPACK column-major) layout: GaLore multiplies with a view of
        # the factor, and the same operand layout makes the same BLAS call, hence the same rounding
        self.basis = basis.t().contiguous().t() if basis.stride(0) < basis.stride(1) else basis.contiguous()
        return old

    def project(self, grad: torch.Tensor) -> torch.Tensor:
        return grad @ self.basis.t() if self.side == "right" else self.basis.t() @ grad

    def apply(self, weight: torch.Tensor, normalized: torch.Tensor, alpha: float) -> None:
        """weight += alpha · (project-back of ``normalized``), in place, without a weight-sized temporary."""
        n = normalized.to(weight.dtype)
        b = self.basis.to(weight.dtype)
        if self.side == "right":
            weight.addmm_(n, b, alpha=alpha)
        else:
            weight.addmm_(b, n, alpha=alpha)

    def rotation(self, old: torch.Tensor) -> torch.Tensor:
        """R that maps coordinates in the old subspace to the new one."""
        return old @ self.basis.t() if self.side == "right" else self.basis.t() @ old

    def carry_moments(self, policy: str, old: torch.Tensor | None, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if old is None or policy == "keep":
            return
        if policy == "reset":
            exp_avg.zero_()
            exp_avg_sq.zero_()
            return
        r = self.rotation(old)
        if self.side == "right":  # moments are m × r: coordinates along columns
            exp_avg.copy_(exp_avg @ r)
            exp_avg_sq.copy_(exp_avg_sq @ r.square())
        else:  # moments are r × n: coordinates along rows
            exp_avg.copy_(r @ exp_avg)
            exp_avg_sq.copy_(r.square() @ exp_avg_sq)
