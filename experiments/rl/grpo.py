"""GRPO's math: group-relative advantages, per-token log-probs, the clipped surrogate loss.

GRPO (Shao et al., 2024, "DeepSeekMath", §4.1) samples G completions per prompt and uses the
reward normalized within the group as every token's advantage, replacing PPO's value network.
The loss is PPO's clipped surrogate (Schulman et al., 2017) with separate lower/upper clip
ranges ("clip-higher", Yu et al., 2025, DAPO) averaged over all response tokens of the batch
("token-mean"), optionally plus a KL penalty to a frozen reference (the k3 estimator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from experiments.rl.distributed import through_root
from logra_core.chunked_head import chunked_token_logprobs


@dataclass
class GRPOConfig:
    steps: int = 20  # policy updates (outer GRPO iterations)
    prompts_per_step: int = 8  # distinct prompts sampled per step
    group_size: int = 8  # completions per prompt, G (Shao et al., 2024)
    micro_batch_size: int = 16  # sequences per forward/backward; gradients accumulate over a step
    ppo_epochs: int = 1  # passes over each rollout batch, one update per pass
    clip_low: float = 0.2  # ratio lower clip: 1 - clip_low (Schulman et al., 2017)
    clip_high: float = 0.28  # ratio upper clip: 1 + clip_high ("clip-higher", Yu et al., 2025)
    std_normalize: bool = True  # divide advantages by the group's reward std (Dr. GRPO argues off)
    kl_coef: float = 0.0  # weight of the k3 KL penalty to the initial policy; > 0 keeps a model copy
    skip_zero_advantage: bool = True  # drop sequences whose advantage is 0 (groups with equal rewards)
    logprob_chunk: int = 256  # tokens per LM-head chunk when computing log-probs (no tokens × vocab tensor); 0 = full logits

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "group_size", "micro_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= train.clip_low < 1 and train.clip_high >= 0, got {self.clip_low}, {self.clip_high}")


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-4):
    """Advantage of each completion relative to its group.

    rewards: [N·G] in group-major order (the G completions of a prompt are contiguous).
    A_i = (r_i − mean_g r) / (std_g r + eps) with the unbiased std, or A_i = r_i − mean_g r.
    Returns [N·G].
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + eps)
    return adv.view(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under softmax(logits). logits: [B, T, V]; tokens: [B, T] -> [B, T] (fp32)."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    num_tokens: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
):
    """Token-mean clipped surrogate over a micro-batch, normalized by the whole batch's tokens.

    With ρ_t = exp(logπ_t − logπ_old,t) and A the sequence's advantage,
      ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − clip_low, 1 + clip_high) A) + β·k3_t,
      k3_t = exp(logπ_ref,t − logπ_t) − (logπ_ref,t − logπ_t) − 1   (Schulman's k3 estimator),
      loss = Σ_t mask_t ℓ_t / num_tokens.
    Dividing by the token count of the whole rollout batch (not the micro-batch) makes
    accumulated micro-batch gradients equal the whole-batch gradient exactly.

    logprobs, old_logprobs, mask: [B, T]; advantages: [B]. Returns (loss, stats) where stats are
    sums over the micro-batch's tokens: clipped tokens, the k3 KL.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    stats = {"clipped_tokens": float(((clipped < unclipped).to(mask.dtype) * mask).sum())}
    if ref_logprobs is not None and kl_coef > 0:
        d = ref_logprobs - logprobs
        k3 = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * k3
        stats["kl_sum"] = float((k3.detach() * mask).sum())
    loss = (per_token * mask).sum() / num_tokens
    return loss, stats


def logit_softcap(model) -> float | None:
    """The model's final-logit softcap c (logits c·tanh(z/c); Gemma-2), or None."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None


def completion_logprobs(model, input_ids, attention_mask, completion_len: int, chunk: int = 0,
                        temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs log softmax(z / T)[y] of the last ``completion_len`` tokens of each row.

    T is the rollout's sampling temperature, so the trained distribution is the one that sampled
    (as in TRL and verl); for the chunked head z / T = (h / T) Wᵀ, so h is scaled instead.

    input_ids, attention_mask: [B, P + C] — prompts left-padded, completions right-padded, so
    the completions occupy the last C = completion_len columns. Only the C positions that predict
    them go through the LM head. With ``chunk > 0`` (and a plain linear head) the head runs
    ``chunk`` tokens at a time inside one autograd function (:mod:`logra_core.chunked_head`), so
    no [B, C, V] logits tensor exists, with the model's final-logit softcapping (Gemma-2) applied
    per chunk; otherwise the model's own ``logits_to_keep`` path is used.
    Position ids follow the attention mask, as in generation. Returns [B, C] fp32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature != 1.0 and chunk > 0 and logit_softcap(model):
        raise ValueError("the chunked LM head scales h by 1/T, which is not softmax(c·tanh(z/c) / T) under Gemma-2's "
                         "final-logit softcapping: sample at temperature 1 or set train.logprob_chunk=0")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[:, -completion_len:]
    head = model.get_output_embeddings()
    plain_head = isinstance(head, torch.nn.Linear) and head.bias is None
    if chunk > 0 and plain_head:
        def chunked(input_ids, attention_mask, position_ids):
            hidden = model.base_model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state[:, -completion_len - 1 : -1]
            if temperature != 1.0:
                hidden = hidden / temperature
            # the sketch is the head module's: FSDP2 swaps in an unsharded weight that does not carry it.
            # A fresh tensor, not a view: FSDP hooks the root's output for its backward.
            return chunked_token_logprobs(hidden, head.weight, targets, chunk, logit_softcap(model),
                                          state=getattr(head, "sketch_state", None)).clone()

        # as the root's forward: a sharded model (FSDP2) gathers the head there and reduces its gradient after
        return through_root(model, chunked, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=completion_len + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]
    return token_logprobs(logits if temperature == 1.0 else logits.float() / temperature, targets)
