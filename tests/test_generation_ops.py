"""Nothing of LoGRA runs during generation: a sketched model under no_grad executes exactly the ops of
the unprepared model (operator counts from torch.profiler, not times)."""

import copy
from collections import Counter

import pytest
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from logra_core.sketch import install

pytestmark = pytest.mark.unit


def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      eos_token_id=1, bos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def op_counts(fn) -> tuple[Counter, object]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}), out


def test_sketched_model_generates_with_the_plain_ops():
    plain = tiny()
    sketched = copy.deepcopy(plain)
    install(sketched, rank=4, embeddings=True)  # every projection, the embedding and the tied head
    ids = torch.randint(2, 96, (3, 5), generator=torch.Generator().manual_seed(1))
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    for model in (plain, sketched):  # warm-up: first-call setup ops out of the comparison
        model.generate(**gen)
    ops_plain, out_plain = op_counts(lambda: plain.generate(**gen))
    ops_sketched, out_sketched = op_counts(lambda: sketched.generate(**gen))
    assert torch.equal(out_plain, out_sketched)
    assert ops_sketched == ops_plain, {k: (ops_plain[k], ops_sketched[k]) for k in ops_plain | ops_sketched
                                       if ops_plain[k] != ops_sketched[k]}
    # the comparison sees the sketch where it runs: a forward with grad does the extra x Aᵀ products
    with torch.enable_grad():
        grad_plain, _ = op_counts(lambda: plain(ids).logits.sum())
        grad_sketched, _ = op_counts(lambda: sketched(ids).logits.sum())
    assert grad_sketched != grad_plain
