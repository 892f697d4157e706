"""Dense AdamW: the status quo the paper compares against (torch.optim.AdamW on every weight)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baselines.base import Method, register_method
from baselines.memory_terms import MemoryTerms, PlanContext, Term, adamw_temporaries


@dataclass
class DenseConfig:
    lr: float = 5e-6  # AdamW learning rate (Loshchilov & Hutter, 2019)
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.999  # second-moment decay
    eps: float = 1e-8  # denominator epsilon
    weight_decay: float = 0.0  # decoupled weight decay
    max_grad_norm: float = 1.0  # clip the global gradient norm before the step; 0 = off


@register_method("dense")
class DenseAdamW(Method):
    """Every parameter trains with torch AdamW; gradients are clipped by global norm."""

    config_cls = DenseConfig
    elementwise_optimizer = True

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.params = self.trainable_parameters(model)
        c = self.cfg
        self.optimizer = torch.optim.AdamW(
            self.params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay
        )
        return self.optimizer

    def step(self) -> dict[str, float]:
        return self.clipped_step(self.params, self.cfg.max_grad_norm)

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """AdamW state on every weight, every weight's gradient, AdamW's temporaries at the step."""
        s = ctx.shapes
        return MemoryTerms(
            state=[Term("optimizer", "AdamW state", s.total * ctx.adam_bytes // ctx.shard_optimizer)],
            grads=[Term("grads", "gradients", s.total * ctx.weight_bytes // ctx.shard_grads, "every weight, weight dtype")],
            step=[adamw_temporaries(ctx, max([s.embed] + [m * n for m, n in s.proj]))])
