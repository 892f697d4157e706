"""Fault tolerance: non-finite steps skipped bit for bit, crash-safe checkpoints,
preemption by signal, kill -9 and resume, tampered checkpoints refused, OOM messages."""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from experiments.config import build_config
from experiments.rl import checkpoint as ckpt
from experiments.rl.checkpoint import CheckpointCorrupt, list_checkpoints
from experiments.rl.guard import NonFiniteError, Preempted, PreemptionSignals
from experiments.rl.metrics import read_metrics
from experiments.rl.trainer import GRPOTrainer
from tests.conftest import REPO, TINY
from tests.test_trainer import METHOD_ARGS, _comparable
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.integration

FAST = [*TINY, "eval.every=0", "threads=1"]


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _trainer(path, *overrides):
    return GRPOTrainer(build_config([*FAST, f"out_dir={path}", *overrides]))


def _snapshot(trainer) -> dict:
    return {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "method": copy.deepcopy(trainer.method.state_dict())}


def _same(a, b) -> bool:
    """Bit-identical nested state (tensors by torch.equal, dtype included)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _poison_grad(trainer) -> str:
    """Put a NaN into the first accumulated gradient; return its name."""
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            p.grad.view(-1)[0] = float("nan")
            return name
    raise AssertionError("no gradient to poison")


def _poison_sketch(trainer) -> str:
    """Put an Inf into the first LoGRA sketch (sketched weights have no .grad); return its module."""
    for name, m in trainer.method.optimizer.modules_by_name.items():
        if m.sketch_state.sketch is not None:
            m.sketch_state.sketch.view(-1)[0] = float("inf")
            return name
    raise AssertionError("no sketch to poison")


def _inject_after_backward(monkeypatch, trainer, steps, poison):
    names = []
    orig = trainer.accumulate_gradients

    def accumulate(*args, **kwargs):
        out = orig(*args, **kwargs)
        if trainer.step + 1 in steps:
            names.append(poison(trainer))
        return out

    monkeypatch.setattr(trainer, "accumulate_gradients", accumulate)
    return names


def _inject_into_loss(monkeypatch, trainer, steps):
    """galore_layerwise steps inside backward: poison the loss it differentiates instead."""
    orig = trainer.method.backward

    def backward(loss, last=True):
        orig(loss * float("nan") if trainer.step + 1 in steps else loss, last=last)

    monkeypatch.setattr(trainer.method, "backward", backward)
    return ["loss"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_first_nonfinite_finds_one_bad_element_anywhere(dtype):
    """The guard's check (min and max of each tensor) names the first tensor holding a NaN, +Inf or
    −Inf wherever it sits, and passes the largest finite values, empty and integer tensors."""
    from baselines.base import first_nonfinite

    big = torch.finfo(dtype).max
    clean = [("empty", torch.empty(0, dtype=dtype)), ("ints", torch.arange(5)), ("none", None),
             ("extremes", torch.tensor([big, -big, 0.0], dtype=dtype)), ("w", torch.randn(64, 33).to(dtype))]
    assert first_nonfinite(clean) is None
    gen = torch.Generator().manual_seed(0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for _ in range(3):
            t = torch.randn(64, 33).to(dtype)
            i = int(torch.randint(t.numel(), (1,), generator=gen))
            t.view(-1)[i] = bad
            assert first_nonfinite([*clean, ("bad", t), ("later", t.clone())]) == "bad", (bad, i)


CASES = {  # method -> (overrides, where the NaN/Inf goes)
    "dense": (METHOD_ARGS["dense"] + ["rollout.engine=hf"], "grad"),  # an engine with its own copy: no sync on a skip
    "logra_sketch": (METHOD_ARGS["logra"], "sketch"),  # step control on: the propose path
    "logra_dense_grad": (METHOD_ARGS["logra"], "grad"),
    "lora": (METHOD_ARGS["lora"], "grad"),
    "galore": (METHOD_ARGS["galore"], "grad"),
    "galore_layerwise": (METHOD_ARGS["galore_layerwise"], "loss"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nonfinite_step_is_skipped_bit_for_bit(tmp_path, monkeypatch, case):
    overrides, where = CASES[case]
    trainer = _trainer(tmp_path / "r", "train.steps=3", "train.skip_zero_advantage=false", *overrides)
    if where == "loss":
        names = _inject_into_loss(monkeypatch, trainer, {2})
    else:
        names = _inject_after_backward(monkeypatch, trainer, {2}, _poison_sketch if where == "sketch" else _poison_grad)
    snaps = {}
    orig_step = trainer.train_step

    def train_step():
        snaps[trainer.step] = _snapshot(trainer)  # the state before step trainer.step + 1
        return orig_step()

    monkeypatch.setattr(trainer, "train_step", train_step)
    metrics = [m for m in trainer.train() if m["step"] > 0]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # the run went on
    assert [m["step/skipped"] for m in metrics] == [0.0, 1.0, 0.0]
    assert not _same(snaps[0]["model"], snaps[1]["model"])  # step 1 moved the weights ...
    assert _same(snaps[1], snaps[2])  # ... step 2 left weights and optimizer/sketch state exactly as they were
    assert not _same(snaps[2]["model"], _snapshot(trainer)["model"])  # ... and step 3 trained again
    assert all(bool(torch.isfinite(v).all()) for v in trainer.model.state_dict().values())
    if "rollout.engine=hf" in overrides:
        assert "sync/bytes" in metrics[0] and "sync/bytes" not in metrics[1]  # the engine was not touched
    skips = [json.loads(l) for l in (tmp_path / "r" / "skips.jsonl").read_text().splitlines()]
    assert [s["step"] for s in skips] == [2] and names[0] in skips[0]["nonfinite"][0]


def test_consecutive_skips_stop_with_a_checkpoint_of_the_last_good_weights(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "s", "train.steps=6", "checkpoint.every=0", "guard.max_consecutive_skips=2",
                       "train.skip_zero_advantage=false", *METHOD_ARGS["dense"])
    _inject_after_backward(monkeypatch, trainer, {2, 3, 4, 5, 6}, _poison_grad)
    after_step_1 = {}
    orig_step = trainer.train_step

    def train_step():
        if trainer.step == 1:
            after_step_1.update(_snapshot(trainer)["model"])
        return orig_step()

    monkeypatch.setattr(trainer, "train_step", train_step)
    with pytest.raises(NonFiniteError, match="2 consecutive steps skipped .*model.embed_tokens.weight.grad"):
        trainer.train()
    assert [p.name for p in list_checkpoints(tmp_path / "s")] == ["step_000003"]
    saved = load_file(str(list_checkpoints(tmp_path / "s")[-1] / "model.safetensors"))
    assert all(torch.equal(saved[k], after_step_1[k]) for k in saved)
    assert [m["step/skipped"] for m in read_metrics(tmp_path / "s") if m["step"] > 0] == [0.0, 1.0, 1.0]


def test_crash_in_a_checkpoint_write_leaves_the_previous_usable(tmp_path, monkeypatch, capsys):
    common = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=5", *METHOD_ARGS["dense"]]
    _trainer(tmp_path / "straight", *common).train()

    real_save, calls = ckpt.save_model, []

    def crashing_save(model, filename):  # the second checkpoint dies half-way through its weights file
        calls.append(filename)
        real_save(model, filename)
        if len(calls) == 2:
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            raise OSError("no space left on device (injected)")

    monkeypatch.setattr(ckpt, "save_model", crashing_save)
    with pytest.raises(OSError, match="injected"):
        _trainer(tmp_path / "split", *common).train()
    monkeypatch.setattr(ckpt, "save_model", real_save)
    root = tmp_path / "split" / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path / "split")] == ["step_000002"]
    assert (root / ".tmp_step_000004").is_dir()  # the half-written one
    fake = root / "step_000009"  # a directory under a real name without a manifest: ignored too
    fake.mkdir()
    (fake / "trainer_state.json").write_text('{"step": 9, "epoch": 0, "cursor": 0}')

    resumed = _trainer(tmp_path / "split", *common, "resume=true")
    out = capsys.readouterr().out
    assert "ignoring incomplete checkpoint" in out and ".tmp_step_000004" in out and "step_000009" in out
    assert resumed.step == 2
    resumed.train()
    assert not (root / ".tmp_step_000004").exists()  # the next save cleared the leftover
    a = load_file(str(list_checkpoints(tmp_path / "straight")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "split")[-1] / "model.safetensors"))
    assert list_checkpoints(tmp_path / "split")[-1].name == "step_000004"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _comparable(read_metrics(tmp_path / "straight")) == _comparable(read_metrics(tmp_path / "split"))


@pytest.mark.parametrize("victim", ["method.pt", "model.safetensors"])
def test_tampered_checkpoint_is_refused(tmp_path, victim):
    common = ["train.steps=1", *METHOD_ARGS["dense"]]
    _trainer(tmp_path / "t", *common).train()
    path = list_checkpoints(tmp_path / "t")[-1]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and set(manifest["files"]) == {"model.safetensors", "method.pt", "rng.pt", "trainer_state.json"}
    data = bytearray((path / victim).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    (path / victim).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"{victim} does not match its SHA-256"):
        _trainer(tmp_path / "t", *common, "resume=true")


def test_sigusr1_checkpoints_and_raises_preempted_in_process(tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path / "u", "train.steps=5", "checkpoint.every=0", *METHOD_ARGS["dense"])
    orig_step = trainer.train_step

    def train_step():
        if trainer.step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # what submitit's forwarded time-limit signal does
        return orig_step()

    monkeypatch.setattr(trainer, "train_step", train_step)
    with pytest.raises(Preempted, match="SIGUSR1: stopped at step 2"):
        trainer.train()
    assert [p.name for p in list_checkpoints(tmp_path / "u")] == ["step_000002"]
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before  # handlers restored
    with PreemptionSignals() as s:
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.received == "SIGTERM"


def test_oom_names_the_phase_and_the_planner_estimate(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "o", "train.steps=1", "train.skip_zero_advantage=false", *METHOD_ARGS["dense"])

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(trainer.method, "step", oom)
    with pytest.raises(torch.OutOfMemoryError) as e:
        trainer.train()
    msg = str(e.value)
    assert "'optimizer' phase" in msg and "Planner estimate for this run" in msg and "GiB per GPU" in msg
    assert "Tried to allocate 2.00 GiB (injected)" in msg
    trainer = _trainer(tmp_path / "o2", "train.steps=1", *METHOD_ARGS["dense"])
    monkeypatch.setattr(trainer.engine, "generate", oom)
    with pytest.raises(torch.OutOfMemoryError, match="'rollout' phase"):
        trainer.train()


# ---- real processes: SIGTERM and kill -9 ----------------------------------------------------------
PROC = [*FAST, "train.steps=6", "eval.every=3", *METHOD_ARGS["logra"]]  # sketches and step control across the cut
LAUNCH = "import sys, tests.toy_task; from experiments.train import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: (its final weights, its metrics)."""
    path = tmp_path_factory.mktemp("ref") / "run"
    n = torch.get_num_threads()
    try:
        GRPOTrainer(build_config([*PROC, f"out_dir={path}"])).train()
    finally:
        torch.set_num_threads(n)
    return load_file(str(list_checkpoints(path)[-1] / "model.safetensors")), read_metrics(path)


