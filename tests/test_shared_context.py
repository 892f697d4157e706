"""The probe's forward with shared context computed once (logra_core/shared_context.py): the same hidden
states as the plain forward, on batches shaped like a GRPO probe."""

import pytest
import torch
import transformers

from logra_core.kl_predictor import hidden_states, predict_kl_sampled
from logra_core.kl_secant import trial_hidden_states, trial_kl_terms
from logra_core.shared_context import context_plan, shared_context_forward
from tests.test_kl_predictor import make_update, shifted, tiny_llama

pytestmark = pytest.mark.unit

HEADER = [5, 9, 17, 3, 44]  # the tokens every prompt opens with (a chat template's system turn)


def grpo_batch(prompts, per_group, completion, seed=0, vocab=128):
    """Rows ``per_group`` × each prompt (token lists), left-padded, then ``completion`` columns of
    random tokens right-padded to random lengths ≥ 1; positions: those predicting completion tokens."""
    gen = torch.Generator().manual_seed(seed)
    P = max(len(p) for p in prompts)
    rows, masks = [], []
    for p in prompts:
        for _ in range(per_group):
            n = int(torch.randint(1, completion + 1, (1,), generator=gen))
            tokens = torch.randint(0, vocab, (completion,), generator=gen)
            rows.append(torch.cat([torch.zeros(P - len(p), dtype=torch.long), torch.tensor(p), tokens]))
            masks.append(torch.cat([torch.zeros(P - len(p)), torch.ones(len(p)), (torch.arange(completion) < n).float()]))
    ids, mask = torch.stack(rows), torch.stack(masks).long()
    positions = torch.zeros_like(mask, dtype=torch.bool)
    positions[:, P - 1 : -1] = mask[:, P:].bool()
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), positions


SHAPES = {  # name: (prompts, rows per prompt)
    "header, distinct prompts": ([HEADER + [60, 61], HEADER + [70, 71, 72, 73], HEADER + [80]], 1),
    "header, groups": ([HEADER + [60, 61], HEADER + [70, 71, 72, 73]], 3),
    "one prompt": ([HEADER + [60, 61]], 4),
    "groups, no common header": ([[60, 61, 62], [70, 71]], 2),
    "a prompt that is the header": ([HEADER, HEADER + [70, 71, 72]], 2),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_shared_context_equals_the_plain_forward(shape):
    model = tiny_llama()
    ids, mask, pos, positions = grpo_batch(*SHAPES[shape], completion=5)
    plan = context_plan(ids, mask, pos, positions, model.config)
    assert plan is not None and plan.saved_fraction > 0
    got = shared_context_forward(model.model, ids, mask, pos, positions, plan)
    torch.testing.assert_close(got, hidden_states(model, ids, mask, pos, positions), rtol=1e-10, atol=1e-12)


def test_the_plan_shares_the_header_once_and_each_prompt_once():
    ids, mask, pos, positions = grpo_batch(*SHAPES["header, groups"], completion=5)
    plan = context_plan(ids, mask, pos, positions)
    assert plan.prefix.tolist() == HEADER  # the two prompts differ after the header
    assert plan.rest.shape == (2, 3)  # two distinct remainders, the longer 3 tokens (the last prompt token is read)
    assert plan.context_of_row.tolist() == [0, 0, 0, 1, 1, 1]
    # plain: 6 rows x 8 context columns; shared: 5 header tokens + 2 x 3 remainder columns
    assert plan.saved_fraction == pytest.approx(1 - (5 + 6) / 48)


def test_the_plan_declines_what_it_cannot_share():
    ids, mask, pos, positions = grpo_batch(*SHAPES["header, groups"], completion=5)
    assert context_plan(ids, mask, pos + 1, positions) is None  # position ids that are not the mask's count
    assert context_plan(ids, mask, pos, None) is None
    assert context_plan(ids, None, pos, positions) is None
    config = transformers.LlamaConfig()
    config.sliding_window = ids.shape[1] - 1  # the moved padding would shift a sliding window
    assert context_plan(ids, mask, pos, positions, config) is None
    distinct = grpo_batch([[60, 61], [70, 71, 72]], 1, completion=4)  # no common token, no repeated prompt
    assert context_plan(*distinct) is None


@pytest.mark.parametrize("shape", ["header, groups", "header, distinct prompts"])
@pytest.mark.parametrize("kind", ["lowrank_qvd", "mixed", "dense", "untied_head"])
def test_trial_states_through_the_shared_context_equal_the_shifted_model(kind, shape):
    """The trial's hooks and trial parameters act in every cached forward (three with groups; two where
    no rows share more than the header, their remainders run with their columns)."""
    model = tiny_llama(tied=kind != "untied_head")
    ids, mask, pos, positions = grpo_batch(*SHAPES[shape], completion=5, seed=1)
    lowrank, dense = make_update(model, kind)
    got = trial_hidden_states(model, ids, mask, pos, lowrank, dense, 0.7, positions)
    plain = trial_hidden_states(model, ids, mask, pos, lowrank, dense, 0.7, positions, share_context=False)
    with shifted(model, lowrank, dense, 0.7):
        expected = hidden_states(model, ids, mask, pos, positions)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(plain, expected, rtol=1e-10, atol=1e-12)


def test_the_secant_prediction_is_the_same_with_and_without_sharing():
    model = tiny_llama()
    ids, mask, pos, positions = grpo_batch(*SHAPES["header, groups"], completion=5, seed=2)
    lowrank, dense = make_update(model, "mixed")
    shared = trial_kl_terms(model, ids, mask, pos, lowrank, dense, positions, at=0.3)
    plain = trial_kl_terms(model, ids, mask, pos, lowrank, dense, positions, at=0.3, share_context=False)
    assert shared.abs().min() > 0
    torch.testing.assert_close(shared, plain, rtol=1e-9, atol=0)
    kw = dict(lowrank=lowrank, dense=dense, positions=positions, population=12, predictor="secant", at=0.3)
    assert predict_kl_sampled(model, ids, mask, pos, **kw) == pytest.approx(
        predict_kl_sampled(model, ids, mask, pos, **kw, share_context=False), rel=1e-9)


def test_shared_context_on_a_softcapped_sliding_window_model():
    """Gemma-2 (alternating sliding-window layers, logit softcap, its own cache layers) in fp32."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=64)
    model = transformers.Gemma2ForCausalLM(config).eval()
    ids, mask, pos, positions = grpo_batch(*SHAPES["header, groups"], completion=5, seed=3)
    plan = context_plan(ids, mask, pos, positions, model.config)
    assert plan is not None
    with torch.no_grad():
        got = shared_context_forward(model.model, ids, mask, pos, positions, plan)
    torch.testing.assert_close(got, hidden_states(model, ids, mask, pos, positions), rtol=1e-5, atol=1e-5)
