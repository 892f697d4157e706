"""bf16 training without lost updates (docs/precision.md): mixed precision of the baselines, LoGRA's
``master`` modes (fp32 / kahan / stochastic / none), their sync and resume."""

import copy

import pytest
import torch
import transformers

from baselines import METHODS
from logra_core.optimizer import LoGRA
from logra_core.precision import (merge_lowrank_, new_buffer, random_bits16, round_key,
                                  stochastic_round_bf16)
from logra_core.sync import SyncReceiver, SyncSender

pytestmark = pytest.mark.unit

MODES = ("fp32", "kahan", "stochastic", "none")


def tiny(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def loss_of(model, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 10), generator=gen)
    return (model(ids).logits.float() * torch.randn(2, 10, 96, generator=gen)).mean()


# ---- every method's bf16 step lands ----------------------------------------------------------------
LR = 1e-5
METHOD_CFGS = {
    "dense": dict(lr=LR),
    "galore": dict(lr=LR, rank=4),
    "galore_layerwise": dict(lr=LR, rank=4),
    "lora": dict(lr=LR, r=4),
    "logra": dict(lr=LR, dense_lr=LR, rank=4),
    "logra_kahan": dict(lr=LR, dense_lr=LR, rank=4, master="kahan"),
}


def two_steps(name, **overrides):
    method_name = name.split("_kahan")[0]
    cls = METHODS[method_name]
    method = cls(cls.config_cls(**{**METHOD_CFGS[name], **overrides}))
    model = method.setup(tiny())
    before = {n: t.clone() for n, t in method.full_precision_parameters().items()}
    for step in range(2):  # LoRA's A moves from the second step on (B starts at zero)
        method.zero_grad()
        method.backward(loss_of(model, step), last=True)
        method.step()
    return method, before


@pytest.mark.parametrize("name", list(METHOD_CFGS))
def test_a_bf16_step_at_lr_1e5_moves_every_trainable_tensor(name):
    """Norms (1.0, spacing 7.8e-3) and embeddings (~0.02, spacing 1.2e-4) included: each tensor's value
    as the optimizer keeps it (the fp32 master under mixed precision) changes."""
    method, before = two_steps(name)
    after = method.full_precision_parameters()
    assert before.keys() == after.keys() and after
    frozen = [n for n in after if torch.equal(before[n], after[n])]
    assert not frozen, f"unchanged by two steps at lr {LR}: {frozen}"
    norms = [n for n in after if "norm" in n]
    if name != "lora":
        assert norms and all(after[n].dtype == torch.float32 for n in norms)


@pytest.mark.parametrize("name,kw", [("dense", dict(precision="bf16")), ("logra", dict(dense_precision="bf16"))])
def test_pure_bf16_adamw_loses_the_norm_updates(name, kw):
    """The extra baseline (precision=bf16, the old behaviour): 1.0 + ~1e-5 rounds back to 1.0."""
    method, before = two_steps(name, **kw)
    after = method.full_precision_parameters()
    norms = [n for n in after if "norm" in n]
    assert norms and all(torch.equal(before[n], after[n]) for n in norms)


def test_mixed_dense_keeps_fp32_moments_and_rounds_its_masters():
    method, _ = two_steps("dense")
    masters = method.master_weights.by_name()
    params = dict(method.model.named_parameters())
    assert all(torch.equal(params[n], m.to(torch.bfloat16)) for n, m in masters.items())
    state = method.optimizer.state
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())


# ---- stochastic rounding ---------------------------------------------------------------------------
@pytest.mark.parametrize("x", [1.0 + 1e-5, 0.02 + 3e-5, -0.3 - 7e-4, 1.0e-3 + 1.234e-7])
def test_stochastic_rounding_is_unbiased(x):
    n = 40_000
    value = torch.full((n,), x, dtype=torch.float32)
    rounded = stochastic_round_bf16(value, round_key(3, 7, 1)).double()
    lo, hi = rounded.min().item(), rounded.max().item()
    assert {lo, hi} == set(rounded.unique().tolist()) and lo <= x <= hi  # only the two neighbours
    p = (value.double()[0].item() - lo) / (hi - lo) if hi > lo else 0.0
    se = (hi - lo) * (p * (1 - p) / n) ** 0.5
    assert abs(rounded.mean().item() - value.double()[0].item()) <= 3 * se + 1e-12
    assert 0 < (rounded == hi).sum() < n  # both directions occur (x is not a bf16 number)


def test_stochastic_rounding_is_reproducible_from_its_key():
    x = torch.randn(1000) * 0.02
    a, b = stochastic_round_bf16(x, round_key(0, 5, 2)), stochastic_round_bf16(x, round_key(0, 5, 2))
    assert torch.equal(a, b)
    for other in (round_key(1, 5, 2), round_key(0, 6, 2), round_key(0, 5, 3)):
        assert not torch.equal(a, stochastic_round_bf16(x, other))
    # element i's bits depend on (key, global index) only: a row shard at its offset draws the same
    bits = random_bits16(1000, round_key(0, 5, 2))
    assert torch.equal(bits[600:], random_bits16(400, round_key(0, 5, 2), offset=600))
    assert 0 <= int(bits.min()) and int(bits.max()) < 2**16 and abs(bits.double().mean().item() / 2**15 - 1) < 0.05


def test_exact_values_and_specials_are_kept():
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf")])
    assert torch.equal(stochastic_round_bf16(x, 123).float(), x)
    assert torch.isnan(stochastic_round_bf16(torch.tensor([float("nan")]), 1)).all()


