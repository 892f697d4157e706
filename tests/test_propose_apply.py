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


def test_probe_rows_scale_with_the_batch():
    from logra_core.step_control import StepControlConfig

    c = StepControlConfig(probe_fraction=0.06, probe_min=0)  # at most 16, no floor
    assert [c.probe_rows(b) for b in (1, 8, 16, 32, 64, 256, 1024)] == [1, 1, 1, 2, 4, 15, 16]
    # default: a quarter, at least 12 (or the batch), at most 16
    assert [StepControlConfig().probe_rows(b) for b in (4, 16, 40, 64, 256)] == [4, 12, 12, 16, 16]
    assert StepControlConfig(probe_fraction=1.0, probe_seqs=16).probe_rows(16) == 16  # the whole batch: the exact path
    assert StepControlConfig(probe_fraction=1.0, probe_seqs=64).probe_rows(16) == 16
    floor = StepControlConfig(probe_min=12)  # a quarter, but at least 12 rows (or the whole batch), at most 16
    assert [floor.probe_rows(b) for b in (4, 8, 16, 24, 48, 64, 256)] == [4, 8, 12, 12, 12, 16, 16]
    with pytest.raises(ValueError, match="probe_min"):
        StepControlConfig(probe_min=-1)
    with pytest.raises(ValueError, match="probe_fraction"):
        StepControlConfig(probe_fraction=0.0)


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def _backward(model, step):
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(10 + step))
    model(input_ids=ids).logits.float().sin().sum().backward()


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_logra_update_equals_rowadam_by_hand(scale):
    """Three steps of propose/apply(scale): each sketched weight moves by
    W ← W(1 − sηλ) − sη·(S / (√v̂ + ε))·A with v ← β₂v + (1 − β₂)·mean_j S_ij², v̂ = v/(1 − β₂ᵗ),
    S the recorded sketch and A = projection(r, n, seed, layer, step) rebuilt from its key."""
    from logra_core.optimizer import LoGRA
    from logra_core.sketch import projection

    lr, wd, beta2, eps, r, seed = 1e-2, 0.1, 0.9, 1e-8, 4, 7
    model = _tiny_llama()
    opt = LoGRA(model, rank=r, lr=lr, weight_decay=wd, seed=seed)
    v = {}
    for t in range(1, 4):
        opt.zero_grad()
        _backward(model, t)
        recorded = {n: (m.weight.detach().clone(), m.sketch_state.sketch.clone(), m.sketch_state.layer)
                    for n, m in opt.modules_by_name.items()}
        update = opt.propose()
        opt.apply(update, scale)
        for name, (W, S, layer) in recorded.items():
            v[name] = beta2 * v.get(name, torch.zeros(S.shape[0])) + (1 - beta2) * S.square().mean(1)
            D = S / ((v[name] / (1 - beta2**t)).sqrt().unsqueeze(1) + eps)
            A = projection(r, W.shape[1], seed, layer, t - 1)
            expected = W * (1 - scale * lr * wd) - scale * lr * D @ A
            torch.testing.assert_close(opt.modules_by_name[name].weight.detach(), expected, rtol=1e-5, atol=1e-6,
                                       msg=f"{name} step {t}")


def test_logra_unsketched_tensors_follow_torch_adamw():
    """LoGRA's AdamW group (norms, the embedding) equals torch.optim.AdamW on copies of those tensors,
    fed the same gradients, step for step (dense_lr, betas, weight decay)."""
    from logra_core.optimizer import LoGRA

    model = _tiny_llama()
    opt = LoGRA(model, rank=4, lr=1e-2, dense_lr=3e-3, dense_weight_decay=0.05, dense_betas=(0.8, 0.99))
    dense = opt.param_groups[1]["params"]
    copies = [p.detach().clone().requires_grad_() for p in dense]
    ref = torch.optim.AdamW(copies, lr=3e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    for t in range(4):
        opt.zero_grad()
        _backward(model, t)
        for c, p in zip(copies, dense):
            c.grad = p.grad.clone()
        opt.apply(opt.propose(), 1.0) if t % 2 else opt.step()
        ref.step()
        for c, p in zip(copies, dense):
            torch.testing.assert_close(p.detach(), c.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [0.0, 0.3, 1.0])
def test_dense_apply_moves_by_scale_times_torch_adamw_step(tmp_path, scale):
    """dense: propose() then apply(s) moves θ by s × (the step torch.optim.AdamW takes on a copy)."""
    t = _trainer(tmp_path, "s", METHODS["dense"] + ["dense.max_grad_norm=0"])
    _accumulate(t)
    before = _params(t)
    copies = {n: p.detach().clone().requires_grad_() for n, p in t.model.named_parameters()}
    for n, p in t.model.named_parameters():
        copies[n].grad = p.grad.clone()
    c = t.cfg.dense
    torch.optim.AdamW(list(copies.values()), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                      weight_decay=c.weight_decay).step()
    update, _ = t.method.propose()
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters())  # nothing applied yet
    t.method.apply(update, scale)
    for n, p in t.model.named_parameters():
        torch.testing.assert_close(p.detach() - before[n], scale * (copies[n].detach() - before[n]),
                                   atol=1e-6, rtol=1e-4, msg=n)
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
    """On by default for logra only (docs/design.md §3.2); `step_control.enabled` overrides either way."""
    t = _trainer(tmp_path, "d", [*METHODS[method], "train.steps=2", *args])
    rows = [m for m in t.train() if m["step"] > 0 and m["rollout/trained_seqs"] > 0]
    assert rows and all(("step/scale" in m) == controlled for m in rows)
    t.close()
