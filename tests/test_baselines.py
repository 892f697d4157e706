"""GaLore and LoRA baselines: what the shared trainer tests (test_trainer.py) do not cover."""

import pytest
import torch

from baselines.galore import GaLoreConfig, galore_param_groups
from baselines.lora import merge_adapters, merged_state_dict, unmerge_adapters
from experiments.config import ConfigError, build_config
from experiments.rl.models import ModelConfig, load_model
from experiments.rl.trainer import GRPOTrainer
from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.integration


def _train(tmp_path, name, *overrides):
    trainer = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path / name}", "eval.every=0", *overrides]))
    metrics = trainer.train()
    return trainer, metrics


def test_layerwise_galore_equals_galore_with_accumulation(tmp_path):
    """Per-parameter steps in the hooks of the last micro-batch == one GaLoreAdamW step (clipping off)."""
    common = ["train.steps=3", "train.micro_batch_size=2"]  # 8 rollouts -> up to 4 micro-batches per update
    knobs = ["rank=8", "lr=1e-3", "update_proj_gap=2", "max_grad_norm=0"]
    whole, m_whole = _train(tmp_path, "whole", "method=galore", *common, *[f"galore.{k}" for k in knobs])
    layer, m_layer = _train(tmp_path, "layer", "method=galore_layerwise", *common,
                            *[f"galore_layerwise.{k}" for k in knobs])
    assert max(m["rollout/trained_seqs"] for m in m_layer) > 2  # accumulation happened
    n_params = len(list(layer.model.parameters()))
    assert [m["step/params_stepped"] for m in m_layer if m["rollout/trained_seqs"] > 0] == \
        [n_params] * sum(m["rollout/trained_seqs"] > 0 for m in m_layer)
    a, b = whole.model.state_dict(), layer.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(p.grad is None for p in layer.model.parameters())  # freed inside the hooks


def test_galore_rank_is_capped_per_matrix_with_a_message():
    model, _ = load_model(ModelConfig(name="tiny-llama"))
    with pytest.warns(UserWarning, match="capped"):
        groups = galore_param_groups(model, GaLoreConfig(rank=10_000))
    projected = [g for g in groups if "rank" in g]
    assert projected and all(g["rank"] <= min(p.shape) for g in projected for p in g["params"])
    assert "rank" not in groups[-1]  # embeddings and norms: plain AdamW
    n_projected = sum(len(g["params"]) for g in projected)
    assert n_projected == 7 * model.config.num_hidden_layers


def test_galore_and_lora_config_errors():
    with pytest.raises(ConfigError, match="proj_type"):
        build_config(["method=galore", "galore.proj_type=diagonal"])
    with pytest.raises(ConfigError, match="lora.r"):
        build_config(["method=lora", "lora.r=0"])
    with pytest.raises(ValueError, match="match no nn.Linear"):
        GRPOTrainer(build_config([*TINY, "out_dir=/nonexistent/never", "method=lora", "lora.targets=[qkv]"]))


@pytest.fixture(scope="module")
def lora_trainer(tmp_path_factory):
    trainer, _ = _train(tmp_path_factory.mktemp("lora"), "run", "method=lora", "lora.r=4", "lora.lr=1e-2",
                        "train.steps=2")
    return trainer


def test_lora_trains_adapters_only_and_base_stays_bit_identical(lora_trainer):
    base, _ = load_model(ModelConfig(name="tiny-llama"))  # same seed -> the weights the run started from
    sd = lora_trainer.model.state_dict()
    for key, value in base.state_dict().items():
        lora_key = key.replace(".weight", ".base_layer.weight") if key.replace(".weight", ".base_layer.weight") in sd else key
        assert torch.equal(sd[lora_key], value), key
    assert {n for n, p in lora_trainer.model.named_parameters() if p.requires_grad} == \
        {n for n in sd if ".lora_" in n}
    assert any(v.abs().sum() > 0 for k, v in sd.items() if "lora_B" in k)  # B starts at zero and has moved


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_state_dict_gives_the_adapted_model(lora_trainer):
    model = lora_trainer.model
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    plain, _ = load_model(ModelConfig(name="tiny-llama"))
    merged = merged_state_dict(model)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain, ids), expected, atol=1e-5, rtol=1e-5)
    # in place: merge gives the same function; unmerge restores W up to rounding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merge_adapters(model)
    torch.testing.assert_close(_logits(model, ids), expected, atol=1e-5, rtol=1e-5)
    unmerge_adapters(model)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-6, rtol=0)
