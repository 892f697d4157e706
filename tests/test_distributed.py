"""Multi-process GRPO (docs/design.md §6): 2 gloo processes under torchrun equal 1 process on the same
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
from experiments.rl.sharded_checkpoint import is_sharded, read_model_weights
from experiments.rl.trainer import GRPOTrainer
from tests.conftest import REPO, TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.integration

# 2 prompts x 4 samples per step, one group per rank; groups sampled from their own seeds
BASE = [*TINY, "train.steps=3", "eval.every=0", "threads=1", "dist.seeded_groups=true", "train.logprob_chunk=0"]
LOGRA = ["method=logra", "logra.rank=8", "logra.lr=1e-3"]
DENSE = ["method=dense", "dense.lr=1e-3"]
FSDP2_LOGRA = ["step_control.target_kl=1e-4", "step_control.measure_realized=true", "train.logprob_chunk=64",
               "step_control.probe_fraction=1"]  # every row probed: 1 and 2 processes see the same probe
# every rank profiled, with a reference model to load; a wider tiny-llama, so one block read at a time is small beside a shard
MEM = ["log.memory_profile=true", "train.kl_coef=0.01", "train.steps=2", "model.tiny_hidden_size=128"]


def _torchrun_cmd(runs: list[list[str]]):
    # DeepSpeed JIT-compiles a small CPU extension on first use (~35 s): cache it in the git-ignored .cache/
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "dist_entry.py"), json.dumps(runs)]
    return cmd, env


def torchrun(runs: list[list[str]], timeout: int = 600) -> None:
    cmd, env = _torchrun_cmd(runs)
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def one_process(out, *overrides) -> None:
    GRPOTrainer(build_config([*BASE, f"out_dir={out}", *overrides])).train()


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    """The newest checkpoint's whole weights (a sharded fsdp2 checkpoint read back in this process)."""
    path = list_checkpoints(run_dir)[-1]
    return read_model_weights(path) if is_sharded(path) else load_file(path / "model.safetensors")


