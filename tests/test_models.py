"""Model loading: tiny-llama for tests, the embedded SmolLM2 (real-model smoke test)."""

import math

import pytest
import torch

from experiments.config import build_config
from experiments.rl.models import ModelConfig, load_model
from experiments.rl.trainer import GRPOTrainer

pytestmark = pytest.mark.integration


def test_tiny_llama_is_seeded_and_uses_the_real_tokenizer():
    a, tok = load_model(ModelConfig(name="tiny-llama", init_seed=3))
    b, _ = load_model(ModelConfig(name="tiny-llama", init_seed=3))
    c, _ = load_model(ModelConfig(name="tiny-llama", init_seed=4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert len(tok) == 49152 and tok.padding_side == "left" and tok.pad_token is not None
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="model.dtype"):
        load_model(ModelConfig(name="tiny-llama", dtype="float8"))


@pytest.mark.slow
def test_embedded_smollm2_smoke(tmp_path):
    """The real embedded model: converted from the wheel's GGUF into a fresh cache, clean of GGUF
    markers, reloaded from the cache; then one GRPO step on arith runs."""
    model, tok = load_model(ModelConfig(cache_dir=str(tmp_path / "cache")))
    assert len(list((tmp_path / "cache").glob("smollm2-135m-instruct-*/model.safetensors"))) == 1
    again, _ = load_model(ModelConfig(cache_dir=str(tmp_path / "cache")))
    assert torch.equal(again.model.layers[3].mlp.up_proj.weight, model.model.layers[3].mlp.up_proj.weight)
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert all(p.dtype == torch.float32 for p in model.parameters())
    del model
    cfg = build_config([
        f"out_dir={tmp_path / 'smoke'}", "task=arith", "train.steps=1", "train.prompts_per_step=2",
        "train.group_size=4", "train.micro_batch_size=8", "rollout.max_new_tokens=24", "eval.size=4",
        "eval.every=1", "log.progress=false", "train.skip_zero_advantage=false",
    ])
    metrics = GRPOTrainer(cfg).train()
    step = [m for m in metrics if m["step"] == 1][0]
    assert math.isfinite(step["loss/policy"]) and step["rollout/trained_seqs"] == 8
    assert abs(step["kl/sampler_trainer"]) < 1e-3  # the sampler's log-probs match the trainer's
    assert 0.0 <= step["eval/accuracy"] <= 1.0


def test_local_path_loads_the_ordinary_way(tmp_path):
    model, tok = load_model(ModelConfig(name="tiny-llama", init_seed=5))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    again, tok2 = load_model(ModelConfig(name=str(tmp_path / "m")))
    a, b = model.state_dict(), again.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert tok2.padding_side == "left" and len(tok2) == len(tok)


def test_an_architecture_without_sdpa_falls_back_to_eager(tmp_path, capsys):
    """Gemma-2 has no SDPA path in transformers (soft-capped attention logits): the default
    attn_implementation=sdpa loads it with eager attention and says so, instead of failing."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(tmp_path / "g")
    _, tok = load_model(ModelConfig(name="tiny-llama"))
    tok.save_pretrained(tmp_path / "g")
    model, _ = load_model(ModelConfig(name=str(tmp_path / "g")))
    assert model.config._attn_implementation == "eager"
    assert "using attn_implementation=eager" in capsys.readouterr().out
