"""Dense AdamW: the status quo the paper compares against (torch.optim.AdamW on every weight).

On a bf16/fp16 model ``precision="mixed"`` (default) steps fp32 masters with fp32 moments, what
verl/OpenRLHF under FSDP or DeepSpeed bf16 run; ``"bf16"`` is AdamW on the bf16 weights themselves
(:mod:`baselines.precision`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baselines.base import Method, register_method
from baselines.precision import MasterWeights, check_precision
from baselines.memory_terms import MemoryTerms, PlanContext, Term, adamw_temporaries, master_gradients


@dataclass
class DenseConfig:
    lr: float = 5e-6  # AdamW learning rate (Loshchilov & Hutter, 2019)
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.999  # second-moment decay
    eps: float = 1e-8  # denominator epsilon
    weight_decay: float = 0.0  # decoupled weight decay
    max_grad_norm: float = 1.0  # clip the global gradient norm before the step; 0 = off
    precision: str = "mixed"  # bf16/fp16 model: mixed (fp32 master weights + fp32 moments, as FSDP MixedPrecision / DeepSpeed bf16) | bf16 (AdamW on the bf16 weights); fp32 models ignore it

    def __post_init__(self):
        check_precision("dense", self.precision)


@register_method("dense")
class DenseAdamW(Method):
    """Every parameter trains with torch AdamW; gradients are clipped by global norm."""

    config_cls = DenseConfig
    elementwise_optimizer = True

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.params = self.trainable_parameters(model)
        c = self.cfg
        self.master_weights = MasterWeights.build(c.precision, model, self.params)
        stepped = self.master_weights.substitute(self.params) if self.master_weights else self.params
        self.optimizer = torch.optim.AdamW(stepped, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                           weight_decay=c.weight_decay)
        return self.optimizer

    def step(self) -> dict[str, float]:
        return self.clipped_step(self.params, self.cfg.max_grad_norm)

    plan_option_names = frozenset({"precision"})  # the planner's precision=mixed|bf16 (from dense.precision)

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """AdamW state on every weight (``precision=mixed`` on bf16: fp32 master + two fp32 moments,
        12 B per element; ``bf16``: two bf16 moments, 4 B), every weight's gradient in the weight dtype
        during backward; at the step AdamW's temporaries and, when mixed, the masters' fp32 gradients
        in place of the bf16 ones."""
        s, prec = ctx.shapes, ctx.options.get("precision")
        mixed = ctx.mixed(prec)
        return MemoryTerms(
            state=[Term("optimizer", "AdamW state", s.total * ctx.adam_bytes(prec) // ctx.shard_optimizer,
                        "fp32 master + two fp32 moments" if mixed else "two moments in the weight dtype")],
            grads=[Term("grads", "gradients", s.total * ctx.weight_bytes // ctx.shard_grads, "every weight, weight dtype")],
            step=([master_gradients(ctx, s.total)] if mixed else [])
            + [adamw_temporaries(ctx, max([s.embed] + [m * n for m, n in s.proj]), prec, stepped=s.total)],
            grads_at_step=not mixed)
