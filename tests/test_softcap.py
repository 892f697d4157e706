"""Final-logit softcapping (Gemma-2) in the chunked LM head and in the KL predictor, checked against
the model's own capped logits on a tiny random Gemma-2."""

import copy

import pytest
import torch
import transformers

from experiments.rl.grpo import completion_logprobs
from logra_core.kl_predictor import exact_kl, hidden_states, predict_kl

pytestmark = pytest.mark.unit

CAP = 0.5  # small, so that the random tiny model's logits reach well into the tanh's curve


def tiny_gemma2(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    query_pre_attn_scalar=8, sliding_window=16, final_logit_softcapping=CAP,
                                    attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # raw logits of a few × CAP: the cap matters
    return model


def batch(seed=0, B=3, L=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (B, L), generator=gen)
    mask = torch.ones_like(ids)
    return ids, mask


def test_the_cap_is_active():
    model = tiny_gemma2()
    ids, mask = batch()
    raw = hidden_states(model, ids, mask) @ model.lm_head.weight.t()
    assert raw.abs().max() > 3 * CAP


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_softcapped_head_equals_the_models_own_logprobs_and_gradients(chunk):
    C = 7
    ids, mask = batch()
    weights = torch.randn(3, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = {}
    for c in (0, chunk):  # 0: the model's own forward (capped logits, log-softmax of them)
        model = tiny_gemma2()
        logprobs = completion_logprobs(model, ids, mask, C, chunk=c)
        (logprobs * weights).sum().backward()
        out[c] = (logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[chunk][0], out[0][0], rtol=1e-10, atol=1e-10)
    for n, g in out[0][1].items():  # Gemma-2's RMSNorm computes in fp32 even in a float64 model: ~1e-7
        torch.testing.assert_close(out[chunk][1][n], g, rtol=1e-5, atol=1e-6 * g.abs().max().item())
    # without the cap the chunked head would be a different distribution: the test can tell
    uncapped = completion_logprobs(tiny_gemma2(), ids, mask, C, chunk=0)
    model = tiny_gemma2()
    model.config.final_logit_softcapping = None
    assert (completion_logprobs(model, ids, mask, C, chunk=chunk) - uncapped).abs().max() > 1e-2


def model_kl(old, new, ids, mask):
    """KL(p_old ‖ p_new) per token from the models' own (capped) logits."""
    lp_old = torch.log_softmax(old(ids, attention_mask=mask).logits, -1)
    lp_new = torch.log_softmax(new(ids, attention_mask=mask).logits, -1)
    return (lp_old.exp() * (lp_old - lp_new)).sum(-1)


def an_update(model, gen):
    """A low-rank step on two projections, dense on a norm and on the (tied) head/embedding."""
    lowrank = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        W = model.get_submodule(name).weight
        lowrank[name] = (torch.randn(W.shape[0], 2, generator=gen, dtype=W.dtype),
                         torch.randn(2, W.shape[1], generator=gen, dtype=W.dtype))
    dense = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3
             for n, p in model.named_parameters() if n in ("model.layers.0.input_layernorm.weight", "lm_head.weight")}
    return lowrank, dense


@torch.no_grad()
def applied(model, lowrank, dense, s):
    new = copy.deepcopy(model)
    for name, (D, A) in lowrank.items():
        new.get_submodule(name).weight.add_(s * D @ A)
    params = dict(new.named_parameters())
    for name, d in dense.items():
        params[name].add_(s * d)
    return new


def test_realized_kl_with_softcap_equals_the_models_own():
    model = tiny_gemma2().eval()
    ids, mask = batch()
    lowrank, dense = an_update(model, torch.Generator().manual_seed(2))
    new = applied(model, lowrank, dense, 0.05)
    want = model_kl(model, new, ids, mask).reshape(-1)
    got = exact_kl(hidden_states(model, ids, mask), model.lm_head.weight, hidden_states(new, ids, mask),
                   new.lm_head.weight, chunk=5, softcap=CAP)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-14)
    uncapped = exact_kl(hidden_states(model, ids, mask), model.lm_head.weight, hidden_states(new, ids, mask),
                        new.lm_head.weight, chunk=5)
    assert (uncapped - want).abs().max() > 0.1 * want.abs().max()


def test_softcapped_kl_prediction_matches_as_the_step_shrinks():
    """realized (the model's own logits) / predicted → 1 as s → 0; a prediction that ignored the cap
    would converge to a wrong ratio (≈ 0.65 here)."""
    model = tiny_gemma2().eval()
    ids, mask = batch()
    lowrank, dense = an_update(model, torch.Generator().manual_seed(3))
    predicted = predict_kl(model, ids, mask, lowrank=lowrank, dense=dense, chunk=5)
    model.config.final_logit_softcapping = None
    uncapped = predict_kl(model, ids, mask, lowrank=lowrank, dense=dense, chunk=5)
    model.config.final_logit_softcapping = CAP
    errors = []
    for s in (1e-2, 1e-3, 1e-4):
        realized = model_kl(model, applied(model, lowrank, dense, s), ids, mask).mean().item()
        errors.append(abs(realized / (s**2 * predicted) - 1))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-2, errors
    assert abs(realized / (s**2 * uncapped) - 1) > 0.1