# ---- the merge: kahan tracks the fp32 master, none drifts ------------------------------------------
def test_modes_collapse_to_plain_fp32_on_an_fp32_weight():
    W, L, A = torch.randn(6, 5), torch.randn(6, 2), torch.randn(2, 5)
    ref = W.clone().addmm_(L, A)
    for mode in MODES:
        w = W.clone()
        assert new_buffer(w, mode) is None
        merge_lowrank_(w, L, A, master=mode, key=9)
        assert torch.equal(w, ref)


def synthetic_run(mode, steps=200, seed=0):
    """LoGRA on a tiny bf16 model fed the sketches S = G Aᵀ of one fixed gradient G per weight (no
    backward): the updates D A are the same in every mode, so the modes differ only in how W takes
    them, and the weights drift steadily along −G (E[Aᵀ A] ∝ I)."""
    model = tiny(seed=seed)
    opt = LoGRA(model, rank=4, lr=1e-5, master=mode)
    modules = list(dict.fromkeys(opt.modules_by_name.values()))
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(m.weight.shape, generator=gen) for m in modules]
    for _ in range(steps):
        for m, g in zip(modules, grads):
            m.sketch_state.sketch = g @ m.sketch_state.projection(g.shape[1], g.device).float().t()
        opt.step()
    return model, opt, start


def test_kahan_tracks_the_fp32_master_and_none_drifts():
    """200 steps at lr 1e-5 of identical updates: kahan's W + C stays within 1e-3 (relative) of the fp32
    master; the bf16 weights of kahan and stochastic carry the master's whole move (projected on it),
    round-to-nearest loses most of it."""
    _, ref_opt, start = synthetic_run("fp32")
    masters = ref_opt.masters()
    assert masters
    rel, captured = {}, {}
    for mode in ("kahan", "none", "stochastic"):
        model, opt, _ = synthetic_run(mode)
        params = dict(model.named_parameters())
        rel[mode] = max(((opt.full_precision(params[n]) - m).norm() / m.norm()).item() for n, m in masters.items())
        moved = {n: m - start[n] for n, m in masters.items()}
        captured[mode] = (sum(((params[n].float() - start[n]) * d).sum().item() for n, d in moved.items())
                          / sum(d.square().sum().item() for d in moved.values()))
    assert rel["kahan"] <= 1e-3, rel
    assert rel["none"] > 10 * rel["kahan"], rel
    assert abs(captured["kahan"] - 1) < 0.05 and abs(captured["stochastic"] - 1) < 0.05, captured
    assert captured["none"] < 0.5, captured  # updates below half the bf16 spacing rounded away


def test_kahan_memory_is_a_bf16_buffer_and_stochastic_keeps_none():
    _, kahan, _ = synthetic_run("kahan", steps=1)
    _, stoch, _ = synthetic_run("stochastic", steps=1)
    assert kahan.masters() and all(b.dtype == torch.bfloat16 for b in kahan.masters().values())
    assert stoch.masters() == {}


def test_fp16_stochastic_is_refused():
    with pytest.raises(ValueError, match="bfloat16"):
        LoGRA(tiny(torch.float16), rank=4, master="stochastic")


# ---- sync and resume, bit for bit ------------------------------------------------------------------
def logra_train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_twenty_bf16_steps_sync_bit_exact(mode):
    model = tiny()
    engine = copy.deepcopy(model).requires_grad_(False)
    opt = LoGRA(model, rank=4, lr=1e-3, weight_decay=0.1, master=mode)
    sender, receiver = SyncSender(model), SyncReceiver(engine)
    assert receiver.receive(sender.full(opt.masters()))
    for step in range(20):
        logra_train(model, opt, 1, step)
        payload = sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())
        assert all(op.master == mode for op in payload.lowrank.values())
        assert receiver.receive(payload), receiver.last_error
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(engine.named_parameters())[n]), n
    mine, theirs = opt.masters(), receiver.tensors.masters
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    # a full resync mid-run carries the buffers, and later steps stay equal
    fresh = SyncReceiver(copy.deepcopy(engine))
    assert fresh.receive(sender.full(opt.masters()))
    logra_train(model, opt, 1, 20)
    assert fresh.receive(sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())), fresh.last_error


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_exact(mode):
    kw = dict(rank=4, lr=1e-3, weight_decay=0.1, master=mode)
    model = tiny()
    opt = LoGRA(model, **kw)
    logra_train(model, opt, 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    logra_train(model, opt, 3, 3)
    resumed = tiny(seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = LoGRA(resumed, **kw)
    opt2.load_state_dict(saved_opt)
    logra_train(resumed, opt2, 3, 3)
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    assert all(torch.equal(a, opt2.masters()[n]) for n, a in opt.masters().items())


@pytest.mark.parametrize("name", ["dense", "galore", "galore_layerwise"])
def test_mixed_precision_resume_is_bit_exact(name):
    cls = METHODS[name]

    def build():
        m = cls(cls.config_cls(**METHOD_CFGS[name]))
        return m, m.setup(tiny())

    def train(method, model, steps, start):
        for step in range(start, start + steps):
            method.zero_grad()
            method.backward(loss_of(model, step), last=True)
            method.step()

    method, model = build()
    train(method, model, 2, 0)
    saved = copy.deepcopy((model.state_dict(), method.state_dict()))
    train(method, model, 2, 2)
    method2, model2 = build()
    model2.load_state_dict(saved[0])
    method2.load_state_dict(saved[1])
    train(method2, model2, 2, 2)
    a, b = method.full_precision_parameters(), method2.full_precision_parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)
