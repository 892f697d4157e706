"""LoRA baseline: ``peft`` adapters (Hu et al., 2022) on the attention and MLP projections.

Only the adapter matrices train (AdamW); every base weight stays frozen and bit-identical. On a
bf16/fp16 base ``precision="mixed"`` (default) keeps the adapters and their moments in fp32,
``"bf16"`` in the base's dtype. The
model the trainer sees is the HF model with peft's LoRA layers injected (peft's wrapper is kept on
the method as ``peft_model``), so generation, the chunked LM head and checkpoints work unchanged;
checkpoint keys are peft's (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``).

Helpers for weight sync to a rollout engine: :func:`merged_state_dict` gives the base model's
state dict with every adapter folded in (W + s·B A, computed out of place: the training model is
not touched); :func:`merge_adapters` / :func:`unmerge_adapters` fold them in place and back
(peft's merge; unmerging subtracts the delta again, so W comes back up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from baselines.base import Method, register_method
from baselines.precision import check_precision
from baselines.memory_terms import MemoryTerms, PlanContext, Term, adamw_temporaries

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    lr: float = 1e-4  # AdamW learning rate of the adapters (LoRA wants ~10x full fine-tuning's)
    r: int = 16  # adapter rank
    alpha: float = 32.0  # scaling numerator: the adapter's delta is (alpha / r)·B A
    dropout: float = 0.0  # adapter dropout; > 0 makes the trained policy differ from the sampling one
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))  # peft target_modules (module-name suffixes)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # decoupled weight decay of the adapters
    max_grad_norm: float = 1.0  # clip the adapters' global gradient norm; 0 = off
    precision: str = "mixed"  # bf16/fp16 base: mixed (fp32 adapters and moments on the frozen bf16 base) | bf16 (adapters in the base's dtype); fp32 models ignore it

    def __post_init__(self):
        check_precision("lora", self.precision)
        if self.r < 1:
            raise ValueError(f"lora.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")


def lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def merge_adapters(model: nn.Module) -> None:
    """Fold every active adapter into its base weight, in place (forward then skips the adapters)."""
    for m in lora_layers(model):
        m.merge()


def unmerge_adapters(model: nn.Module) -> None:
    """Undo :func:`merge_adapters` (W − s·B A: equal to the old W up to rounding)."""
    for m in lora_layers(model):
        m.unmerge()


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict (the original key names) with every adapter folded in.

    Computed out of place, so the training model and its adapters stay as they are: what a
    rollout engine without LoRA support needs to receive.
    """
    out = {}
    deltas = {}
    layers = set(lora_layers(model))
    for name, m in model.named_modules():
        if m in layers:
            parts = [m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A]
            if parts and not m.merged:
                deltas[name + ".weight"] = torch.stack(parts).sum(0)
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = value + deltas[plain].to(value.dtype) if plain in deltas else value
    return out


@register_method("lora")
class LoRA(Method):
    """peft LoRA adapters train by AdamW; the base model is frozen."""

    adds_parameters = True  # peft draws the adapters whole when it wraps the model
    config_cls = LoRAConfig
    rank_key = "r"

    plan_option_names = frozenset({"precision"})  # the planner's precision=mixed|bf16 (from lora.precision)

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """Adapters A (r x n) and B (m x r) on every projection with AdamW state and gradients, fp32
        under ``precision=mixed`` (or an fp32 model), else in the weight dtype; base weights, embedding
        and norms frozen, so only the adapters' inputs are saved for gradients and nothing gets a dense
        V x h gradient."""
        s, r, prec = ctx.shapes, ctx.rank, ctx.options.get("precision")
        a = 4 if ctx.mixed(prec) else ctx.weight_bytes  # adapter, gradient and moment bytes
        adapters = sum(r * (m + n) for m, n in s.proj)
        cast = ctx.mixed(prec)  # fp32 adapters on a bf16 base: peft runs lora_A(x.to(fp32)), one copy per adapter
        extra = [(7 * r, a, f"lora_A's output (tokens x {r}, {a} B) per adapter, lora_B's input")]
        if cast:
            extra.append((5 * s.hidden + s.heads * s.head_dim + s.inter, 4,
                          "each adapter's own fp32 copy of its input (q, k, v, gate, up: h; o: heads x head_dim; "
                          "down: ffn), kept for lora_A's gradient"))
        return MemoryTerms(
            state=[Term("params", "LoRA adapters", adapters * a // ctx.shard_params, f"r={r} A and B on every projection, {a} B"),
                   Term("optimizer", "AdamW state of the adapters", adapters * 2 * a // ctx.shard_optimizer,
                        "two moments (fp32 adapters are their own masters: no copy)")],
            grads=[Term("grads", "adapter gradients", adapters * a // ctx.shard_grads)],
            step=[adamw_temporaries(ctx, max(r * max(m, n) for m, n in s.proj), prec, stepped=adapters)],
            trains_norms=False, trains_embedding=False, embed_grad=False, head_grad=False, dense_layer_grads=False,
            saves_inputs=not cast, layer_extra=extra,
            assumptions=["lora: base weights, embedding and norms frozen (no gradient, no state)"])

    def prepare(self, model: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        c = self.cfg
        found = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        missing = [t for t in c.targets if t not in found]
        if missing:
            raise ValueError(f"lora.targets {missing} match no nn.Linear of the model (it has {sorted(found)})")
        peft_cfg = LoraConfig(r=c.r, lora_alpha=c.alpha, lora_dropout=c.dropout, target_modules=list(c.targets),
                              bias="none", task_type="CAUSAL_LM")
        self.peft_model = get_peft_model(model, peft_cfg, autocast_adapter_dtype=False)
        dtype = torch.float32 if c.precision == "mixed" else model.dtype
        for p in self.peft_model.parameters():
            if p.requires_grad and p.dtype != dtype and p.dtype != torch.float64:
                p.data = p.data.to(dtype)  # mixed: fp32 adapters are their own masters
        return self.peft_model.base_model.model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.params = self.trainable_parameters(model)
        c = self.cfg
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                           weight_decay=c.weight_decay)
        return self.optimizer

    def step(self) -> dict[str, float]:
        return self.clipped_step(self.params, self.cfg.max_grad_norm)
