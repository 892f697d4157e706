"""Mixed precision for the baselines' optimizers: fp32 master weights beside a bf16/fp16 model.

``precision`` of dense AdamW, GaLore and LoRA (docs/precision.md):

* ``mixed`` — the default, what FSDP ``MixedPrecision`` and DeepSpeed's bf16 mode do: every
  low-precision trainable tensor p has an fp32 master m; the optimizer (and its moments) lives on
  the masters. A step is  m.grad ← fp32(p.grad),  optimizer step on m,  p ← round(m).
  16 B per trained element (m 4, two fp32 moments 8, p 2, ...) plus gradients.
* ``bf16`` — the optimizer on the low-precision tensors themselves (pure-bf16 AdamW: moments in
  bf16, updates below half the bf16 spacing of a weight are lost). An extra baseline.

An fp32 model has nothing to keep: both modes are plain fp32.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from baselines.memory_terms import PRECISIONS  # the one list, where the planner reads it without torch


def check_precision(name: str, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"{name}.precision must be one of {PRECISIONS}, got {precision!r}")


class MasterWeights:
    """fp32 masters of a model's low-precision trainable tensors; fp32 tensors stand for themselves."""

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter]):
        names = {id(p): n for n, p in model.named_parameters()}
        self.pairs: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        self.master_of: dict[int, torch.Tensor] = {}
        for p in params:
            if p.dtype in (torch.float32, torch.float64):
                continue
            m = p.detach().float().clone().requires_grad_(True)
            self.pairs.append((names[id(p)], p, m))
            self.master_of[id(p)] = m

    @classmethod
    def build(cls, precision: str, model: nn.Module, params: Iterable[nn.Parameter]) -> Optional["MasterWeights"]:
        """Masters for ``precision="mixed"`` when some trainable tensor is low precision; else None."""
        masters = cls(model, params) if precision == "mixed" else None
        return masters if masters is not None and masters.pairs else None

    def substitute(self, params: list) -> list:
        """``params`` (tensors, or param-group dicts) with every low-precision tensor replaced by its master."""
        if params and isinstance(params[0], dict):
            return [{**g, "params": self.substitute(list(g["params"]))} for g in params]
        return [self.master_of.get(id(p), p) for p in params]

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """p's master, or p itself."""
        return self.master_of.get(id(p), p)

    @torch.no_grad()
    def grads_to_masters(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """m.grad ← fp32(p.grad); p.grad is dropped (for ``params``, default all)."""
        for p, m in self._select(params):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def masters_to_params(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """p ← round(m) (round to nearest); the masters' gradients are dropped."""
        for p, m in self._select(params):
            p.copy_(m)
            m.grad = None

    def _select(self, params):
        if params is None:
            return [(p, m) for _, p, m in self.pairs]
        return [(p, self.master_of[id(p)]) for p in params if id(p) in self.master_of]

    def by_name(self) -> dict[str, torch.Tensor]:
        return {n: m for n, _, m in self.pairs}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in self.by_name().items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = self.by_name()
        if set(state) != set(mine):
            raise RuntimeError(f"master weights: the checkpoint holds {sorted(state)[:3]}…, the model {sorted(mine)[:3]}…")
        for n, m in mine.items():
            m.copy_(state[n])
