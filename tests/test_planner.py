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
    logra = plan("gemma-2-27b", "logra", gpus=8, sharding="fsdp", seq_len=1536, master="stochastic")
    n = planner.shapes(planner.load_model_config("gemma-2-27b")[1]).total
    assert dense.categories["optimizer"] == n * 12 // 8  # fp32 master + 2 fp32 moments, sharded
    assert logra.categories["grads"] < dense.categories["grads"] / 10
    assert logra.total_bytes < dense.total_bytes
    # with fp32 masters the colocated engine's receiver keeps its own fp32 master of every sketched weight,
    # whole on every GPU (4 B x 25.6 B sketched numbers): more than dense's sharded AdamW state
    fp32 = plan("gemma-2-27b", "logra", gpus=8, sharding="fsdp", seq_len=1536, master="fp32")
    assert fp32.total_bytes - logra.total_bytes >= 4 * planner.shapes(planner.load_model_config("gemma-2-27b")[1]).n_proj
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
BF16 = ["model.dtype=bfloat16"]  # the precision modes (docs/precision.md); logra's master modes: test below
# bf16 matmuls run ~10x slower than fp32 on a CPU without AVX512-BF16 (the LM head's 49,152 rows dominate
# tiny-llama): the bf16 cases take 32 completion tokens, where the planner is as close as at 128 (0.1 %)
BF16_SHAPES = {"completion_len": "32"}
TINY_SPECS = [("dense", 0, []), ("galore", 0, []), ("galore_layerwise", 0, []), ("lora", 0, []), ("logra", 0, []),
              ("logra:logra.embeddings=true", 0, []), ("logra", 16, []), ("dense", 0, CKPT),
              ("dense", 0, BF16), ("dense:dense.precision=bf16", 0, BF16), ("lora", 0, BF16),
              ("logra:logra.master=stochastic logra.embeddings=true", 0, BF16)]


@pytest.mark.integration
@pytest.mark.parametrize("spec, pad, overrides", TINY_SPECS,
                         ids=[f"{s}-pad{p}" + "".join(f"-{o}" for o in ov) for s, p, ov in TINY_SPECS])
def test_planner_within_10_percent_of_the_profiled_peak_on_tiny_llama(spec, pad, overrides, tmp_path):
    """memory_table's child in this process: the fixed rollout batch (8 sequences, micro-batch 4,
    128 completion tokens, 32 in bf16; pad=16: half the prompts 16 tokens longer, so a padding mask), two updates
    under the tensor-accounting profiler, and the planner asked for the same shapes. The planner only
    sees the config and the batch shapes."""
    from experiments.memory_table import KEYS, child

    shapes = BF16_SHAPES if overrides == BF16 else {}
    row = child(spec, {**KEYS, "model": "tiny-llama", "out": str(tmp_path), "overrides": overrides, "pad": str(pad), **shapes})
    ratio = row["planner_bytes"] / row["peak_bytes"]
    assert abs(ratio - 1) <= 0.10, (f"{spec}: planner {row['planner_bytes'] / 2**20:.1f} MiB "
                                    f"({row['planner_peak_at']}) vs profiled {row['peak_bytes'] / 2**20:.1f} MiB "
                                    f"({row['peak_phase']}): ratio {ratio:.3f}")
    # the optimizer step, a peak of its own (not the step's peak here): the planner's candidate vs the phase's peak
    measured = row["phases"]["mem/optimizer/peak_bytes"]
    assert abs(row["planner_candidates"]["optimizer"] / measured - 1) <= 0.10, (spec, row["planner_candidates"], measured)


@pytest.mark.integration
def test_master_modes_keep_the_documented_bytes_profiled_and_planned(tmp_path):
    """A bf16 LoGRA step on tiny-llama under the profiler: beside each sketched weight, master=fp32
    keeps 4 B per element, kahan 2 B, stochastic 0 (docs/precision.md). The profiled peaks step down
    by exactly 2 B per sketched element from fp32 to kahan to stochastic, the planner's by the same,
    and the planner stays within 10 % of each peak."""
    from experiments.memory_table import KEYS, child

    n_proj = planner.shapes(planner.load_model_config("tiny-llama")[1]).n_proj
    rows = {m: child(f"logra:logra.master={m}", {**KEYS, "model": "tiny-llama", "out": str(tmp_path), "overrides": BF16,
                                                 **BF16_SHAPES})
            for m in ("fp32", "kahan", "stochastic")}
    for key in ("peak_bytes", "planner_bytes"):
        assert rows["fp32"][key] - rows["kahan"][key] == 2 * n_proj, (key, rows)
        assert rows["kahan"][key] - rows["stochastic"][key] == 2 * n_proj, (key, rows)
    for m, row in rows.items():
        assert abs(row["planner_bytes"] / row["peak_bytes"] - 1) <= 0.10, (m, row)


