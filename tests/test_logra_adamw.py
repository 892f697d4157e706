"""LoGRA's AdamW for the tensors it does not sketch (embeddings, norms, biases) equals torch.optim.AdamW.

The reference is torch's own optimizer, stepped on copies of the same tensors with the same
gradients: bias correction (1 − β₁ᵗ, 1 − β₂ᵗ), decoupled weight decay W ← W − ηλW, over several
steps, for fp32 and with group options set apart from the sketched group's (dense_lr, dense_betas,
dense_weight_decay).
"""

import pytest
import torch
from torch import nn

from logra_core.optimizer import LoGRA

pytestmark = pytest.mark.unit
TARGETS = (r"^q_proj$",)


class Block(nn.Module):
    """An embedding, a norm with bias, one sketched projection and an unsketched linear with bias."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.q_proj = nn.Linear(6, 5, bias=False)   # sketched (TARGETS)
        self.head = nn.Linear(6, 7)                 # not a target: AdamW


def unsketched(model):
    return {n: p for n, p in model.named_parameters() if "q_proj" not in n}


@pytest.mark.parametrize("options", [
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=3e-3, weight_decay=0.0, dense_lr=5e-2, dense_betas=(0.8, 0.95), dense_weight_decay=0.3),
])
def test_adamw_of_unsketched_tensors_equals_torch_adamw(options):
    torch.manual_seed(0)
    ours = Block()
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in unsketched(ours).items()}
    opt = LoGRA(ours, rank=2, eps=1e-8, targets=TARGETS, **options)
    lr = options.get("dense_lr", options["lr"])
    wd = options.get("dense_weight_decay", options["weight_decay"])
    torch_opt = torch.optim.AdamW(list(ref.values()), lr=lr, betas=options.get("dense_betas", (0.9, 0.999)),
                                  eps=1e-8, weight_decay=wd, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for name, p in unsketched(ours).items():
            g = torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 1)  # gradients of changing scale
            p.grad, ref[name].grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
        opt.zero_grad()
        torch_opt.zero_grad()
        for name, p in unsketched(ours).items():
            torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{name} after step {step + 1}: {m}")


def test_the_check_can_fail():
    """Without bias correction the first AdamW step is (1 − β₁)/√(1 − β₂) ≈ 3.2× larger: caught."""
    torch.manual_seed(0)
    model = Block()
    before = model.norm.weight.detach().clone()
    opt = LoGRA(model, rank=2, lr=1e-2, targets=TARGETS)
    model.norm.weight.grad = torch.ones(6)
    opt.step()
    step = (model.norm.weight.detach() - before).abs()
    torch.testing.assert_close(step, torch.full((6,), 1e-2), rtol=1e-5, atol=0)  # bias-corrected: η·sign(g)
    assert not torch.allclose(step, torch.full((6,), 1e-2 * 0.1 / 0.001**0.5), rtol=1e-2)
