"""Tier 1 for logra_core.sketch: the sketch equals G Aᵀ, accumulates, and A is reproducible."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from logra_core.sketch import SketchedLinear, SketchState, install, projection
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def _layer(m, n, bias, dtype, seed):
    torch.manual_seed(seed)
    return nn.Linear(n, m, bias=bias).to(dtype)


@pytest.mark.parametrize("m,n,r", [(8, 16, 4), (24, 12, 12), (5, 40, 7)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", ["2d", "3d"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sketch_equals_dense_gradient_times_A_transpose(m, n, r, bias, shape, seed, dtype):
    dense = _layer(m, n, bias, dtype, seed)
    sk = _layer(m, n, bias, dtype, seed)
    sk.__class__ = SketchedLinear
    sk.sketch_state = SketchState(layer=3, rank=r, seed=seed)
    x = torch.randn(*((2, 5, n) if shape == "3d" else (7, n)), generator=torch.Generator().manual_seed(seed + 10)).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (dense(x1).float().sin().sum()).backward()
    (sk(x2).float().sin().sum()).backward()
    A = projection(r, n, seed, 3, 0)
    expected = dense.weight.grad.float() @ A.t()
    # fp32: 1e-5 relative to the sketch's scale (an entry that nearly cancels keeps the fp32 rounding of
    # its summands, summed in another order); bf16: the dense reference itself is rounded to 8 bits
    scale = float(expected.abs().max())
    tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(sk.sketch_state.sketch, expected, **tol)
    assert sk.weight.grad is None
    torch.testing.assert_close(x2.grad, x1.grad)  # input gradient unchanged
    if bias:
        torch.testing.assert_close(sk.bias.grad, dense.bias.grad)


def test_accumulation_over_four_micro_batches_equals_whole_batch():
    sk = _layer(12, 20, True, torch.float32, 0)
    install(nn.ModuleDict({"q_proj": sk}), rank=6, targets=[r"q_proj$"])
    x = torch.randn(16, 20)
    sk(x).pow(2).sum().backward()
    whole = sk.sketch_state.sketch.clone()
    sk.sketch_state.sketch = None
    for chunk in x.chunk(4):
        sk(chunk).pow(2).sum().backward()
    torch.testing.assert_close(sk.sketch_state.sketch, whole, rtol=1e-5, atol=1e-5)


def test_projection_is_reproducible_and_seeded():
    a = projection(16, 100, seed=3, layer=2, step=5)
    assert torch.equal(a, projection(16, 100, seed=3, layer=2, step=5))
    for other in [dict(seed=4, layer=2, step=5), dict(seed=3, layer=1, step=5), dict(seed=3, layer=2, step=6)]:
        assert not torch.equal(a, projection(16, 100, **other))
    assert set((a * 4).unique().tolist()) == {-1.0, 1.0}  # ±1/√16


@pytest.mark.integration
def test_projection_identical_in_another_process():
    code = ("import torch, sys; from logra_core.sketch import projection; "
            "a = projection(8, 50, 11, 7, 123); sys.stdout.write(','.join(str(int(v)) for v in (a > 0).flatten().tolist()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    here = ",".join(str(int(v)) for v in (projection(8, 50, 11, 7, 123) > 0).flatten().tolist())
    assert out == here


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_mean_of_AtA_is_identity(kind):
    # expected relative error sqrt((n - 1) / (r · draws)) ≈ 0.031 (Rademacher), 0.032 (Gaussian)
    n, r, draws = 32, 16, 2000
    acc = torch.zeros(n, n, dtype=torch.float64)
    for step in range(draws):
        a = projection(r, n, seed=0, layer=0, step=step, kind=kind).double()
        acc += a.t() @ a
    mean = acc / draws
    rel = torch.linalg.norm(mean - torch.eye(n, dtype=torch.float64)) / torch.linalg.norm(torch.eye(n, dtype=torch.float64))
    assert rel < 0.05, rel


@pytest.mark.integration
def test_install_selects_by_name_and_keeps_keys():
    from experiments.rl.models import ModelConfig, load_model

    model, _ = load_model(ModelConfig(name="tiny-llama"))
    keys = list(model.state_dict())
    chosen = install(model, rank=8)
    assert len(chosen) == 2 * 7  # 2 layers × q,k,v,o,gate,up,down
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="exceeds"):
        install(load_model(ModelConfig(name="tiny-llama"))[0], rank=1000)


@pytest.mark.parametrize("padding_idx", [2, None])
def test_sketched_embedding_gives_padding_row_no_gradient(padding_idx):
    """nn.Embedding leaves row padding_idx without gradient; the sketch must too: S = G Aᵀ with the
    dense embedding's G, on a batch where the pad id appears several times."""
    torch.manual_seed(0)
    dense = nn.Embedding(10, 16, padding_idx=padding_idx)
    sk = nn.Embedding(10, 16, padding_idx=padding_idx)
    sk.load_state_dict(dense.state_dict())
    wrapper = nn.Module()
    wrapper.embed = sk
    wrapper.get_input_embeddings = lambda: sk
    install(wrapper, rank=4, targets=[r"^$"], embeddings=True)
    ids = torch.tensor([[2, 5, 2, 7], [1, 2, 2, 9]])
    weights = torch.randn(2, 4, 16)
    (dense(ids) * weights).sum().backward()
    (sk(ids) * weights).sum().backward()
    A = projection(4, 16, 0, sk.sketch_state.layer, 0)
    torch.testing.assert_close(sk.sketch_state.sketch, dense.weight.grad @ A.t(), rtol=1e-5, atol=1e-6)
    if padding_idx is not None:
        assert dense.weight.grad[padding_idx].abs().sum() == 0
