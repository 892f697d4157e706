"""The trainer's log-probs use the rollout temperature: log π_T(y) = log_softmax(z / T)[y], the
distribution the sampler drew from (TRL and verl divide the logits by T the same way)."""

import pytest
import torch
import transformers

from experiments.config import build_config
from experiments.rl.grpo import completion_logprobs
from experiments.rl.trainer import GRPOTrainer
from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.unit


def _tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_completion_logprobs_are_tempered(chunk, temperature):
    model = _tiny()
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    C = 4
    got = completion_logprobs(model, ids, mask, C, chunk, temperature=temperature)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -C - 1 : -1]
    expected = torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("chunk", [0, 256])
def test_trainer_logprobs_equal_the_samplers_at_temperature_0_7(tmp_path, chunk):
    """At T = 0.7 the sampler draws from softmax(z / 0.7): on-policy, the trainer's log-probs of the
    sampled tokens must equal the sampler's own (T = 1 in the trainer would differ by ~0.1–1 nats)."""
    t = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path}", "eval.every=0", "rollout.temperature=0.7",
                                  f"train.logprob_chunk={chunk}"]))
    torch.manual_seed(3)
    rollouts = t.engine.generate(t._prompts(t.train_problems[:2]), n=4)
    with torch.no_grad():
        trainer = t._logprobs(t.model, rollouts)
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(trainer[mask], rollouts.sampler_logprobs[mask], rtol=0, atol=1e-4)
    t.close()


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_predicted_kl_uses_the_tempered_policy(temperature):
    """KL̂ = ½ mean_t Var_{p_t}(δz_t / T) with p = softmax(z / T), δz from central differences of the
    logits along a low-rank ΔW = D A of one layer (fp64, but HF attention's softmax runs in fp32: agreement to ~1e-5)."""
    from logra_core.kl_predictor import exact_kl, hidden_states, predict_kl

    model = _tiny().double()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(4)
    D, A = torch.randn(64, 3, generator=g, dtype=torch.float64), torch.randn(3, 32, generator=g, dtype=torch.float64)
    name = "model.layers.0.mlp.gate_proj"
    W = model.get_submodule(name).weight

    def logits(eps):
        with torch.no_grad():
            W.add_(eps * D @ A)
            z = model(input_ids=ids).logits.reshape(-1, 96)
            W.sub_(eps * D @ A)
        return z

    eps = 1e-3
    z, dz = logits(0.0) / temperature, (logits(eps) - logits(-eps)) / (2 * eps) / temperature
    p = torch.softmax(z, -1)
    expected = 0.5 * ((p * dz**2).sum(-1) - (p * dz).sum(-1) ** 2).mean()
    got = predict_kl(model, ids, lowrank={name: (D, A)}, temperature=temperature)
    assert got == pytest.approx(float(expected), rel=2e-4)
    # the exact KL of a small step, on tempered hidden states as the trainer passes them, agrees to second order
    head = model.get_output_embeddings().weight.detach()
    h_old = hidden_states(model, ids) / temperature
    with torch.no_grad():
        W.add_(1e-3 * D @ A)
    realized = exact_kl(h_old, head, hidden_states(model, ids) / temperature, head).mean()
    assert float(realized) == pytest.approx(1e-6 * got, rel=2e-2)
