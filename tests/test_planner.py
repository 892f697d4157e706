"""The memory planner: shapes against a real model, method ordering, errors, CLI."""

import pytest

from experiments.memory import planner
from experiments.memory.planner import plan, presets
from experiments.plan import main

pytestmark = pytest.mark.unit


def test_presets_named_in_the_contract_exist():
    for name in ["tiny-llama", "smollm2-135m-instruct", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
                 "qwen2.5-14b", "gemma-2-27b", "qwen2.5-32b"]:
        assert name in presets()


@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-135m-instruct"])
def test_parameter_count_matches_the_instantiated_model(name):
    import transformers

    _, cfg = planner.load_model_config(name)
    keys = {k: v for k, v in cfg.items() if k not in ("source", "model_type")}
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
    assert main(["model=qwen2.5-0.5b", "methods=dense,logra", "gpus=1", "gpu_mem_gb=80", "sharding=none"]) == 0
    out = capsys.readouterr().out
    assert out.count("assumptions:") == 2 and "fits" in out
    with pytest.raises(SystemExit, match="unknown sharding"):
        main(["model=qwen2.5-0.5b", "methods=dense", "sharding=bad"])


# ---- the planner against the profiler: one GRPO step per method on tiny-llama --------------------------
CKPT = ["model.gradient_checkpointing=true", "train.logprob_chunk=16"]  # the peak moves to the embedding's backward
TINY_SPECS = [("dense", 0, []), ("galore", 0, []), ("galore_layerwise", 0, []), ("lora", 0, []), ("logra", 0, []),
              ("logra:logra.embeddings=true", 0, []), ("logra", 16, []), ("dense", 0, CKPT)]


@pytest.mark.integration
@pytest.mark.parametrize("spec, pad, overrides", TINY_SPECS)
def test_planner_within_10_percent_of_the_profiled_peak_on_tiny_llama(spec, pad, overrides, tmp_path):
    """memory_table's child in this process: the fixed rollout batch (8 sequences, micro-batch 4,
    128 completion tokens; pad=16: half the prompts 16 tokens longer, so a padding mask), two updates
    under the tensor-accounting profiler, and the planner asked for the same shapes. The planner only
    sees the config and the batch shapes."""
    from experiments.memory_table import KEYS, child

    row = child(spec, {**KEYS, "model": "tiny-llama", "out": str(tmp_path), "overrides": overrides, "pad": str(pad)})
    ratio = row["planner_bytes"] / row["peak_bytes"]
    assert abs(ratio - 1) <= 0.10, (f"{spec}: planner {row['planner_bytes'] / 2**20:.1f} MiB "
                                    f"({row['planner_peak_at']}) vs profiled {row['peak_bytes'] / 2**20:.1f} MiB "
                                    f"({row['peak_phase']}): ratio {ratio:.3f}")
    # the optimizer step, a peak of its own (not the step's peak here): the planner's candidate vs the phase's peak
    measured = row["phases"]["mem/optimizer/peak_bytes"]
    assert abs(row["planner_candidates"]["optimizer"] / measured - 1) <= 0.10, (spec, row["planner_candidates"], measured)


def test_the_planner_check_can_fail():
    """The comparison above discriminates: leaving out the chunked head's buffers or the earlier
    micro-batches' gradients moves tiny-llama's dense prediction by more than 10 %."""
    kw = dict(micro_batch=4, seq_len=160, completion_len=128, micro_batches=2, rank=64, dtype="fp32", rollout="none",
              other_gb=0.0, gradient_checkpointing=False)
    base = plan("tiny-llama", "dense", logprob_chunk=256, **kw).total_bytes
    assert abs(plan("tiny-llama", "dense", logprob_chunk=0, **kw).total_bytes / base - 1) > 0.10
    assert abs(plan("tiny-llama", "dense", logprob_chunk=64, **kw).total_bytes / base - 1) > 0.10


# ---- experiments.memory.gpu_memory ---------------------------------------------------------------------
def test_gpu_memory_csv_and_summary(tmp_path):
    """The CPU-checkable part: rows -> CSV with the GPU name, the printed comparison."""
    import csv

    from experiments.memory.gpu_memory import summary, write_csv

    rows = [{"gpu": "NVIDIA X", "model": "qwen2.5-0.5b", "method": m, "micro_batch": 1, "seq_len": 1024, "rank": 256,
             "peak_bytes": 2**30 * (10 - i), "planner_bytes": 2**30 * 9, "planner_peak_at": "backward",
             "planner_over_measured": 9 / (10 - i)} for i, m in enumerate(["dense", "logra"])]
    out = write_csv(rows, tmp_path / "gpu" / "memory.csv")
    back = list(csv.DictReader(open(out)))
    assert [r["method"] for r in back] == ["dense", "logra"] and back[0]["gpu"] == "NVIDIA X"
    assert "measured   10.00 GiB" in summary(rows[0]) and "(0.900x)" in summary(rows[0])


@pytest.mark.integration
def test_gpu_memory_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: experiments.memory.gpu_memory measures the CUDA allocator's peak")
    import csv

    from experiments.memory.gpu_memory import main as gpu_main

    out = tmp_path / "memory.csv"
    assert gpu_main(["models=qwen2.5-0.5b", "methods=dense,logra", "seq_len=256", f"out={out}"]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 2 and all(float(r["peak_bytes"]) > 0 for r in rows)
