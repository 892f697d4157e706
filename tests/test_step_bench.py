"""The memory step benchmark runs each variant in its own process and records what it measured."""

import json

import pytest

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
