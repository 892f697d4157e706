"""The memory step benchmark runs each variant in its own process and records what it measured."""

import json

import pytest
import torch

from experiments.memory.step_bench import main

pytestmark = pytest.mark.integration


def test_step_bench_on_tiny_llama(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["model=tiny-llama", "logra.rank=8", "completion_len=8", "seqs=4", "micro_batch=2", "steps=1", f"out={out}"])
    record = json.loads(out.read_text())
    variants = [r["variant"] for r in record["results"]]
    assert variants == ["dense", "logra", "logra:logra.embeddings=true"]
    assert all(r["peak_bytes"] >= r["rss_after_load_bytes"] > 0 for r in record["results"])
    assert record["results"][0]["ratio_to_first"] == 1.0 and record["git_sha"]
    assert "peak / dense" in capsys.readouterr().out


def test_kl_bench_on_tiny_llama():
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "experiments.memory.kl_bench", "model=tiny-llama", "logra.rank=8",
                           "seqs=4", "completion_len=8", "repeats=1"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {l.split(":")[0].strip(): l for l in proc.stdout.splitlines() if ":" in l}
    assert "predictor / forward time" in lines and "predict_kl" in lines
    ratio = float(lines["predictor / forward time"].split(":")[1])
    assert ratio > 0


def test_fixed_rollouts_group_rows_by_prompt_like_a_grpo_batch():
    """``group``: row r holds prompt r // group (the time table's probe then shares a group's prompt, as
    in training); ``pad``: the even groups carry extra real tokens, the odd ones are left-padded."""
    from experiments.memory.step_bench import fixed_rollouts
    from experiments.rl.models import embedded_tokenizer

    tok = embedded_tokenizer()
    plain = fixed_rollouts(tok, 4, 5)
    assert len({tuple(r.tolist()) for r in plain.prompt_ids}) == 4  # one prompt per row
    batch = fixed_rollouts(tok, 7, 5, group=3, pad=2)
    prompts = [tuple(r.tolist()) for r in batch.prompt_ids]
    assert prompts[0] == prompts[1] == prompts[2] != prompts[3]
    assert prompts[3] == prompts[4] == prompts[5] != prompts[6]
    mask = batch.prompt_mask
    assert bool(mask[:3, :2].all()) and not bool(mask[3:6, :2].any()) and bool(mask[6, :2].all())
    assert batch.completion_ids.shape == (7, 5) and bool(batch.completion_mask.all())
    assert torch.equal(fixed_rollouts(tok, 7, 5, group=3, pad=2).completion_ids, batch.completion_ids)  # seeded
    with pytest.raises(ValueError, match="group"):
        fixed_rollouts(tok, 4, 5, group=0)
