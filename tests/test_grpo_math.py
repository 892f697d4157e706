"""Tier 1: GRPO's advantages and clipped loss against hand-worked values."""

import math

import pytest
import torch

from experiments.rl.grpo import clipped_policy_loss, group_advantages, token_logprobs

pytestmark = pytest.mark.unit


def test_group_advantages_hand_worked():
    # group 1: rewards [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    #   A = ±0.5 / (0.57735 + 1e-4) = ±0.86588
    # group 2: all equal -> A = 0 (no signal)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, group_size=4, std_normalize=True)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(a, torch.tensor([expected, -expected, -expected, expected, 0, 0, 0, 0]))
    # without std normalization: plain centering
    a = group_advantages(r, group_size=4, std_normalize=False)
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(8), group_size=3)


def test_clipped_loss_hand_worked():
    # Two sequences, two tokens each; second token of row 1 is padding.
    # row 0: A = +1, ratios e^{0.5}=1.6487 (clipped to 1.28) and e^{-0.1}=0.9048 (inside)
    #   terms: -min(1.6487, 1.28) = -1.28 ; -min(0.9048, 0.9048) = -0.9048
    # row 1: A = -2, ratio e^{-0.5}=0.6065 -> clip to 0.8: -min(-1.2131, -1.6) = 1.6 (clipped)
    # loss = (-1.28 - 0.9048 + 1.6) / 3 tokens = -0.19494
    logp = torch.tensor([[0.5, -0.1], [-0.5, 0.3]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, num_tokens=3)
    assert loss.item() == pytest.approx((-1.28 - math.exp(-0.1) + 1.6) / 3, rel=1e-6)
    assert stats["clipped_tokens"] == 2


def test_clipped_loss_gradient_on_policy():
    # ratio = 1 on-policy: d loss / d logp_t = -A_t / num_tokens for unmasked tokens.
    logp = torch.tensor([[0.3, -0.2, 0.1]], requires_grad=True)
    loss, _ = clipped_policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.tensor([[1, 1, 0]]), 0.2, 0.2, num_tokens=4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5, 0.0]]))


def test_kl_penalty_k3():
    # k3 with d = ref - logp = -0.2: e^{-0.2} + 0.2 - 1 = 0.018731; coef 0.5, one token, A = 0
    logp = torch.tensor([[0.2]])
    loss, stats = clipped_policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 0.2, 1, torch.zeros(1, 1), 0.5)
    assert loss.item() == pytest.approx(0.5 * (math.exp(-0.2) + 0.2 - 1), rel=1e-6)
    assert stats["kl_sum"] == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_token_logprobs_matches_log_softmax(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens), ref)
