"""The KL probe of step control: rows sampled across prompt groups (seeded by the step), and its
token count logged as kl/probe_tokens."""

import pytest
import torch

from experiments.config import build_config
from experiments.rl.trainer import GRPOTrainer, probe_rows
from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.unit


def test_probe_spans_groups_and_is_seeded_by_step():
    G = 8
    rows = torch.arange(64)  # 8 groups of 8, group-major as the trainer keeps them
    rows = rows[rows % 5 != 0]  # some rows dropped (zero advantage)
    picks = [probe_rows(rows, G, 16, seed=0, step=s) for s in range(4)]
    for p in picks:
        assert len(p) == 16 and len(set(p.tolist())) == 16 and set(p.tolist()) <= set(rows.tolist())
        counts = torch.bincount(p // G, minlength=8)
        assert counts.max() - counts.min() <= 1, counts  # spread evenly over the 8 groups, not 2 groups of 8
    assert not torch.equal(picks[0], picks[1])  # a new draw every step
    assert torch.equal(picks[2], probe_rows(rows, G, 16, seed=0, step=2))  # ... a function of (seed, step)
    assert not torch.equal(picks[2], probe_rows(rows, G, 16, seed=1, step=2))
    assert torch.equal(probe_rows(rows, G, 100, seed=0, step=0).sort().values, rows)  # k ≥ rows: all of them


@pytest.mark.integration
def test_controlled_step_logs_probe_tokens(tmp_path):
    t = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path}", "eval.every=0", "method=logra", "logra.rank=4",
                                  "step_control.probe_seqs=3", "step_control.probe_fraction=1"]))
    torch.manual_seed(3)
    rollouts = t.engine.generate(t._prompts(t.train_problems[:2]), n=4)
    rows = torch.arange(8)
    t.method.zero_grad()
    t.accumulate_gradients(rollouts, torch.linspace(-1.5, 1.5, 8), [rows])
    stats = t._controlled_step(rollouts, rows)
    expected = rollouts.completion_mask[probe_rows(rows, 4, 3, t.cfg.seed, t.step)].sum()
    assert stats["kl/probe_tokens"] == float(expected) > 0
    t.close()


@pytest.mark.integration
def test_secant_control_measures_at_the_last_scale_and_lands_on_kappa(tmp_path):
    """predictor=secant: step 1 measures at ε = 1, later steps at the previous step's scale; at ε = s the
    measured KL is the realized one (measure_realized), and the trial scale survives a checkpoint."""
    cfg = [*TINY, f"out_dir={tmp_path}", "eval.every=0", "method=logra", "logra.rank=4", "logra.lr=3e-2",
           "step_control.predictor=secant", "step_control.target_kl=1e-4", "step_control.measure_realized=true",
           "step_control.probe_fraction=1"]  # the probe is the batch: no sampling error in the comparison
    t = GRPOTrainer(build_config(cfg))
    torch.manual_seed(3)
    rollouts = t.engine.generate(t._prompts(t.train_problems[:2]), n=4)
    rows, seen = torch.arange(8), []
    for step in range(3):
        t.method.zero_grad()
        t.accumulate_gradients(rollouts, torch.linspace(-1.5, 1.5, 8), [rows])
        stats = t._controlled_step(rollouts, rows)
        seen.append(stats)
        t.step += 1
    # step 1 first measures at ε = 1; its scale is far below, so it measures again there (a second trial)
    assert seen[0]["step/scale"] < 0.5 and seen[0]["kl/trials"] >= 2 and seen[0]["kl/trial_scale"] < 1
    for before, after in zip(seen, seen[1:]):  # later steps start from the previous step's scale
        assert after["kl/trial_scale"] == before["step/scale"] or after["kl/trials"] > 1
    for s in seen:  # each applied step lands near κ on the realized KL (the probe is the whole batch)
        assert s["kl/realized"] == pytest.approx(1e-4, rel=0.25), s
    # the predicted KL at the applied scale is κ, and the realized KL of that step is close to it
    # (the probe is the batch; the only gap is K(s)/s² changing between the trial scale and s)
    last = seen[-1]
    assert last["kl/predicted_scaled"] == pytest.approx(1e-4, rel=1e-9)
    assert last["kl/realized"] == pytest.approx(1e-4, rel=0.25)
    t.save()
    t.close()
    resumed = GRPOTrainer(build_config([*cfg, "resume=true"]))
    assert resumed.kl_trial_scale == seen[-1]["step/scale"]
    resumed.close()


