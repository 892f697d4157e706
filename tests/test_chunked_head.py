"""The chunked LM-head log-probs equal the plain ones; sketched embeddings (tied head) equal G Aᵀ."""

import pytest
import torch

from experiments.rl.grpo import token_logprobs
from experiments.rl.models import ModelConfig, load_model
from logra_core.chunked_head import chunked_token_logprobs
from logra_core.sketch import install, projection

pytestmark = pytest.mark.integration


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_logprobs_and_grads_match_plain(chunk, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g)

    ref = token_logprobs(hidden @ weight.t(), targets)
    (ref * upstream).sum().backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    out = chunked_token_logprobs(hidden, weight, targets, chunk=chunk)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    (out * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["hf_logits", "chunked"])
def test_tied_embedding_sketch_equals_dense_gradient(path):
    dense, _ = load_model(ModelConfig(name="tiny-llama"))
    model, _ = load_model(ModelConfig(name="tiny-llama"))
    modules = install(model, rank=16, seed=5, embeddings=True)
    emb = model.get_input_embeddings()
    assert model.lm_head.weight is emb.weight and "lm_head" in modules and "model.embed_tokens" in modules
    ids = torch.randint(0, 2000, (2, 9), generator=torch.Generator().manual_seed(0))

    def loss_of(m):
        if path == "hf_logits":
            return m(input_ids=ids, labels=ids).loss
        hidden = m.model(input_ids=ids).last_hidden_state[:, :-1]
        return -chunked_token_logprobs(hidden, m.lm_head.weight, ids[:, 1:], chunk=5).mean()

    loss_of(dense).backward()
    loss_of(model).backward()
    A = projection(16, emb.embedding_dim, seed=5, layer=emb.sketch_state.layer, step=0)
    expected = dense.get_input_embeddings().weight.grad @ A.t()
    torch.testing.assert_close(emb.sketch_state.sketch, expected, rtol=1e-4, atol=1e-6)
    assert emb.weight.grad is None


def test_completion_logprobs_chunked_equals_full_logits():
    from experiments.rl.grpo import completion_logprobs

    model, _ = load_model(ModelConfig(name="tiny-llama"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3000, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded prompt
    upstream = torch.randn(3, 5, generator=g)
    grads = []
    for chunk in (0, 4):
        model.zero_grad()
        lp = completion_logprobs(model, ids, mask, completion_len=5, chunk=chunk)
        (lp * upstream).sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in grads[0][1].items():
        # fp32 sums in another order: elementwise to 1e-5 of the gradient's scale (the embedding's reaches 3.8;
        # one entry of 1e-3 was off by 3e-6 on an AMD EPYC), and the whole tensor to 1e-5 relative
        torch.testing.assert_close(grads[1][1][name], grad, rtol=1e-4, atol=1e-5 * max(1.0, float(grad.abs().max())), msg=name)
        assert float((grads[1][1][name] - grad).norm()) <= 1e-5 * float(grad.norm()) + 1e-12, name