PREC_KW = dict(micro_batch=4, seq_len=178, completion_len=128, micro_batches=2, rank=64, rollout="none", other_gb=0.0,
               gradient_checkpointing=False, padded=False)


def test_precision_terms_differ_by_the_documented_bytes():
    """docs/precision.md's bytes per element, in the planner's state: dense mixed keeps 12 B of AdamW
    state per weight (fp32 master + two fp32 moments), bf16 4 B; a bf16 sketched weight keeps 4 B (fp32
    master), 2 B (kahan) or 0 B (stochastic, none); with sketched embeddings the embedding too; lora's
    fp32 adapters take 4 B each, bf16 ones 2 B. An fp32 model keeps none of it."""
    s = planner.shapes(planner.load_model_config("smollm2-135m-instruct")[1])

    def opt(method, dtype="bf16", **o):
        return plan("smollm2-135m-instruct", method, dtype=dtype, **PREC_KW, **o).categories["optimizer"]

    assert opt("dense", precision="mixed") - opt("dense", precision="bf16") == 8 * s.total
    assert opt("dense", precision="mixed") == 12 * s.total
    for emb, n in ((False, s.n_proj), (True, s.n_proj + s.embed)):
        got = {m: opt("logra", master=m, embeddings=emb) for m in ("fp32", "kahan", "stochastic", "none")}
        assert got["fp32"] - got["kahan"] == 2 * n and got["kahan"] - got["stochastic"] == 2 * n
        assert got["stochastic"] == got["none"]
    # logra's AdamW group (norms; the embedding unless sketched): mixed 12 B, bf16 4 B per element
    assert opt("logra", dense_precision="mixed") - opt("logra", dense_precision="bf16") == 8 * (s.embed + s.norms)
    lora = {p: plan("smollm2-135m-instruct", "lora", dtype="bf16", precision=p, **{**PREC_KW, "rank": 16}).categories
            for p in ("mixed", "bf16")}
    adapters = sum(16 * (m + n) for m, n in s.proj)
    assert lora["mixed"]["params"] - lora["bf16"]["params"] == 2 * adapters
    assert lora["mixed"]["optimizer"] - lora["bf16"]["optimizer"] == 4 * adapters
    # fp32 weights: every mode is plain fp32, nothing extra
    assert len({opt("logra", "fp32", master=m) for m in ("fp32", "kahan", "stochastic", "none")}) == 1
    assert opt("dense", "fp32", precision="mixed") == opt("dense", "fp32", precision="bf16") == 8 * s.total


def test_precision_options_come_from_the_method_config_and_are_checked():
    """The memory table and the launcher ask ``Method.plan_options(cfg)``: the modes travel with it;
    the planner's mode tables cover exactly logra_core's modes; a bad mode is a clear error."""
    from baselines import METHODS
    from baselines.logra import MASTER_BYTES, MERGE_TEMP_BYTES, LoGRAConfig
    from baselines.dense import DenseConfig
    from logra_core.precision import MASTERS

    assert set(MASTER_BYTES) == set(MERGE_TEMP_BYTES) == set(MASTERS)
    opts = METHODS["logra"].plan_options(LoGRAConfig(master="kahan", embeddings=True))
    assert opts["master"] == "kahan" and opts["embeddings"] is True and opts["dense_precision"] == "mixed"
    assert METHODS["dense"].plan_options(DenseConfig(precision="bf16"))["precision"] == "bf16"
    with pytest.raises(ValueError, match="master must be one of"):
        plan("tiny-llama", "logra", master="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        plan("tiny-llama", "dense", precision="fp8")
    # master_weights is the default precision where the method's options name none
    assert plan("tiny-llama", "dense", master_weights=False).total_bytes == \
        plan("tiny-llama", "dense", precision="bf16").total_bytes


def test_plan_cli_takes_keys_per_entry(capsys):
    """``methods="dense,dense:precision=bf16,logra:logra.master=stochastic embeddings=true"``: each entry's
    own keys (the run-config spelling too), one table per entry, labelled as written."""
    assert main(["model=smollm2-135m-instruct", "rollout=none",
                 "methods=dense,dense:dense.precision=bf16,logra:logra.master=stochastic embeddings=true"]) == 0
    out = capsys.readouterr().out
    assert "/ dense:dense.precision=bf16:" in out and "two moments in the weight dtype" in out
    assert "fp32 master + two fp32 moments" in out and "master=stochastic (0 B per element" in out


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
