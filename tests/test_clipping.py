"""One global gradient-norm clip per method. logra: ‖S‖² over the sketches (E‖G Aᵀ‖² = ‖G‖² since
E[AᵀA] = I) plus the unsketched tensors' ‖g‖², one coefficient for both; galore and lora clip their own
trainable tensors by the same rule as dense."""

import copy

import pytest
import torch
import transformers
from torch import nn

from baselines.logra import LoGRAConfig, LoGRAMethod
from logra_core.sketch import SketchedLinear, SketchState, projection

pytestmark = pytest.mark.unit


def _tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def _loss(model):
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    return model(input_ids=ids).logits.float().sin().sum() * 3.0  # gradients well above max_grad_norm


def _orthogonal(n, seed):
    return torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))[0]


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_logra_clips_the_global_norm_of_sketches_and_dense_grads(max_grad_norm):
    """With square orthogonal projections (AᵀA = I exactly) ‖S‖ = ‖G‖, so logra's norm and clip
    coefficient must equal the ones torch computes from every dense gradient; the sketches are clipped."""
    dense = _tiny()
    model = copy.deepcopy(dense)
    _loss(dense).backward()
    grads = [p.grad for p in dense.parameters() if p.grad is not None]
    total = float(torch.nn.utils.get_total_norm(grads))
    method = LoGRAMethod(LoGRAConfig(rank=8, max_grad_norm=max_grad_norm))
    method.setup(model)
    for i, m in enumerate(method.optimizer.modules_by_name.values()):
        m.sketch_state.fixed_basis = _orthogonal(m.in_features, i)
    _loss(model).backward()
    sketches = {n: m.sketch_state.sketch.clone() for n, m in method.optimizer.modules_by_name.items()}
    dense_before = {id(p): p.grad.clone() for p in method.dense_params}
    stats = method.clip()
    assert stats["step/grad_norm"] == pytest.approx(total, rel=1e-5)
    coef = min(1.0, max_grad_norm / (total + 1e-6)) if max_grad_norm > 0 else 1.0
    assert total > 10 * max(max_grad_norm, 0.1)  # a case where the clip bites
    for n, m in method.optimizer.modules_by_name.items():
        torch.testing.assert_close(m.sketch_state.sketch, sketches[n] * coef)
    for p in method.dense_params:
        torch.testing.assert_close(p.grad, dense_before[id(p)] * coef)


def test_sketch_norm_is_an_unbiased_estimate_of_the_gradient_norm():
    """E_A ‖G Aᵀ‖² = ‖G‖² for Rademacher A with entries ±1/√r; 500 draws: standard error of the mean
    at most sqrt(2/(r·draws)) = 0.016 (0.05 allowed)."""
    torch.manual_seed(0)
    layer = nn.Linear(48, 12, bias=False)
    x = torch.randn(20, 48)
    (layer(x).sin().sum()).backward()
    G = layer.weight.grad
    ratios = [float((G @ projection(16, 48, 0, 0, step).t()).square().sum() / G.square().sum()) for step in range(500)]
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("name", ["dense", "galore", "lora"])
def test_other_methods_clip_their_trainable_tensors(name):
    """dense / galore / lora: the global norm of the gradients of their own trainable tensors."""
    from baselines import METHODS

    cls = METHODS[name]
    overrides = {"galore": dict(rank=4), "lora": dict(r=2)}.get(name, {})
    method = cls(cls.config_cls(max_grad_norm=1.0, **overrides))
    model = method.setup(_tiny())
    _loss(model).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.grad.clone() for p in params]
    total = float(torch.nn.utils.get_total_norm(before))
    stats = method.clip()
    assert stats["step/grad_norm"] == pytest.approx(total, rel=1e-6)
    coef = min(1.0, 1.0 / (total + 1e-6))
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g * coef)
