"""The propose/apply protocol: an update computed without being applied, then θ ← θ + s·Δ."""

import pytest
import torch

from experiments.config import build_config
from experiments.rl.trainer import GRPOTrainer
from logra_core.step_control import step_scale
from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.integration

METHODS = {
    "dense": ["method=dense", "dense.lr=1e-3"],
    "logra": ["method=logra", "logra.rank=8", "logra.lr=1e-3", "logra.weight_decay=0.1"],
    "logra_embeddings": ["method=logra", "logra.rank=8", "logra.lr=1e-3", "logra.embeddings=true"],
    "logra_svd": ["method=logra", "logra.rank=8", "logra.lr=1e-3", "logra.projection=svd", "logra.weight_decay=0.1"],
    "galore": ["method=galore", "galore.rank=8", "galore.lr=1e-3"],
    "lora": ["method=lora", "lora.r=4", "lora.lr=1e-2"],
}


@pytest.mark.unit
def test_step_scale_rule():
    # s = min(1, sqrt(κ / KL̂)): KL̂ = 4κ -> 1/2; KL̂ = 100κ -> 1/10
    assert step_scale(4e-3, 1e-3) == pytest.approx(0.5)
    assert step_scale(0.1, 1e-3) == pytest.approx(0.1)
    assert step_scale(1e-4, 1e-3) == 1.0 and step_scale(0.0, 1e-3) == 1.0
    assert step_scale(float("nan"), 1e-3) == 0.0 and step_scale(float("inf"), 1e-3) == 0.0


def _trainer(tmp_path, name, args):
    return GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path / name}", "eval.every=0", *args]))


def _accumulate(trainer):
    torch.manual_seed(3)
    rollouts = trainer.engine.generate(trainer._prompts(trainer.train_problems[:2]), n=4)
    rows = torch.arange(8)
    trainer.method.zero_grad()
    trainer.accumulate_gradients(rollouts, torch.linspace(-1.5, 1.5, 8), [rows[:4], rows[4:]])


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_propose_then_apply_equals_step(tmp_path, method):
    """Two steps each: step() on one copy; propose, check nothing moved, apply(1) on the other."""
    a, b = _trainer(tmp_path, "a", METHODS[method]), _trainer(tmp_path, "b", METHODS[method])
    for _ in range(2):
        _accumulate(a)
        a.method.step()
        _accumulate(b)
        before = _params(b)
        update, stats = b.method.propose()
        assert "step/grad_norm" in stats
        assert all(torch.equal(before[n], p) for n, p in b.model.named_parameters())  # nothing applied yet
        assert update.lowrank or update.dense
        b.method.apply(update, 1.0)
    exact = method.startswith("logra")  # LoGRA applies its own factors: the very same operations as step()
    for name, p in a.model.named_parameters():
        q = dict(b.model.named_parameters())[name]
        if exact:
            assert torch.equal(p, q), name
        else:  # θ_old + (θ_new − θ_old) rounds like θ_new to within an ulp or two
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    a.close(), b.close()


@pytest.mark.parametrize("method", ["dense", "logra", "lora"])
@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_apply_moves_by_scale_times_delta(tmp_path, method, scale):
    t = _trainer(tmp_path, "s", METHODS[method])
    _accumulate(t)
    before = _params(t)
    update, _ = t.method.propose()
    t.method.apply(update, scale)
    modules = dict(t.model.named_modules())
    expected = {n: torch.zeros_like(p) for n, p in before.items()}
    for name, delta in update.dense.items():
        expected[name] += delta
    for name, (d, a) in update.lowrank.items():
        expected[name + ".weight"] += d @ a
        assert modules[name].weight.shape == (d.shape[0], a.shape[1])
    assert update.lowrank if method == "logra" else not update.lowrank
    for name, p in t.model.named_parameters():
        torch.testing.assert_close(p - before[name], scale * expected[name], atol=1e-6, rtol=1e-4, msg=name)
    t.close()


def test_layerwise_galore_refuses_step_control(tmp_path):
    from experiments.config import ConfigError

    with pytest.raises(ConfigError, match="galore_layerwise"):
        _trainer(tmp_path, "l", ["method=galore_layerwise", "step_control.enabled=true"])


@pytest.mark.parametrize("method", ["dense", "logra", "lora"])
def test_controlled_steps_land_near_the_target(tmp_path, method):
    """A tiny run with a small κ: every step is shrunk (s < 1) and its realized KL is within ±25 % of κ."""
    target = 1e-5
    t = _trainer(tmp_path, "c", [*METHODS[method], "train.steps=2", "step_control.enabled=true",
                                 f"step_control.target_kl={target}", "step_control.measure_realized=true"])
    rows = [m for m in t.train() if m["step"] > 0 and m["rollout/trained_seqs"] > 0]
    assert rows
    for m in rows:
        assert m["kl/predicted"] > 0 and 0 < m["step/scale"] < 1
        assert m["kl/predicted_scaled"] == pytest.approx(target, rel=1e-6)
        assert m["kl/realized"] == pytest.approx(target, rel=0.25)


@pytest.mark.parametrize("method,args,controlled", [
    ("logra", [], True), ("logra", ["step_control.enabled=false"], False),
    ("dense", [], False), ("dense", ["step_control.enabled=true"], True), ("lora", [], False),
])
def test_step_control_default_per_method(tmp_path, method, args, controlled):
    """On by default for logra only (DESIGN §3.2); `step_control.enabled` overrides either way."""
    t = _trainer(tmp_path, "d", [*METHODS[method], "train.steps=2", *args])
    rows = [m for m in t.train() if m["step"] > 0 and m["rollout/trained_seqs"] > 0]
    assert rows and all(("step/scale" in m) == controlled for m in rows)
    t.close()
