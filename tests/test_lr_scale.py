"""The first-step update scale behind the logra/dense learning-rate ratio (docs/design.md §3.1, "Learning rates"): per row,
torch AdamW's step has norm η√n and a component η‖g‖₁/‖g‖₂ along −g; LoGRA's has norm ≈ η√n and
a component ≈ η√r along −g."""

import math

import pytest
import torch
from torch import nn

from logra_core.optimizer import LoGRA

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n,r", [(576, 64), (576, 16), (1536, 64)])
def test_first_step_scale_per_row(n, r):
    torch.manual_seed(0)
    m = 64
    x, h = torch.randn(256, n), torch.randn(256, m)
    dense = nn.Linear(n, m, bias=False)
    wrap = nn.ModuleDict({"q_proj": nn.Linear(n, m, bias=False)})
    wrap["q_proj"].load_state_dict(dense.state_dict())
    w0 = dense.weight.detach().clone()
    adam = torch.optim.AdamW(dense.parameters(), lr=1.0, weight_decay=0.0)
    (dense(x) * h).sum().backward()
    g = dense.weight.grad.clone()
    adam.step()
    step_adam = dense.weight.detach() - w0
    opt = LoGRA(wrap, rank=r, lr=1.0, targets=[r"q_proj$"])
    (wrap["q_proj"](x) * h).sum().backward()
    opt.step()
    step_logra = wrap["q_proj"].weight.detach() - w0
    u = -g / g.norm(dim=1, keepdim=True)
    along = lambda d: (d * u).sum(1).mean().item()  # noqa: E731
    # Adam at t = 1: η·g/(|g| + ε) = η·sign(g): norm √n, along −g exactly ‖g‖₁/‖g‖₂ (per row)
    assert step_adam.norm(dim=1).mean().item() == pytest.approx(math.sqrt(n), rel=1e-4)
    assert along(step_adam) == pytest.approx((g.abs().sum(1) / g.norm(dim=1)).mean().item(), rel=1e-4)
    # LoGRA at t = 1: D_i = √r·S_i/‖S_i‖, row of D A: norm ≈ √n, along −g ≈ √r·‖S_i‖/‖g_i‖ ≈ √r
    assert step_logra.norm(dim=1).mean().item() == pytest.approx(math.sqrt(n), rel=0.1)
    assert along(step_logra) == pytest.approx(math.sqrt(r), rel=0.1)
