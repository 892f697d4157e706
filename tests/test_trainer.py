"""Tier 2 and 3: tiny end-to-end GRPO runs, accumulation and resume invariants."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from experiments.config import build_config
from experiments.rl.checkpoint import list_checkpoints
from experiments.rl.metrics import read_metrics
from experiments.rl.trainer import GRPOTrainer
from tests.conftest import TINY
from experiments.rl.tasks import TaskConfig, held_out
from tests.toy_task import Toy, ToyMarked  # noqa: F401  (registers the toy tasks)

pytestmark = pytest.mark.integration


def run(tmp_path, *overrides, name="run"):
    cfg = build_config([*TINY, f"out_dir={tmp_path / name}", *overrides])
    trainer = GRPOTrainer(cfg)
    return trainer, trainer.train()


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


METHOD_ARGS = {
    "dense": ["method=dense"],
    "logra": ["method=logra", "logra.rank=8", "logra.lr=1e-3"],
    "logra_embeddings": ["method=logra", "logra.rank=8", "logra.lr=1e-3", "logra.embeddings=true"],
    # update_proj_gap=2: the subspace is recomputed during the run and across a resume
    "galore": ["method=galore", "galore.rank=8", "galore.lr=1e-3", "galore.update_proj_gap=2"],
    "galore_layerwise": ["method=galore_layerwise", "galore_layerwise.rank=8", "galore_layerwise.lr=1e-3",
                         "galore_layerwise.update_proj_gap=2"],
    "lora": ["method=lora", "lora.r=4", "lora.lr=1e-2"],
}


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_three_steps_learn_something(tmp_path, method):
    cfg = build_config([*TINY, f"out_dir={tmp_path / 'r'}", "train.steps=3", *METHOD_ARGS[method]])
    trainer = GRPOTrainer(cfg)
    before = _weights(trainer)
    trainable = {n for n, p in trainer.model.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert trainable
    metrics = trainer.train()
    train_rows = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in train_rows] == [1, 2, 3]
    assert all(math.isfinite(m["loss/policy"]) for m in train_rows)
    assert sum(m["rollout/trained_seqs"] for m in train_rows) > 0
    after = trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == trainable, f"unchanged trainable: {trainable - changed}; changed frozen: {changed - trainable}"
    for key in ("reward/mean", "reward/accuracy", "loss/policy", "clip/fraction", "time/step_s",
                "time/rollout_s", "time/train_s", "mem/peak_bytes"):
        assert key in train_rows[0]
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in train_rows[-1]
    run_dir = tmp_path / "r"
    assert (run_dir / "config.yaml").exists() and "git_sha" in (run_dir / "meta.json").read_text()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000003"]


def test_accumulation_equals_whole_batch(tmp_path):
    """Gradients of one 8-sequence micro-batch equal two of 4 (and 8 of 1) accumulated."""
    trainer = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path / 'acc'}", "train.group_size=4"]))
    torch.manual_seed(1)
    rollouts = trainer.engine.generate(trainer._prompts(trainer.train_problems[:2]), n=4)
    advantages = torch.linspace(-1.5, 1.5, 8)
    rows = torch.arange(8)
    grads = {}
    for size in (8, 4, 1):
        trainer.method.zero_grad()
        trainer.accumulate_gradients(rollouts, advantages, [rows[i : i + size] for i in range(0, 8, size)])
        grads[size] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    for size in (4, 1):
        for name in grads[8]:
            torch.testing.assert_close(grads[size][name], grads[8][name], atol=1e-6, rtol=0, msg=f"{size}: {name}")
    trainer.close()


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_resume_invariance(tmp_path, method):
    """6 steps straight == 3 steps, stop, resume, 3 more: same metrics, same weights."""
    common = ["train.steps=6", "checkpoint.every=3", "checkpoint.keep=5", "eval.every=3", *METHOD_ARGS[method]]
    straight, m_straight = run(tmp_path, *common, name="straight")

    cfg = build_config([*TINY, f"out_dir={tmp_path / 'split'}", *common])
    first = GRPOTrainer(cfg)
    first.cfg.train.steps = 3  # stop early, as a killed job would after its checkpoint
    first.train()
    resumed, m_resumed = run(tmp_path, *common, "resume=true", name="split")
    assert resumed.step == 6
    assert _comparable(m_straight) == _comparable(m_resumed)
    a = load_file(str(list_checkpoints(tmp_path / "straight")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "split")[-1] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_existing_run_dir_needs_resume(tmp_path):
    run(tmp_path, "train.steps=1", "eval.every=0", name="x")
    with pytest.raises(FileExistsError, match="resume=true"):
        run(tmp_path, "train.steps=1", "eval.every=0", name="x")


def test_resume_refuses_changed_config(tmp_path):
    from experiments.config import ConfigError

    run(tmp_path, "train.steps=1", "eval.every=0", name="y")
    with pytest.raises(ConfigError, match="train.group_size"):
        run(tmp_path, "train.steps=2", "eval.every=0", "resume=true", "train.group_size=2", name="y")


def test_ppo_epochs_and_kl_penalty_run(tmp_path):
    _, metrics = run(tmp_path, "train.steps=2", "train.ppo_epochs=2", "train.kl_coef=0.1", "eval.every=0", name="k")
    rows = [m for m in metrics if m["step"] > 0]
    assert all(math.isfinite(m["loss/policy"]) and m["kl/ref"] >= 0 for m in rows)
    # on-policy first epoch: the sampler's and the trainer's log-probs agree
    assert all(abs(m["kl/sampler_trainer"]) < 1e-4 for m in rows)


def test_resume_without_checkpoint_restarts_cleanly(tmp_path):
    """A run that died before its first checkpoint restarts from 0 without duplicate records."""
    run(tmp_path, "train.steps=2", "checkpoint.every=0", name="c")
    import shutil

    shutil.rmtree(tmp_path / "c" / "checkpoints")
    _, metrics = run(tmp_path, "train.steps=2", "checkpoint.every=0", "resume=true", name="c")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert [line["step"] for line in _outcomes(tmp_path / "c")] == [0, 2]  # the step-0 evaluation not twice


def test_tensorboard_option_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    run(tmp_path, "train.steps=1", "eval.every=0", "log.tensorboard=true", name="tb")
    assert list((tmp_path / "tb" / "tb").glob("events.out.tfevents.*"))


def test_reward_timeouts_are_logged_per_step(tmp_path, monkeypatch):
    """A verifier that reports hard timeouts (MathVerifyReward.timeouts) gets them counted per step."""
    from tests import toy_task

    class Slow(toy_task._LengthParityReward):
        timeouts = 0

        def __call__(self, completions, references):
            self.timeouts += 2  # two answers of this call ran past the timeout
            return super().__call__(completions, references)

    monkeypatch.setattr(toy_task.Toy, "reward_function", lambda self: Slow())
    _, metrics = run(tmp_path, "train.steps=2", "eval.every=0")
    assert [m["reward/timeouts"] for m in metrics] == [2.0, 2.0]


def test_the_run_seed_orders_the_evaluated_held_out_problems(tmp_path):
    test = Toy(TaskConfig(name="toy")).test_split()  # 8 problems
    seen = {}
    for seed in (0, 1):
        trainer = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path / str(seed)}", f"seed={seed}", "eval.size=5"]))
        seen[seed] = [p.uid for p in trainer.test_problems]
        trainer.close()
        assert seen[seed] == [p.uid for p in held_out(test, 5, seed)]
    assert seen[0] != seen[1]


def _outcomes(run_dir):
    return [json.loads(line) for line in (run_dir / "eval_outcomes.jsonl").read_text().splitlines()]


def test_eval_outcomes_match_the_metrics_and_are_redone_after_a_resume(tmp_path):
    """eval_outcomes.jsonl: one line per evaluation with the held-out problems by uid in the run's order
    and each one's known outcome (toy_marked: solved iff its index ≡ 0 mod 3), as many solved as
    eval/accuracy counts; resuming from an earlier checkpoint drops the later lines and writes them again."""
    common = ["task=toy_marked", "train.steps=4", "eval.every=2", "eval.size=5", "eval.batch_size=2",
              "checkpoint.every=2", "checkpoint.keep=5", "seed=1"]
    _, metrics = run(tmp_path, *common, name="o")
    uids = [p.uid for p in held_out(ToyMarked(TaskConfig(name="toy_marked")).test_split(), 5, 1)]
    expected = "".join("1" if int(uid.rsplit("/", 1)[1]) % 3 == 0 else "0" for uid in uids)
    assert uids != sorted(uids, key=lambda u: int(u.rsplit("/", 1)[1])) and "1" in expected and "0" in expected
    lines = _outcomes(tmp_path / "o")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [line["step"] for line in lines] == [m["step"] for m in evals] == [0, 2, 4]
    for line, m in zip(lines, evals):
        assert line["problem_ids"] == uids and line["correct"] == expected
        assert line["correct"].count("1") == round(m["eval/accuracy"] * m["eval/num_problems"])
    written = (tmp_path / "o" / "eval_outcomes.jsonl").read_text()

    shutil.rmtree(list_checkpoints(tmp_path / "o")[-1])  # as if killed after step 4's evaluation, before its checkpoint
    resumed, metrics = run(tmp_path, *common, "resume=true", name="o")
    assert resumed.step == 4 and [m["step"] for m in metrics if "eval/accuracy" in m] == [0, 2, 4]
    assert (tmp_path / "o" / "eval_outcomes.jsonl").read_text() == written  # step 4's line dropped, then redone
