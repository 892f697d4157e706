"""A probe's forward with each shared context computed once (docs/speed.md, "The probe's forward").

The KL probe reads the hidden states at the positions that predict response tokens. Everything before
the first such column is context: it feeds those positions through attention only. In a GRPO batch
the contexts repeat — every prompt opens with the same chat-template header (27 of SmolLM2's 50 arith
prompt tokens), and the rows of one prompt group share the whole prompt — yet a plain forward
recomputes them for every row. :func:`shared_context_forward` runs the same decoder in three
pieces with a KV cache:

1. the context prefix common to every row (batch 1);
2. each distinct remainder of the context once (batch = distinct contexts), after that prefix;
3. every row's columns from the first predicting one on, after its own context's cache.

Where every row has its own context (a probe drawn one row per prompt group), 2 and 3 are one call:
the remainders run with their rows' columns, after the prefix — a third call of a batch that saves
nothing would cost more than it saves (SmolLM2, 4 rows: 1.08× the plain forward as three calls,
0.93–0.98× as two; 16 rows in 8 groups of 2: 0.72–0.77× as three; docs/speed.md).

Attention is a masked sum over keys placed by their position ids, so moving a row's left padding from
the front of the row to between the shared prefix and its remainder changes no attention score:
the states equal the plain forward's up to floating-point reordering (fp32: ~1e-6 relative;
tests/test_shared_context.py). Both sides of a measured KL must come from the same path, since in
bf16 that reordering is as large as a small step's logit change.

:func:`context_plan` says when the split applies (None otherwise: the caller runs the plain forward):
position ids must be the mask's running count (left-padded rows, ``cumsum(mask) - 1``), every
position that is read must lie at or after the split column, and the sequence must fit any sliding
attention window (the window is counted in cache slots, which the moved padding shifts).
"""

from __future__ import annotations

from dataclasses import dataclass
import inspect
from typing import Optional

import torch
from torch import nn


@dataclass
class ContextPlan:
    split: int  # the first column holding a position that is read; columns before it are context
    prefix: torch.Tensor  # [L] the context tokens every row starts with
    rest: torch.Tensor  # [U, M] each distinct context after the prefix, left-padded
    rest_mask: torch.Tensor  # [U, L + M]: the prefix, then the remainder's padding (0) and tokens (1)
    rest_positions: torch.Tensor  # [U, M]
    context_of_row: torch.Tensor  # [B] index into the U distinct contexts

    @property
    def calls(self) -> int:
        """How many decoder calls :func:`shared_context_forward` makes for this plan."""
        B, (U, M), L = self.context_of_row.numel(), self.rest.shape, self.prefix.numel()
        return (1 if L else 0) + (1 if M and U == B else (1 if M else 0) + 1)

    @property
    def saved_fraction(self) -> float:
        """Share of the plain forward's token positions the split does not compute."""
        B = self.context_of_row.numel()
        U, M = self.rest.shape
        L = self.prefix.numel()
        plain = B * self.split
        return (plain - L - U * M) / plain if plain else 0.0


def _window(config) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def context_plan(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                 positions: Optional[torch.Tensor], config=None) -> Optional[ContextPlan]:
    """How to split a probe batch into shared context and per-row columns; None where it does not apply
    (no mask or positions, position ids that are not the mask's running count, nothing to share, a
    sequence longer than the model's sliding window)."""
    if attention_mask is None or positions is None or positions.dim() != 2 or not bool(positions.any()):
        return None
    mask = attention_mask.bool()
    running = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if position_ids is not None and not torch.equal(position_ids[mask], running[mask]):
        return None
    window = _window(config)
    if window is not None and input_ids.shape[1] > window:
        return None
    split = int(positions.any(0).nonzero()[0])
    if split < 2:
        return None
    contexts: dict[tuple, int] = {}
    context_of_row = []
    for row, row_mask in zip(input_ids[:, :split], mask[:, :split]):
        tokens = tuple(row[row_mask].tolist())
        context_of_row.append(contexts.setdefault(tokens, len(contexts)))
    distinct = list(contexts)
    L = 0
    shortest = min(len(c) for c in distinct)
    while L < shortest and all(c[L] == distinct[0][L] for c in distinct):
        L += 1
    if L == 0 and len(distinct) == input_ids.shape[0]:
        return None  # nothing is shared
    M = max(len(c) for c in distinct) - L
    U = len(distinct)
    rest = torch.zeros(U, M, dtype=input_ids.dtype)
    rest_mask = torch.zeros(U, L + M, dtype=attention_mask.dtype)
    rest_mask[:, :L] = 1
    rest_positions = torch.zeros(U, M, dtype=torch.long)
    for u, c in enumerate(distinct):
        m = len(c) - L
        if m:
            rest[u, M - m :] = torch.tensor(c[L:], dtype=input_ids.dtype)
            rest_mask[u, L + M - m :] = 1
            rest_positions[u, M - m :] = torch.arange(L, L + m)
    device = input_ids.device
    return ContextPlan(split, torch.tensor(distinct[0][:L], dtype=input_ids.dtype, device=device), rest.to(device),
                       rest_mask.to(device), rest_positions.to(device),
                       torch.tensor(context_of_row, dtype=torch.long, device=device))


def _cache_keyword(decoder) -> str:
    """The decoder's name for a KV cache argument (``cache`` since transformers 5.2x, ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def shared_context_forward(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: Optional[torch.Tensor], positions: torch.Tensor, plan: ContextPlan,
                           params: Optional[dict] = None) -> torch.Tensor:
    """Last hidden states at ``positions`` (T × d, row-major: what ``decoder(...)[positions]`` gives) by the
    three cached forwards of ``plan``; ``params``: parameters to call the decoder with
    (``torch.func.functional_call``), e.g. trial weights. No grad is taken by the caller's choice."""
    def call(**kwargs):
        if params:
            return torch.func.functional_call(decoder, params, args=(), kwargs=kwargs)
        return decoder(**kwargs)

    def cache_of(out):
        return out.cache if getattr(out, "cache", None) is not None else out.past_key_values

    key = _cache_keyword(decoder)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    L, (U, M), device = plan.prefix.numel(), plan.rest.shape, input_ids.device
    cache = None
    if L:
        cache = cache_of(call(input_ids=plan.prefix[None], position_ids=torch.arange(L, device=device)[None],
                              attention_mask=torch.ones(1, L, dtype=attention_mask.dtype, device=device), use_cache=True))
        if U > 1:
            cache.batch_repeat_interleave(U)
    s = plan.split
    ids, mask, pos, read = input_ids[:, s:], attention_mask[:, s:], position_ids[:, s:], positions[:, s:]
    if M and U == input_ids.shape[0]:  # no two rows share more than the prefix: their remainders run with their columns
        order = plan.context_of_row
        ids, pos = torch.cat([plan.rest[order], ids], 1), torch.cat([plan.rest_positions[order], pos], 1)
        mask = torch.cat([plan.rest_mask[order], mask], 1)
        read = torch.cat([torch.zeros(ids.shape[0], M, dtype=torch.bool, device=device), read], 1)
    else:
        if M:
            cache = cache_of(call(input_ids=plan.rest, attention_mask=plan.rest_mask, position_ids=plan.rest_positions,
                                  use_cache=True, **{key: cache}))
        cache.batch_select_indices(plan.context_of_row)
        mask = torch.cat([plan.rest_mask[plan.context_of_row], mask], dim=1)
    out = call(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{key: cache}).last_hidden_state
    return out[read]
