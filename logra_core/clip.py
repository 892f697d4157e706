"""One global gradient-norm clip over sketches and dense gradients.

A sketched weight has no gradient G, only S = G Aᵀ. With E[AᵀA] = I (:mod:`logra_core.sketch`),

    E_A ‖S‖²_F = tr(G E[AᵀA] Gᵀ) = ‖G‖²_F,

so ‖S‖² is an unbiased estimate of ‖G‖² (its relative spread is about √(2/r) per matrix, less over
many). The global norm is estimated as

    N = √( Σ_sketched ‖S‖² + Σ_dense ‖g‖² )

and, as ``torch.nn.utils.clip_grad_norm_`` does, every sketch and every dense gradient is multiplied
by one coefficient c = min(1, max_norm / (N + 10⁻⁶)). On the svd variant's refresh steps S is G
itself (exact); between refreshes S = Uᵀ G with orthonormal U, the norm of the projected gradient.

A row-sharded weight's sketch (FSDP) holds this rank's rows: their squares are summed over the
weight's device mesh; DTensor dense gradients are reduced by ``get_total_norm``.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from logra_core.distributed import local_rows


def _sq_norm(s: torch.Tensor) -> torch.Tensor:
    """‖s‖² as a float64 scalar, from one reduction over s (no temporary of s's size: a sketched
    embedding's S is vocabulary × r)."""
    return torch.linalg.vector_norm(s).double().square()


def sketch_sq_norm(weights_and_sketches: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> torch.Tensor:
    """Σ ‖S‖² over (weight, sketch) pairs, each row counted once across the ranks of a sharded weight."""
    total = torch.zeros((), dtype=torch.float64)
    sharded: dict = {}  # device mesh -> this rank's sum of its rows' squares
    for w, s in weights_and_sketches:
        if s is None:
            continue
        rows = local_rows(w)
        if rows is None:
            total += _sq_norm(s).cpu()
            continue
        if s.shape[0] == w.shape[0] and rows != slice(0, w.shape[0]):
            s = s[rows]  # a whole sketch on every rank: this rank's rows only
        mesh = w.device_mesh
        sharded[mesh] = sharded.get(mesh, 0.0) + _sq_norm(s)
    for mesh, part in sharded.items():
        part = torch.as_tensor(part, dtype=torch.float64, device=mesh.device_type)
        dist.all_reduce(part, group=mesh.get_group())
        total += part.cpu()
    return total


def clip_sketches_and_grads(weights_and_sketches: list[tuple[torch.Tensor, Optional[torch.Tensor]]],
                            dense_params: list[torch.Tensor], max_norm: float) -> float:
    """Scale every sketch and every ``.grad`` of ``dense_params`` by c = min(1, max_norm / (N + 1e-6)),
    N the estimated global norm above (max_norm ≤ 0: no clipping); returns N before clipping."""
    grads = [p.grad for p in dense_params if p.grad is not None]
    sq = sketch_sq_norm(weights_and_sketches)
    if grads:
        g = torch.nn.utils.get_total_norm(grads, 2.0)
        g = g.full_tensor() if isinstance(g, DTensor) else g
        sq = sq + g.double().cpu().square()
    norm = float(sq.sqrt())
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for _, s in weights_and_sketches:
                if s is not None:
                    s.mul_(coef)
            for g in grads:
                g.mul_(coef)
    return norm