def _start(run_dir, *extra):
    return subprocess.Popen([sys.executable, "-c", LAUNCH, *PROC, f"out_dir={run_dir}", *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(proc, run_dir, step, timeout=120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        rows = [l for l in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").exists() else []
        if any(json.loads(l)["step"] >= step for l in rows if l.endswith("}")):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before step {step}:\n{proc.stdout.read()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no step {step} within {timeout} s")


def _resume_and_compare(run_dir, reference, *extra):
    resumed = GRPOTrainer(build_config([*PROC, f"out_dir={run_dir}", *extra, "resume=true"]))
    start = resumed.step
    resumed.train()
    weights, metrics = reference
    final = load_file(str(list_checkpoints(run_dir)[-1] / "model.safetensors"))
    assert final.keys() == weights.keys() and all(torch.equal(final[k], weights[k]) for k in final)
    return start, read_metrics(run_dir)


def test_sigterm_subprocess_exits_143_and_resumes_to_the_same_run(tmp_path, reference):
    run_dir = tmp_path / "term"
    proc = _start(run_dir, "checkpoint.every=0")
    _wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "preempted: SIGTERM: stopped at step" in out
    stopped = list_checkpoints(run_dir)
    assert len(stopped) == 1 and 2 <= int(stopped[0].name[5:]) < 6  # the preemption checkpoint, not the final one
    start, metrics = _resume_and_compare(run_dir, reference, "checkpoint.every=0")
    assert start == int(stopped[0].name[5:])
    assert _comparable(metrics) == _comparable(reference[1])


def test_kill_9_at_a_random_step_then_resume_gives_the_same_weights(tmp_path, reference):
    run_dir = tmp_path / "kill"
    step = random.SystemRandom().randint(1, 4)
    print(f"kill -9 once step {step} is logged")
    proc = _start(run_dir, "checkpoint.every=1")
    _wait_for_step(proc, run_dir, step)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    start, metrics = _resume_and_compare(run_dir, reference, "checkpoint.every=1")
    assert start >= step - 1
    assert _comparable(metrics) == _comparable(reference[1])


def test_resume_accepts_a_key_added_since_at_its_default(tmp_path):
    """A run recorded before a config key existed (here: log.memory_profile) resumes while the key
    holds its default; a non-default value is still a refused change."""
    from omegaconf import OmegaConf

    from experiments.config import ConfigError

    common = ["train.steps=1", *METHOD_ARGS["dense"]]
    _trainer(tmp_path / "k", *common).train()
    saved = OmegaConf.load(tmp_path / "k" / "config.yaml")
    del saved.log["memory_profile"]
    (tmp_path / "k" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert _trainer(tmp_path / "k", *common, "resume=true").step == 1
    with pytest.raises(ConfigError, match="log.memory_profile"):
        _trainer(tmp_path / "k", *common, "resume=true", "log.memory_profile=true")