def assert_same_weights(a, b, tol=1e-5):
    wa, wb = final_weights(a), final_weights(b)
    common = wa.keys() & wb.keys()  # a tied head is stored under one of its names
    assert common and len(common) >= min(len(wa), len(wb)), (sorted(wa), sorted(wb))
    for k in common:
        torch.testing.assert_close(wa[k], wb[k], atol=tol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun call for every 2-rank run, and the matching 1-process runs."""
    root = tmp_path_factory.mktemp("dist")
    cases = {
        "logra_ddp": [*LOGRA, "dist.strategy=ddp"],  # step control on: the predicted KL is averaged over ranks
        "dense_ddp": [*DENSE, "dist.strategy=ddp"],
        "dense_fsdp2": [*DENSE, "dist.strategy=fsdp2", "rollout.engine=hf"],
        # step control on and binding (scale < 1), the chunked LM head, an engine copy per rank
        "logra_fsdp2": [*LOGRA, *FSDP2_LOGRA, "dist.strategy=fsdp2", "rollout.engine=hf"],
        "logra_fsdp2_6": [*LOGRA, *FSDP2_LOGRA, "dist.strategy=fsdp2", "train.steps=6"],  # uninterrupted: test_fsdp2_sigterm_resume
        # the tied head's share of the embedding sketch lands (the head module's sketch, not the swapped-in weight's)
        "logra_fsdp2_emb": [*LOGRA, *FSDP2_LOGRA, "logra.embeddings=true", "dist.strategy=fsdp2"],
        # a bit of rank 1's q_proj shard flipped before the sync after step 2: caught by the digest, healed
        "logra_fsdp2_corrupt": {"overrides": [*LOGRA, *FSDP2_LOGRA, "dist.strategy=fsdp2", "rollout.engine=hf"],
                                "corrupt": [2, 1]},
        # every rank profiles its tensors: the load (policy and reference model), the prediction
        "logra_fsdp2_mem": [*LOGRA, *FSDP2_LOGRA, *MEM, "dist.strategy=fsdp2", "rollout.engine=hf"],
        # known per-problem outcomes, 5 problems over 2 ranks (3 + 2 and one padding): test_eval_outcomes_of_every_rank
        "marked_ddp": [*DENSE, "dist.strategy=ddp", "task=toy_marked", "train.steps=1", "eval.every=1", "eval.size=5",
                       "eval.batch_size=2"],
    }
    torchrun([{**args, "overrides": [*BASE, f"out_dir={root / name}", *args["overrides"]]} if isinstance(args, dict)
              else [*BASE, f"out_dir={root / name}", *args] for name, args in cases.items()])
    one_process(root / "logra_1", *LOGRA)
    one_process(root / "logra_1_fsdp2_ref", *LOGRA, *FSDP2_LOGRA)
    one_process(root / "logra_1_emb", *LOGRA, *FSDP2_LOGRA, "logra.embeddings=true")
    one_process(root / "logra_1_mem", *LOGRA, *FSDP2_LOGRA, *MEM)
    one_process(root / "dense_1", *DENSE)
    return root


@pytest.mark.parametrize("two, one", [("logra_ddp", "logra_1"), ("dense_ddp", "dense_1"),
                                      ("dense_fsdp2", "dense_1"), ("logra_fsdp2", "logra_1_fsdp2_ref"),
                                      ("logra_fsdp2_emb", "logra_1_emb")])
def test_two_ranks_equal_one(runs, two, one):
    """Same global batch (2 prompt groups: one per rank vs both in one process) -> same weights after 3 steps.
    logra_fsdp2: predicted-KL step control on the sharded model (binding: scales < 1), the chunked LM
    head and an hf engine copy per rank, against one process with step control and the chunked head;
    logra_fsdp2_emb: the same with the tied embedding/head sketched (the head's sketch share included)."""
    assert_same_weights(runs / two, runs / one)
    m2, m1 = read_metrics(runs / two), read_metrics(runs / one)
    assert [m["step"] for m in m2] == [1, 2, 3]
    for key in ("reward/mean", "rollout/trained_seqs", "rollout/trained_tokens"):  # rollouts identical
        assert [m[key] for m in m2] == [m[key] for m in m1], key
    keys = ("loss/policy", "step/grad_norm") + (("step/scale", "kl/predicted", "kl/realized") if two.startswith("logra_fsdp2") else ())
    for key in keys:
        assert [m[key] for m in m2] == pytest.approx([m[key] for m in m1], rel=1e-4, abs=1e-7), key
    assert sum(m["rollout/trained_seqs"] for m in m2) > 0  # something was trained
    if two.startswith("logra_fsdp2"):
        assert all(m["step/scale"] < 1 for m in m2 if m["rollout/trained_seqs"])  # the control acted


@pytest.mark.parametrize("name", ["dense_fsdp2", "logra_fsdp2"])
def test_fsdp2_engine_copies_equal_trainer(runs, name):
    """Each rank's engine copy, synced by gathered payloads (low-rank L rows from their owners, A from
    the seed; dense tensors whole), is torch.equal to the gathered trainer weights after every sync,
    with no resync needed."""
    updates = sum(1 for m in read_metrics(runs / name) if m["rollout/trained_seqs"])
    assert updates > 0
    for rank in (0, 1):
        rows = [json.loads(line) for line in (runs / name / f"engine_check_rank{rank}.jsonl").read_text().splitlines()]
        assert [r["full"] for r in rows] == [True] + [False] * updates  # the initial full sync, then one per update
        assert all(r["equal"] for r in rows), rows
        assert all(r.get("sync/resyncs", 0) == 0 for r in rows)


def test_fsdp2_digest_catches_a_corrupted_shard(runs):
    """A flipped bit in rank 1's shard of a sketched weight: the step's payload (a low-rank op) applies
    cleanly on every engine copy, but the digest summed over the ranks' shards no longer matches, so
    every rank resyncs once (together: a full payload is a collective) and every copy is again
    torch.equal to the trainer's gathered weights."""
    for rank in (0, 1):
        rows = [json.loads(line) for line in (runs / "logra_fsdp2_corrupt" / f"engine_check_rank{rank}.jsonl").read_text().splitlines()]
        assert [r.get("sync/resyncs", 0) for r in rows] == [0, 0, 1, 0], rows
        assert all(r["equal"] for r in rows), rows


def _profile(run_dir, rank: int) -> list[dict]:
    name = "memory_profile.jsonl" if rank == 0 else f"memory_profile_rank{rank}.jsonl"
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _extra(rows: list[dict], phase: str) -> float:
    """The most a phase held beyond what was alive when it began, over the profiled steps."""
    return max(r[f"mem/{phase}/peak_bytes"] - r[f"mem/{phase}/start_bytes"] for r in rows if f"mem/{phase}/peak_bytes" in r)


def _tiny_bytes() -> tuple[int, int]:
    """(the MEM runs' tiny-llama's parameter bytes, one decoder layer's)."""
    from experiments.rl.models import load_model

    m, _ = load_model(build_config([*BASE, *MEM, "out_dir=unused"]).model)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    return total, sum(p.numel() * p.element_size() for p in m.model.layers[0].parameters())


def test_fsdp2_loads_no_whole_model(runs):
    """Sharded materialization (experiments/rl/materialize.py): on each of 2 ranks the load of the
    policy — and then of the reference model — peaks at its shards plus small state, ≤ 0.6 × the whole
    model's bytes (loading the whole model on every rank and sharding it after held 1.0 ×)."""
    whole, _ = _tiny_bytes()
    for rank in (0, 1):
        init = _profile(runs / "logra_fsdp2_mem", rank)[0]
        assert init["step"] == 0
        assert 0.4 * whole < init["mem/init/peak_bytes"] <= 0.6 * whole, (init, whole)
        assert _extra([init], "init_reference") <= 0.6 * whole, (init, whole)


def test_fsdp2_prediction_rides_the_layer_gather(runs):
    """Step control under fsdp2 never gathers the model: ``full_weights`` is not entered in the whole run
    (rollouts and evaluation on the hf engine copies, the KL prediction and the realized KL layer by
    layer), and on each rank the prediction phase holds at most what one process's prediction holds
    beyond its start (the probe's activations, the vocabulary sums) plus two whole decoder layers — the
    earlier whole-weight gather added every layer and the vocabulary table on top."""
    _, layer = _tiny_bytes()
    one = _extra(_profile(runs / "logra_1_mem", 0), "kl_predict")
    for rank in (0, 1):
        assert json.loads((runs / "logra_fsdp2_mem" / f"full_weights_rank{rank}.json").read_text())["calls"] == 0
        assert json.loads((runs / "logra_fsdp2" / f"full_weights_rank{rank}.json").read_text())["calls"] == 0
        two = _extra(_profile(runs / "logra_fsdp2_mem", rank), "kl_predict")
        assert two <= one + 2 * layer, (rank, two, one, layer)


def test_eval_outcomes_of_every_rank(runs):
    """Rank 0 writes every rank's outcomes in the held-out order, the padding left out."""
    from experiments.rl.tasks import TaskConfig, held_out
    from tests.toy_task import ToyMarked

    uids = [p.uid for p in held_out(ToyMarked(TaskConfig(name="toy_marked")).test_split(), 5, 0)]
    expected = "".join("1" if int(uid.rsplit("/", 1)[1]) % 3 == 0 else "0" for uid in uids)
    lines = [json.loads(line) for line in (runs / "marked_ddp" / "eval_outcomes.jsonl").read_text().splitlines()]
    evals = [m for m in read_metrics(runs / "marked_ddp") if "eval/accuracy" in m]
    assert [line["step"] for line in lines] == [m["step"] for m in evals] == [0, 1]
    for line, m in zip(lines, evals):
        assert line["problem_ids"] == uids and line["correct"] == expected
        assert line["correct"].count("1") == round(m["eval/accuracy"] * m["eval/num_problems"]) and m["eval/num_problems"] == 5


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
    for method in ("galore", "lora"):  # per-matrix optimizers (GaLore's projections; peft's adapters are not elementwise-flagged)
        with pytest.raises(ValueError, match="ZeRO flattens"):
            strategy.check(build_config([*BASE, f"method={method}", "dist.strategy=deepspeed", f"out_dir={tmp_path}"]),
                           METHODS[method])
    with pytest.raises(ValueError, match="step control"):
        strategy.check(build_config([*BASE, *DENSE, "step_control.enabled=true", f"out_dir={tmp_path}"]), METHODS["dense"])
    with pytest.raises(ValueError, match="use rollout.engine=shared"):
        strategy.check(build_config([*BASE, *DENSE, "rollout.engine=hf", f"out_dir={tmp_path}"]), METHODS["dense"])
    fsdp = FSDP2.__new__(FSDP2)
    fsdp.world_size, fsdp.distributed = 2, False
    # step control, the chunked head and engine copies run under fsdp2 (test_two_ranks_equal_one)
    fsdp.check(build_config([*BASE, *LOGRA, "train.logprob_chunk=256", "rollout.engine=hf", f"out_dir={tmp_path}"]),
               METHODS["logra"])
    with pytest.raises(ValueError, match="inside backward"):
        fsdp.check(build_config([*BASE, "method=galore_layerwise", f"out_dir={tmp_path}"]), METHODS["galore_layerwise"])
    fsdp.distributed = True  # what a sharded load or a sharded prediction cannot do
    with pytest.raises(ValueError, match="no sharded initializer"):
        fsdp.check(build_config([*BASE, "method=lora", f"out_dir={tmp_path}"]), METHODS["lora"])
    with pytest.raises(ValueError, match="predictor='exact' is not supported under dist.strategy=fsdp2"):
        fsdp.check(build_config([*BASE, *LOGRA, "step_control.predictor=exact", f"out_dir={tmp_path}"]), METHODS["logra"])
    fsdp.check(build_config([*BASE, *LOGRA, f"out_dir={tmp_path}"]), METHODS["logra"])  # the secant, the default
    fsdp.distributed = False
    # deepspeed: resume=true (the launcher passes it to every run) starts a fresh run; a run with a checkpoint is refused
    run = tmp_path / "run"
    ds = DeepSpeed.__new__(DeepSpeed)
    ds.world_size = 2
    resume = build_config([*BASE, *DENSE, "dist.strategy=deepspeed", "resume=true", f"out_dir={run}"])
    ds.check(resume, METHODS["dense"])
    save_checkpoint(run, 1, torch.nn.Linear(2, 2), {}, {"epoch": 0, "cursor": 0})
    with pytest.raises(ValueError, match="resuming .* not supported"):
        ds.check(resume, METHODS["dense"])
    fsdp.check(resume, METHODS["dense"])  # fsdp2 resumes (test_fsdp2_sigterm_resume)


def test_allreduce_bench_tiny():
    """The benchmark's 2-process all-reduce moves exactly the bytes the shapes predict (it exits 1 if not)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "experiments.memory.allreduce_bench", "model=tiny-llama", "rank=8",
                           "repeats=1", "big_rank=0", "methods=logra:logra.embeddings=true"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("method=logra"))
    assert float(line.split()[-3]) == pytest.approx(0.125, abs=5e-4)  # tiny-llama: sketches + norms / dense


def test_fsdp2_sigterm_resume(runs, tmp_path):
    """SIGTERM to torchrun during a 6-step 2-rank fsdp2 logra run (step control, chunked head, hf
    engines): every rank finishes its step, writes its shards of one checkpoint and exits 143;
    resume=true on 2 ranks ends within 1e-6 of the uninterrupted run. That sharded checkpoint then
    resumes in one process (2 -> 1) and trains on; a corrupted shard is refused, naming the file."""
    import shutil
    import signal
    import time

    from experiments.rl.checkpoint import CheckpointCorrupt

    run = tmp_path / "run"
    overrides = [*BASE, *LOGRA, *FSDP2_LOGRA, "dist.strategy=fsdp2", "rollout.engine=hf", "train.steps=6",
                 "checkpoint.every=0", f"out_dir={run}"]
    cmd, env = _torchrun_cmd([overrides])
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(l)["step"] >= 2 for l in metrics.read_text().splitlines() if l.strip()):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    stopped = list_checkpoints(run)
    assert len(stopped) == 1 and 2 <= int(stopped[0].name.split("_")[1]) < 6, out[-4000:]  # the preemption's checkpoint
    assert is_sharded(stopped[0])
    assert out.count("[dist_entry]") == 2, out[-4000:]  # both ranks stopped through Preempted (exit 143)
    torchrun([[*overrides, "resume=true"]])
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert_same_weights(run, runs / "logra_fsdp2_6", tol=1e-6)
    scales = [m["step/scale"] for m in read_metrics(run)]
    assert scales == pytest.approx([m["step/scale"] for m in read_metrics(runs / "logra_fsdp2_6")], rel=1e-6)

    # 2 -> 1: the 6-step sharded checkpoint resumes in one process and trains a 7th step
    before = final_weights(run)
    GRPOTrainer(build_config([*overrides, "resume=true", "train.steps=7"])).train()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6, 7]
    after = final_weights(run)  # the 7th step's checkpoint, written by one process
    assert any(not torch.equal(before[k], after[k]) for k in before.keys() & after.keys())

    # a flipped byte in rank 1's shard of the step-6 checkpoint: refused, naming the file
    shutil.rmtree(list_checkpoints(run)[-1])
    shard = list_checkpoints(run)[-1] / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="dcp/__1_0.distcp"):
        GRPOTrainer(build_config([*overrides, "resume=true", "train.steps=8"]))