@pytest.mark.integration
def test_captured_probe_states_equal_a_forward_of_the_probe_batch(tmp_path):
    """The hidden states kept from the update's micro-batches (trimmed to their own padding) are the
    probe batch's at its response positions, in probe order."""
    from experiments.rl.probe_capture import ProbeCapture
    from experiments.rl.trainer import probe_inputs
    from logra_core.kl_predictor import hidden_states

    t = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path}", "eval.every=0", "method=logra", "logra.rank=4",
                                  "step_control.predictor=secant", "step_control.probe_seqs=5",
                                  "step_control.probe_fraction=1"]))
    torch.manual_seed(5)
    rollouts = t.engine.generate(t._prompts(t.train_problems[:2]), n=4)
    rows = torch.arange(8)
    probe = t._probe(rows)
    capture = ProbeCapture(t.model.get_decoder(), probe)
    t.method.zero_grad()
    t.accumulate_gradients(rollouts, torch.linspace(-1.5, 1.5, 8), [rows[:3], rows[3:6], rows[6:]], capture=capture)
    got = capture.hidden()
    capture.close()
    inputs = probe_inputs(rollouts.select(probe), t.device)
    expected = hidden_states(t.model, **inputs)
    assert got is not None and got.shape == expected.shape and len(probe) == 5
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    record = t.train_step()  # the loop's own path: captured states, the secant's trial logged
    assert record["kl/trial_scale"] == 1.0 and record["kl/trials"] >= 1 and record["kl/predicted"] > 0
    t.close()


@pytest.mark.integration
def test_advantage_weighted_probe_reads_the_batch_mean(tmp_path):
    """probe_weighting=advantage: the probe rows weigh |advantage| × tokens; with the whole batch probed
    the prediction equals the token-weighted one (the weights cancel), and a partial probe's prediction
    is the ratio estimator over the probe's rows; a zero-advantage trained row falls back to tokens."""
    from logra_core.kl_predictor import predictor_terms, sampled_mean
    from experiments.rl.trainer import probe_inputs

    base = [*TINY, f"out_dir={tmp_path}", "eval.every=0", "method=logra", "logra.rank=4", "step_control.predictor=exact"]
    t = GRPOTrainer(build_config([*base, "step_control.probe_weighting=advantage", "step_control.probe_fraction=0.5",
                                  "step_control.probe_min=0"]))  # a partial probe: 4 of the 8 rows
    torch.manual_seed(3)
    rollouts = t.engine.generate(t._prompts(t.train_problems[:2]), n=4)
    rows = torch.arange(8)
    adv = torch.tensor([-1.5, -1.0, -0.2, 0.4, 1.3, 0.7, -0.5, 2.0])  # no zero; the probe's |A| ≠ the batch's
    t.method.zero_grad()
    t.accumulate_gradients(rollouts, adv, [rows])
    update, _ = t.method.propose()
    probe = t._probe(rows)
    sizes = t._probe_weights(rollouts, rows, probe, adv)
    n = rollouts.completion_mask.sum(1).double()
    assert torch.equal(sizes[0], adv[probe].abs().double())
    assert sizes[1] == pytest.approx(float((adv.abs().double() * n).sum() / n.sum()))
    inputs = probe_inputs(rollouts.select(probe), t.device)
    terms = predictor_terms("exact")(t.model, inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"],
                                     update.lowrank, update.dense, inputs["positions"], t.cfg.step_control.chunk)
    r = torch.arange(len(probe)).unsqueeze(1).expand_as(inputs["positions"])[inputs["positions"]]
    expected = sampled_mean(terms, r, 8, *sizes)
    got = t.dist.predict_kl(t.model, inputs, update, t.cfg.step_control.chunk, population=8, weights=sizes)
    assert got[0] == pytest.approx(expected[0], rel=1e-9) and got[1] == pytest.approx(expected[1], rel=1e-9)
    unweighted = sampled_mean(terms, r, 8)
    assert got[0] != pytest.approx(unweighted[0], rel=1e-6)  # the weights change a partial probe's reading
    assert t._probe_weights(rollouts, rows, probe, adv * (torch.arange(8) != 3)) is None  # a zero: tokens
    stats = t._controlled_step(rollouts, rows, advantages=adv)
    assert stats["kl/predicted"] > 0 and stats["kl/predicted_stderr"] > 0
    t.close()
    with pytest.raises(Exception, match="probe_weighting"):
        build_config([*base, "step_control.probe_weighting=rows"])
