"""The memory planner (issue 7): shapes against a real model, method ordering, errors, CLI."""

import pytest

from experiments.memory import planner
from experiments.memory.planner import plan, presets
from experiments.plan import main


def test_presets_named_in_the_contract_exist():
    for name in ["tiny-llama", "smollm2-135m-instruct", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
                 "qwen2.5-14b", "gemma-2-27b", "qwen2.5-32b"]:
        assert name in presets()


@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-135m-instruct"])
def test_parameter_count_matches_the_instantiated_model(name):
    import transformers

    _, cfg = planner.load_model_config(name)
    keys = {k: v for k, v in cfg.items() if k != "source"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keys)) if name == "tiny-llama" else None
    if model is None:  # SmolLM2-135M: 134,515,008 parameters (HF model card / config)
        assert planner.shapes(cfg).total == 134_515_008
    else:
        assert planner.shapes(cfg).total == sum(p.numel() for p in model.parameters())


def test_dense_adam_state_and_logra_saving_at_27b():
    dense = plan("gemma-2-27b", "dense", gpus=8, sharding="fsdp", seq_len=1536)
    logra = plan("gemma-2-27b", "logra", gpus=8, sharding="fsdp", seq_len=1536)
    n = planner.shapes(planner.load_model_config("gemma-2-27b")[1]).total
    assert dense.categories["optimizer"] == n * 12 // 8  # fp32 master + 2 fp32 moments, sharded
    assert logra.categories["grads"] < dense.categories["grads"] / 10
    assert logra.total_bytes < dense.total_bytes
    assert not plan("gemma-2-27b", "dense", gpus=8, sharding="none").fits
    assert sum(dense.categories.values()) == dense.total_bytes
    assert "assumptions" in dense.table()


@pytest.mark.parametrize("kwargs, msg", [
    ({"model": "no-such-preset", "method": "dense"}, "unknown model"),
    ({"model": "tiny-llama", "method": "adamw8bit"}, "unknown method"),
    ({"model": "tiny-llama", "method": "dense", "sharding": "zero4"}, "unknown sharding"),
    ({"model": "tiny-llama", "method": "dense", "typo_option": 1}, "unknown planner option"),
])
def test_clear_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        plan(kwargs.pop("model"), kwargs.pop("method"), **kwargs)


def test_cli_smoke(capsys):
    assert main(["model=qwen2.5-0.5b", "method=dense,logra", "gpus=1", "gpu_mem_gb=80", "sharding=none"]) == 0
    out = capsys.readouterr().out
    assert out.count("assumptions:") == 2 and "fits" in out
    with pytest.raises(SystemExit, match="unknown sharding"):
        main(["model=qwen2.5-0.5b", "method=dense", "sharding=bad"])
