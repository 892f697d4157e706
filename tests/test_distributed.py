"""Multi-process GRPO (DESIGN §6): 2 gloo processes under torchrun equal 1 process on the same
global batch; bytes all-reduced per step are logged; DeepSpeed ZeRO-2 runs. Each torchrun call
runs several GRPO runs in one process group (tests/dist_entry.py) to pay the start-up once."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from experiments.config import build_config
from experiments.rl.checkpoint import list_checkpoints, save_checkpoint
from experiments.rl.metrics import read_metrics
from experiments.rl.trainer import GRPOTrainer
from tests.conftest import REPO, TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

# 2 prompts x 4 samples per step, one group per rank; groups sampled from their own seeds
BASE = [*TINY, "train.steps=3", "eval.every=0", "threads=1", "dist.seeded_groups=true", "train.logprob_chunk=0"]
LOGRA = ["method=logra", "logra.rank=8", "logra.lr=1e-3"]
DENSE = ["method=dense", "dense.lr=1e-3"]


def torchrun(runs: list[list[str]], timeout: int = 600) -> None:
    # DeepSpeed JIT-compiles a small CPU extension on first use (~35 s): cache it in the git-ignored .cache/
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "dist_entry.py"), json.dumps(runs)]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def one_process(out, *overrides) -> None:
    GRPOTrainer(build_config([*BASE, f"out_dir={out}", *overrides])).train()


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(list_checkpoints(run_dir)[-1] / "model.safetensors")


def assert_same_weights(a, b, tol=1e-5):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=tol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun call for every 2-rank run, and the matching 1-process runs."""
    root = tmp_path_factory.mktemp("dist")
    cases = {
        "logra_ddp": [*LOGRA, "dist.strategy=ddp"],  # step control on: the predicted KL is averaged over ranks
        "dense_ddp": [*DENSE, "dist.strategy=ddp"],
        "dense_fsdp2": [*DENSE, "dist.strategy=fsdp2"],
        "logra_fsdp2": [*LOGRA, "dist.strategy=fsdp2", "step_control.enabled=false"],
    }
    torchrun([[*BASE, f"out_dir={root / name}", *args] for name, args in cases.items()])
    one_process(root / "logra_1", *LOGRA)
    one_process(root / "logra_1_nosc", *LOGRA, "step_control.enabled=false")
    one_process(root / "dense_1", *DENSE)
    return root


@pytest.mark.parametrize("two, one", [("logra_ddp", "logra_1"), ("dense_ddp", "dense_1"),
                                      ("dense_fsdp2", "dense_1"), ("logra_fsdp2", "logra_1_nosc")])
def test_two_ranks_equal_one(runs, two, one):
    """Same global batch (2 prompt groups: one per rank vs both in one process) -> same weights after 3 steps."""
    assert_same_weights(runs / two, runs / one)
    m2, m1 = read_metrics(runs / two), read_metrics(runs / one)
    assert [m["step"] for m in m2] == [1, 2, 3]
    for key in ("reward/mean", "rollout/trained_seqs", "rollout/trained_tokens"):  # rollouts identical
        assert [m[key] for m in m2] == [m[key] for m in m1], key
    for key in ("loss/policy", "step/grad_norm"):
        assert [m[key] for m in m2] == pytest.approx([m[key] for m in m1], rel=1e-4, abs=1e-7), key
    assert sum(m["rollout/trained_seqs"] for m in m2) > 0  # something was trained


def test_allreduce_bytes_logged(runs):
    """logra all-reduces m x r sketches + the small dense grads; dense every gradient; once per step."""
    cfg = build_config([*BASE, *LOGRA, "out_dir=unused"])
    model = GRPOTrainer.__new__(GRPOTrainer)  # noqa: F841 (shapes only, no trainer needed)
    from experiments.rl.models import load_model

    m, _ = load_model(cfg.model)
    n_params = sum(p.numel() for p in m.parameters())
    layers = [mod for name, mod in m.named_modules() if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"))]
    sketched = sum(mod.weight.numel() for mod in layers)
    sketch = sum(mod.weight.shape[0] * 8 for mod in layers)
    expected_logra = 4 * (n_params - sketched + sketch)
    logra = [r["dist/allreduce_bytes"] for r in read_metrics(runs / "logra_ddp")]
    dense = [r["dist/allreduce_bytes"] for r in read_metrics(runs / "dense_ddp")]
    assert logra == [expected_logra] * 3
    assert dense == [4.0 * n_params] * 3
    assert [r["dist/allreduce_bytes"] for r in read_metrics(runs / "logra_fsdp2")] == [4.0 * sketch] * 3  # FSDP reduces the rest


def test_deepspeed_zero2_dense(tmp_path):
    """Dense AdamW inside a DeepSpeed ZeRO-2 engine (experiments/configs/deepspeed/zero2.json), 2 steps;
    it also lands on the 1-process weights (ZeRO steps the same AdamW on flat partitions)."""
    pytest.importorskip("deepspeed")
    torchrun([[*BASE, "train.steps=2", *DENSE, "dist.strategy=deepspeed", f"out_dir={tmp_path / 'ds'}"]])
    rows = read_metrics(tmp_path / "ds")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["step/grad_norm"] > 0 and "dist/allreduce_bytes" not in r for r in rows)  # ZeRO reduces in backward
    one_process(tmp_path / "one", "train.steps=2", *DENSE)
    assert_same_weights(tmp_path / "ds", tmp_path / "one")


def test_refusals(tmp_path):
    """What a strategy cannot run is refused before the model loads, with the reason."""
    from experiments.rl.distributed import DeepSpeed, FSDP2
    from baselines import METHODS

    cfg = build_config([*BASE, *LOGRA, "dist.strategy=deepspeed", f"out_dir={tmp_path}"])
    strategy = DeepSpeed.__new__(DeepSpeed)
    strategy.world_size = 2
    with pytest.raises(ValueError, match="ZeRO flattens"):
        strategy.check(cfg, METHODS["logra"])
    fsdp = FSDP2.__new__(FSDP2)
    fsdp.world_size = 2
    with pytest.raises(ValueError, match="step control"):
        fsdp.check(build_config([*BASE, *LOGRA, f"out_dir={tmp_path}"]), METHODS["logra"])
    with pytest.raises(ValueError, match="logprob_chunk=0"):
        fsdp.check(build_config([*BASE, *DENSE, "train.logprob_chunk=256", f"out_dir={tmp_path}"]), METHODS["dense"])
    with pytest.raises(ValueError, match="inside backward"):
        fsdp.check(build_config([*BASE, "method=galore_layerwise", f"out_dir={tmp_path}"]), METHODS["galore_layerwise"])
    # resume=true (the launcher passes it to every run) starts a fresh run; a run with a checkpoint is refused
    run = tmp_path / "run"
    resume = build_config([*BASE, *DENSE, "resume=true", f"out_dir={run}"])
    fsdp.check(resume, METHODS["dense"])
    save_checkpoint(run, 1, torch.nn.Linear(2, 2), {}, {"epoch": 0, "cursor": 0})
    with pytest.raises(ValueError, match="resuming .* not supported"):
        fsdp.check(resume, METHODS["dense"])


def test_allreduce_bench_tiny():
    """The benchmark's 2-process all-reduce moves exactly the bytes the shapes predict (it exits 1 if not)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "experiments.memory.allreduce_bench", "model=tiny-llama", "rank=8",
                           "repeats=1", "big_rank=0", "methods=logra:logra.embeddings=true"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("method=logra"))
    assert float(line.split()[-3]) == pytest.approx(0.125, abs=5e-4)  # tiny-llama: sketches + norms / dense
