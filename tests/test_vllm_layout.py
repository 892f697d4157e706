"""The layout contract of the in-place vLLM engine (experiments/rl/vllm_layout.py): LoGRA payloads applied in
place to tensors laid out as vLLM's parameters — fused qkv_proj and gate_up_proj rows, the vocabulary-
parallel (padded) embedding that a tied head shares, row-parallel o/down column shards — equal vLLM's
layout of the trainer's merged weights, bit for bit, in every master mode, on one rank and on each of two
tensor-parallel ranks; the receiver verifies every step by the digests of those views (no vLLM needed)."""

import threading

import pytest
import torch
import transformers

from experiments.rl.vllm_layout import fuse, layout, views
from logra_core.optimizer import LoGRA
from logra_core.sync import PartReceiver, SyncSender

pytestmark = pytest.mark.unit

MODES = ("fp32", "kahan", "stochastic", "none")


def llama_tied(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def qwen2_untied(dtype):
    """q/k/v biases and an untied head; vocabulary 100 pads to 128."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.data.normal_(0, 0.1)
    return model.to(dtype)


MODELS = {"llama_tied": llama_tied, "qwen2_untied": qwen2_untied}


def step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 10), generator=gen)
    (model(ids).logits.float() * torch.randn(2, 10, vocab, generator=gen)).mean().backward()
    opt.step()
    opt.zero_grad()


class AllReduce:
    """A sum over ``n`` receivers in threads of one process: what a TP group's all-reduce of the digests does."""

    def __init__(self, n):
        self.n, self.parts, self.barrier = n, {}, threading.Barrier(n)

    def __call__(self, rank):
        def reduce(sums):
            self.parts[rank] = sums.clone()
            self.barrier.wait()
            total = sum(self.parts.values())
            self.barrier.wait()
            return total
        return reduce


def engines(model, tp):
    """One engine per TP rank: vLLM's parameters (built from other weights than the trainer's, as a
    dummy-loaded engine starts) and a PartReceiver on their views."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    stale = {n: torch.randn_like(p.float()).to(p.dtype) for n, p in model.named_parameters()}
    reduce = AllReduce(tp)
    out = []
    for rank in range(tp):
        slots = layout(shapes, rank, tp)
        params = fuse(stale, slots, tp)
        receiver = PartReceiver(views(slots, params), {n: s.part for n, s in slots.items()},
                                reduce=reduce(rank) if tp > 1 else None)
        out.append((slots, params, receiver))
    return out


def deliver(payload, ranks):
    """Every rank receives ``payload`` (in threads when the digests are all-reduced); their answers."""
    answers = [None] * len(ranks)

    def run(r):
        answers[r] = ranks[r][2].receive(payload)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def assert_laid_out_as_vllm_loads(model, ranks, tp):
    hf = {n: p.detach() for n, p in model.named_parameters()}
    for rank, (slots, params, _) in enumerate(ranks):
        expected = fuse(hf, slots, tp)
        for target, value in expected.items():
            rows = max(s.row0 + s.part.row_range[1] - s.part.row_range[0] for s in slots.values() if s.target == target)
            assert torch.equal(params[target][:rows], value[:rows]), f"rank {rank}/{tp}: {target}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("master", MODES)
def test_payloads_applied_in_place_equal_the_merged_weights(master, model_name, tp):
    model = MODELS[model_name](torch.bfloat16)
    opt = LoGRA(model, rank=4, lr=1e-2, weight_decay=0.1, embeddings=model_name == "llama_tied", master=master)
    sender = SyncSender(model)
    ranks = engines(model, tp)
    assert all(deliver(sender.full(opt.masters()), ranks)), [r[2].last_error for r in ranks]
    assert_laid_out_as_vllm_loads(model, ranks, tp)
    for s in range(3):
        step(model, opt, s)
        payload = sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())
        assert any("q_proj" in n for n in payload.lowrank) and any("gate_proj" in n for n in payload.lowrank)
        assert all(deliver(payload, ranks)), [r[2].last_error for r in ranks]
        assert_laid_out_as_vllm_loads(model, ranks, tp)
    kept = [b for _, _, r in ranks for b in r.tensors.masters.values()]
    if master in ("stochastic", "none"):  # nothing kept beside vLLM's weights
        assert not kept
    elif master == "kahan":  # the 2-byte compensation, of the shard's size
        assert kept and all(b.dtype == torch.bfloat16 for b in kept)
        held = sum(r.tensors.params[n].numel() for _, _, r in ranks for n in r.tensors.masters)
        assert sum(b.numel() for b in kept) == held


def test_fp32_weights_and_a_corrupted_view_is_caught():
    model = llama_tied(torch.float32)
    opt = LoGRA(model, rank=4, lr=1e-2, embeddings=True)
    sender = SyncSender(model)
    ranks = engines(model, 1)
    assert all(deliver(sender.full(opt.masters()), ranks))
    step(model, opt, 0)
    assert all(deliver(sender.delta(opt.last_lowrank, opt.last_changed, opt.masters()), ranks))
    assert_laid_out_as_vllm_loads(model, ranks, 1)
    _, params, receiver = ranks[0]
    fused = params["model.layers.1.self_attn.qkv_proj.weight"]
    fused.view(torch.int32)[40, 3] ^= 1  # a k_proj row (q has 32 rows): one bit
    step(model, opt, 1)
    assert not receiver.receive(sender.delta(opt.last_lowrank, opt.last_changed, opt.masters()))
    assert "checksum" in receiver.last_error
    assert receiver.receive(sender.full(opt.masters()))
    assert_laid_out_as_vllm_loads(model, ranks, 1)


def test_layout_of_a_llama_layer():
    """Hand-worked rows: q 32 x 32, k/v 16 x 32 (2 kv heads x 8), gate/up 64 x 32, vocabulary 96 -> 128."""
    model = llama_tied(torch.float32)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    one = layout(shapes)
    attn = "model.layers.0.self_attn."
    assert [(one[attn + p + ".weight"].target, one[attn + p + ".weight"].row0) for p in ("q_proj", "k_proj", "v_proj")] \
        == [(attn + "qkv_proj.weight", 0), (attn + "qkv_proj.weight", 32), (attn + "qkv_proj.weight", 48)]
    assert one["model.layers.0.mlp.up_proj.weight"].row0 == 64
    two = layout(shapes, tp_rank=1, tp_size=2)
    assert [two[attn + p + ".weight"].row0 for p in ("q_proj", "k_proj", "v_proj")] == [0, 16, 24]
    assert two[attn + "k_proj.weight"].part.row_range == (8, 16)
    assert two[attn + "o_proj.weight"].part.col_range == (16, 32)
    assert two["model.embed_tokens.weight"].part.row_range == (64, 96)  # rows 96..127 of its shard: padding
    assert "lm_head.weight" not in one  # tied: the head is the embedding's parameter
