"""The secant KL (docs/design.md §3.2): the KL measured at a trial scale ε without forming θ + εΔ."""

import pytest
import torch

from logra_core.kl_predictor import exact_kl, hidden_states, predict_kl, predict_kl_sampled, predictor_terms
from logra_core.kl_secant import trial_hidden_states, trial_kl_terms
from tests.test_kl_predictor import batch, make_update, shifted, tiny_llama

pytestmark = pytest.mark.unit

KINDS = ["lowrank_qvd", "lowrank_all", "dense", "mixed", "untied_head"]


@pytest.mark.parametrize("kind", KINDS)
def test_trial_hidden_states_equal_the_shifted_models(kind):
    """Hooks and functional_call reproduce a model whose parameters were moved by εΔ in place."""
    model = tiny_llama(tied=kind != "untied_head")
    ids, mask, positions = batch()
    lowrank, dense = make_update(model, kind)
    got = trial_hidden_states(model, ids, mask, None, lowrank, dense, 0.7, positions)
    with shifted(model, lowrank, dense, 0.7):
        expected = hidden_states(model, ids, mask, None, positions)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hidden_states(model, ids, mask, None, positions),
                               trial_hidden_states(model, ids, mask, None, lowrank, dense, 0.0, positions))


@pytest.mark.parametrize("kind", KINDS)
def test_trial_kl_equals_the_realized_kl_of_the_applied_step(kind):
    """At ε = s the secant terms times s² are the exact KL of θ → θ + sΔ, head moves included."""
    model = tiny_llama(tied=kind != "untied_head")
    ids, mask, positions = batch()
    lowrank, dense = make_update(model, kind, scale=0.3)
    s = 0.4
    terms = trial_kl_terms(model, ids, mask, None, lowrank, dense, positions, chunk=3, at=s)
    W = model.get_output_embeddings().weight
    h_old, W_old = hidden_states(model, ids, mask, None, positions), W.detach().clone()
    with shifted(model, lowrank, dense, s):
        realized = exact_kl(h_old, W_old, hidden_states(model, ids, mask, None, positions), W.detach())
    assert realized.mean() > 1e-4  # a step that moves the policy
    torch.testing.assert_close(terms * s**2, realized, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("kind", ["lowrank_all", "mixed"])
def test_secant_tends_to_the_second_order_prediction_as_the_trial_scale_shrinks(kind):
    model = tiny_llama()
    ids, mask, positions = batch()
    lowrank, dense = make_update(model, kind, scale=0.3)
    exact = predict_kl(model, ids, mask, None, lowrank, dense, positions)
    errors = [abs(trial_kl_terms(model, ids, mask, None, lowrank, dense, positions, at=e).mean().item() / exact - 1)
              for e in (0.05, 5e-3, 5e-4)]
    assert errors[2] < 2e-3 and errors[2] < errors[1] < errors[0], errors  # O(ε): ~10x smaller per decade


def test_secant_at_temperature_divides_the_logits():
    model = tiny_llama()
    ids, mask, positions = batch()
    lowrank, dense = make_update(model, "mixed", scale=0.3)
    T, s = 0.7, 0.3
    got = trial_kl_terms(model, ids, mask, None, lowrank, dense, positions, temperature=T, at=s) * s**2
    W = model.get_output_embeddings().weight
    h_old, W_old = hidden_states(model, ids, mask, None, positions) / T, W.detach().clone()
    with shifted(model, lowrank, dense, s):
        expected = exact_kl(h_old, W_old, hidden_states(model, ids, mask, None, positions) / T, W.detach())
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-14)
    with pytest.raises(ValueError, match="trial scale"):
        trial_kl_terms(model, ids, mask, None, lowrank, dense, positions, at=0.0)


def test_sampled_prediction_dispatches_by_predictor_name():
    model = tiny_llama()
    ids, mask, positions = batch()
    lowrank, dense = make_update(model, "lowrank_all", scale=0.3)
    exact, _ = predict_kl_sampled(model, ids, mask, None, lowrank, dense, positions)
    secant, _ = predict_kl_sampled(model, ids, mask, None, lowrank, dense, positions, predictor="secant", at=1e-3)
    assert exact == pytest.approx(predict_kl(model, ids, mask, None, lowrank, dense, positions), rel=1e-12)
    assert secant == pytest.approx(exact, rel=1e-2) and secant != exact
    with pytest.raises(ValueError, match="unknown KL predictor 'jvp'"):
        predictor_terms("jvp")


def test_shifted_kl_keeps_a_small_dense_head_step_of_a_bf16_head():
    """A dense ΔW far below bf16's spacing of W still moves the head: with W in bf16 it enters as its own
    product (W + at·ΔW in bf16 would round it away), with W in fp32 it is merged into W; both agree."""
    from logra_core.kl_secant import shifted_kl

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(64, 16, generator=gen)
    dW = 1e-4 * torch.randn(64, 16, generator=gen)  # ~1e-4 of W: below bf16's relative spacing of 2^-8
    h = torch.randn(10, 16, generator=gen)
    wide = shifted_kl(h, h, W, [dW], at=0.5, chunk=4)
    narrow = shifted_kl(h, h, W.bfloat16(), [dW], at=0.5, chunk=4)
    separate = shifted_kl(h.double(), h.double(), W.double(), [(dW.double(), torch.eye(16, dtype=torch.float64))],
                          at=0.5, chunk=4)  # the same ΔW as low-rank factors: never merged
    assert wide.mean() > 1e-12
    # fp32's rounding of W + at·ΔW: |z|·2^-24 on a δ of 1e-4·|z|, ~1e-2 of this tiny KL (1e-8 per token; a
    # trial's forward in fp32 carries more than that in h)
    torch.testing.assert_close(wide.double(), separate, rtol=2e-2, atol=0)
    torch.testing.assert_close(narrow.double(), separate, rtol=0.1, atol=0)
