"""The colocated vLLM engine's start and life cycle, against a stand-in for vLLM's ``LLM`` (no vLLM needed):
every engine start passes gpu_memory_utilization, the rank's device and the rank's seed; the in-place path
applies payloads to the engine's own fused parameters (same storage, no shadow copy); sleep level 1 keeps
the weights (a payload wakes them first), level 2 drops them and makes the sender send every tensor."""

import os
import sys
import types

import pytest
import torch
import transformers
from torch import nn

import experiments.rl.vllm_engine as vllm_engine
from experiments.rl.rollout import RolloutConfig
from experiments.rl.sync_stats import WeightSync
from experiments.rl.vllm_config import SEED_STRIDE, VLLMConfig, engine_bytes, utilization
from experiments.rl.vllm_layout import fuse, layout
from logra_core.optimizer import LoGRA

pytestmark = pytest.mark.unit

GIB = 2**30


@pytest.fixture(autouse=True)
def rank_environment():
    """``start_llm`` sets RANK / WORLD_SIZE / LOCAL_RANK for vLLM's external_launcher (under torchrun they are
    already the launcher's). Outside torchrun they would outlive the test and make a later test's trainer
    initialize torch.distributed (seen: MASTER_ADDR expected), so they are restored after each test."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny(dtype=torch.bfloat16):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


class FakeLLM:
    """vLLM's ``LLM`` as the engine uses it: records its arguments and the environment at start; holds
    vLLM-laid-out parameters (fused q/k/v, gate/up; padded vocabulary) filled with dummy weights; sleep
    level 1 keeps a host copy, level 2 leaves garbage (NaN) after waking, as vLLM documents."""

    starts: list = []
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, model, tokenizer, **kwargs):
        import os
        FakeLLM.starts.append(dict(kwargs, env={k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}))
        self.kwargs, self.calls, self.saved = kwargs, [], None
        self.model = FakeLLM.build(kwargs) if FakeLLM.trainer is not None else None
        self.llm_engine = types.SimpleNamespace(engine_core=None)

    trainer = None  # the trainer's model whose shapes the fake lays out

    @staticmethod
    def build(kwargs):
        hf = {n: torch.randn(p.shape).to(p.dtype) for n, p in FakeLLM.trainer.named_parameters()}  # "dummy" weights
        module = nn.Module()
        for name, t in fuse(hf, layout({n: tuple(t.shape) for n, t in hf.items()})).items():
            module.register_parameter(name.replace(".", "__"), nn.Parameter(t, requires_grad=False))
        module.named_parameters = lambda: [(n.replace("__", "."), p) for n, p in nn.Module.named_parameters(module)]
        module.packed_modules_mapping = FakeLLM.packed_modules_mapping
        return module

    def collective_rpc(self, fn, args=(), kwargs=None):
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: self.model))
        return [fn(worker, *args, **(kwargs or {}))]

    def sleep(self, level):
        self.calls.append(("sleep", level))
        params = dict(self.model.named_parameters())
        self.saved = {n: p.data.clone() for n, p in params.items()} if level == 1 else None
        for p in params.values():
            p.data.zero_()

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))
        if "weights" in tags:
            for n, p in self.model.named_parameters():
                p.data.copy_(self.saved[n]) if self.saved is not None else p.data.fill_(float("nan"))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append(("generate",))
        sample = types.SimpleNamespace(token_ids=[5], logprobs=[{5: types.SimpleNamespace(logprob=-1.0)}])
        return [types.SimpleNamespace(outputs=[sample] * params.n) for _ in requests]


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    FakeLLM.starts, FakeLLM.trainer = [], None
    yield FakeLLM
    FakeLLM.trainer = None


def test_every_engine_start_passes_its_memory_share_the_ranks_device_and_seed(fake_vllm, tmp_path):
    model = tiny()
    cfg = RolloutConfig(engine="vllm", batch_size=16, vllm=VLLMConfig(sleep=1, max_model_len=256))
    world = 4
    for rank in range(world):
        torch.manual_seed(7 + SEED_STRIDE * rank)  # what the trainer seeds each rank with
        vllm_engine.start_llm(tmp_path, cfg, model, torch.device("cuda", rank), rank, world, True,
                              load_format="dummy", total_memory=80 * GIB)
    assert len(fake_vllm.starts) == world
    kv = 16 * 256 * 2 * 2 * 2 * 8 * 2  # max_num_seqs x max_model_len tokens x layers x (k, v) x kv heads x head_dim x 2 B
    terms = engine_bytes(params=sum(p.numel() for p in model.parameters()), layers=2, kv_heads=2, head_dim=8, vocab=96,
                         hidden=32, inter=64, dtype_bytes=2, max_num_seqs=16, max_model_len=256)
    for rank, start in enumerate(fake_vllm.starts):
        assert start["distributed_executor_backend"] == "external_launcher"  # not "uni": that takes cuda:0
        assert start["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        assert start["seed"] == 7 + SEED_STRIDE * rank
        assert start["kv_cache_memory_bytes"] == kv == terms["kv"]
        assert start["gpu_memory_utilization"] == utilization(sum(terms.values()), 80 * GIB) and 0 < start["gpu_memory_utilization"] < 0.1
        assert start["enforce_eager"] is False and start["enable_sleep_mode"] is True
        assert start["tensor_parallel_size"] == 1 and start["max_num_seqs"] == 16 and start["max_model_len"] == 256
        assert start["load_format"] == "dummy"
    assert len({s["seed"] for s in fake_vllm.starts}) == world
    torch.seed()  # an unseeded process: a 64-bit seed, cut to the 32 bits vLLM (numpy) accepts
    vllm_engine.start_llm(tmp_path, cfg, model, torch.device("cuda", 0), 0, world, True, total_memory=80 * GIB)
    assert fake_vllm.starts[-1]["seed"] == torch.initial_seed() % 2**32

    fake_vllm.starts.clear()  # set by hand: passed as given; one process: the in-process executor
    cfg = RolloutConfig(engine="vllm", vllm=VLLMConfig(gpu_memory_utilization=0.35, kv_cache_gb=2.0, seed=11, cuda_graphs=False))
    vllm_engine.start_llm(tmp_path, cfg, model, torch.device("cuda", 0), 0, 1, False, total_memory=80 * GIB)
    start = fake_vllm.starts[0]
    assert start["gpu_memory_utilization"] == 0.35 and start["kv_cache_memory_bytes"] == 2 * GIB and start["seed"] == 11
    assert start["distributed_executor_backend"] == "uni" and start["enforce_eager"] is True

    fake_vllm.starts.clear()  # vLLM's CPU build: no GPU share, eager (its weights are reloaded)
    vllm_engine.start_llm(tmp_path, RolloutConfig(engine="vllm"), model, torch.device("cpu"), 0, 1, False)
    start = fake_vllm.starts[0]
    assert "gpu_memory_utilization" not in start and start["enforce_eager"] is True
    assert start["distributed_executor_backend"] == "uni" and start["kv_cache_memory_bytes"] == 1 * GIB


def step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 10), generator=gen)
    (model(ids).logits.float() * torch.randn(2, 10, 96, generator=gen)).mean().backward()
    opt.step()
    opt.zero_grad()


class Method:
    """The two calls WeightSync makes of a method."""

    def __init__(self, opt):
        self.opt = opt

    def sync_entries(self):  # before the first step: nothing changed yet
        return getattr(self.opt, "last_lowrank", {}), getattr(self.opt, "last_changed", []), self.opt.masters()


class FakeTokenizer:
    """Words -> token ids 3, 4, ...; what the engine asks of a tokenizer."""

    pad_token_id = 0

    def __call__(self, texts, **kw):
        ids = [[3 + i for i, _ in enumerate(t.split())] for t in texts]
        width = max(map(len, ids))
        return types.SimpleNamespace(input_ids=torch.tensor([[0] * (width - len(r)) + r for r in ids]),
                                     attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids]))

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row.tolist())) for row in ids]

    def save_pretrained(self, path):
        pass


def engine_on(model, sleep, monkeypatch):
    """A VLLMEngine as on a GPU (the in-place path, sleep mode), over the stand-in."""
    monkeypatch.setattr(vllm_engine, "_total_memory", lambda device: 80 * GIB)
    monkeypatch.setattr(vllm_engine, "_is_cuda", lambda device: True)
    FakeLLM.trainer = model
    tokenizer = FakeTokenizer()
    return vllm_engine.VLLMEngine(RolloutConfig(engine="vllm", vllm=VLLMConfig(sleep=sleep)), model, tokenizer)


def assert_engine_equals(engine, model):
    state = engine.state_dict(tied=True)
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach()), name
    assert torch.equal(state["lm_head.weight"], model.get_input_embeddings().weight)


@pytest.mark.parametrize("master", ["stochastic", "kahan"])
def test_inplace_payloads_land_in_the_engines_own_parameters(fake_vllm, monkeypatch, master):
    model = tiny()
    engine = engine_on(model, 0, monkeypatch)
    fused = dict(engine.llm.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    pointer = fused.data_ptr()
    opt = LoGRA(model, rank=4, lr=1e-2, embeddings=True, master=master)
    sync = WeightSync(model, engine)
    assert sync(Method(opt), full=True)["sync/resyncs"] == 0
    for s in range(3):
        step(model, opt, s)
        stats = sync(Method(opt))
        assert stats["sync/resyncs"] == 0 and stats["sync/bytes"] < stats["sync/full_bytes"]
        assert_engine_equals(engine, model)
    assert fused.data_ptr() == pointer and not hasattr(engine.weights, "shadow")
    kept = engine.weights.buffers()
    assert (not kept) if master == "stochastic" else all(b.dtype == torch.bfloat16 for b in kept)


def test_sleep_level_1_keeps_the_weights_and_wakes_them_before_a_payload(fake_vllm, monkeypatch):
    model = tiny()
    engine = engine_on(model, 1, monkeypatch)
    opt = LoGRA(model, rank=4, lr=1e-2, master="stochastic")
    sync = WeightSync(model, engine)
    assert engine.asleep == {"weights", "kv_cache"}  # asleep from the start: the first sync wakes it
    sync(Method(opt), full=True)
    for s in range(2):
        with engine.sampling():  # a step's rollouts
            engine.generate(["a b c"], n=2)
            engine.generate(["d e"], n=2)
            assert ("sleep", 1) not in engine.llm.calls[-2:]  # awake through the rollouts
        assert engine.llm.calls[-1] == ("sleep", 1) and engine.resident_tensors() == []
        step(model, opt, s)
        engine.llm.calls.clear()
        stats = sync(Method(opt))
        assert engine.llm.calls[0] == ("wake_up", ("weights",)) and stats["sync/resyncs"] == 0
        assert stats["sync/bytes"] < stats["sync/full_bytes"]  # low-rank: the weights survived the sleep
        assert_engine_equals(engine, model)
        with engine.sampling():
            engine.generate(["a b c"], n=2)
        assert engine.llm.calls[1:5] == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate",), ("sleep", 1)]


def test_sleep_level_2_asks_for_a_full_payload_every_step(fake_vllm, monkeypatch):
    model = tiny()
    engine = engine_on(model, 2, monkeypatch)
    opt = LoGRA(model, rank=4, lr=1e-2, master="stochastic")
    sync = WeightSync(model, engine)
    sync(Method(opt), full=True)
    with engine.sampling():
        engine.generate(["a b c"], n=2)
    assert engine.needs_full
    step(model, opt, 0)
    assert not engine.receive(sync.sender.delta(*Method(opt).sync_entries()))  # a delta on dropped weights
    assert "full payload" in engine.last_error
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate(["a b c"])
    stats = sync(Method(opt))  # WeightSync sees needs_full and sends every tensor
    assert stats["sync/bytes"] == stats["sync/full_bytes"] and stats["sync/resyncs"] == 0 and not engine.needs_full
    assert_engine_equals(engine, model)


def test_sleep_needs_the_cuda_build():
    with pytest.raises(ValueError, match="CUDA build"):
        vllm_engine.VLLMEngine(RolloutConfig(engine="vllm", vllm=VLLMConfig(sleep=1)), tiny(), None)
