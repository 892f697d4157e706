"""What a method tells the memory planner: the bytes only it knows, as declarative terms.

The planner (``experiments/memory/planner.py``) is generic: it counts the weights, the activations a
decoder layer saves, the LM head's buffers and the candidate peaks of a training step (``backward``,
``recompute``, ``backward_end``, ``optimizer``; see its module docstring). Every method adds its own
part through ``Method.memory_terms(ctx) -> MemoryTerms``, written in the method's file:

* ``state``: alive for the whole step (trainable adapters, optimizer moments, projectors, masters,
  buffers the method keeps on the layers);
* ``grads``: alive once a micro-batch's backward has run (dense gradients, sketches), so alive
  during the last micro-batch's backward when there are several;
* ``step``: the method's temporaries at the optimizer step, beside ``state`` and ``grads``;
* flags for what the forward saves and what gets a dense gradient (the planner's activation and
  LM-head terms read them).

This module imports nothing heavy (no torch), so the planner stays importable without the harness.
Bytes of one element follow ``PlanContext``: ``weight_bytes`` (the model dtype) and, for AdamW under a
method's ``precision`` (docs/precision.md), ``master_bytes(precision)`` (an fp32 master copy: 4 for
``mixed`` on a bf16/fp16 model, else 0), ``moment_bytes(precision)`` (one moment: 4 for ``mixed`` or an
fp32 model, the weight's bytes for ``bf16``) and ``adam_bytes(precision)`` = master + two moments.
A method reads its own precision from ``ctx.options`` (filled from its config section by
``Method.plan_options``); where that is absent, ``ctx.precision`` (the planner's default) applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("params", "grads", "optimizer", "activations", "rollout", "other")
PRECISIONS = ("mixed", "bf16")  # the baselines' AdamW precision (baselines/precision.py), mirrored without torch


@dataclass
class Term:
    """Bytes of one group of tensors, alive at a candidate peak."""
    category: str  # one of CATEGORIES (how Plan.categories sums it)
    name: str  # what the tensors are
    nbytes: int  # bytes per GPU
    note: str = ""  # the assumption behind the count, printed in Plan.table()


@dataclass
class PlanContext:
    """What a method's terms may depend on: the model's shapes and the planner's settings."""
    shapes: Any  # experiments.memory.planner.Shapes: parameter counts of the decoder-only transformer
    weight_bytes: int  # bytes of one weight/activation element in the model dtype
    rank: int  # the planner's rank: LoGRA sketch rank, GaLore rank, LoRA r
    micro_batches: int  # micro-batches per update (k); k > 1 keeps the earlier gradients alive
    shard_params: int  # divisor of parameter bytes (FSDP / ZeRO-3 over the GPUs, else 1)
    shard_grads: int  # divisor of gradient bytes (FSDP / ZeRO-2/3)
    shard_optimizer: int  # divisor of optimizer-state bytes (any sharding)
    options: dict = field(default_factory=dict)  # the method's own planner options (Method.plan_option_names)
    precision: str = "mixed"  # AdamW precision where a method's options name none: mixed (fp32 master + moments) | bf16
    device: str = "cuda"  # cuda | cpu: which AdamW implementation's temporaries (foreach on CUDA, single-tensor on CPU)

    @property
    def low(self) -> bool:
        """Weights in bf16/fp16 (fewer than 4 bytes)."""
        return self.weight_bytes < 4

    def mixed(self, precision: str | None = None) -> bool:
        """An fp32 master beside each low-precision trained tensor: ``precision`` (default
        ``ctx.precision``) is ``mixed`` and the weights are bf16/fp16."""
        precision = precision or self.precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        return self.low and precision == "mixed"

    def master_bytes(self, precision: str | None = None) -> int:
        """Bytes per element of AdamW's fp32 master copy (0: it steps the weight itself)."""
        return 4 if self.mixed(precision) else 0

    def moment_bytes(self, precision: str | None = None) -> int:
        """Bytes per element of one AdamW moment, of the gradient it steps on, and of its step temporaries."""
        return 4 if self.mixed(precision) else self.weight_bytes

    def adam_bytes(self, precision: str | None = None) -> int:
        """AdamW state per trained element: master + two moments (mixed bf16: 4 + 8 = 12 B; pure bf16: 4 B)."""
        return self.master_bytes(precision) + 2 * self.moment_bytes(precision)


@dataclass
class MemoryTerms:
    """A method's part of one training step's memory (see the module docstring)."""
    state: list[Term] = field(default_factory=list)  # alive for the whole step (beside the weights)
    grads: list[Term] = field(default_factory=list)  # alive once a micro-batch's backward has run
    step: list[Term] = field(default_factory=list)  # the optimizer step's temporaries
    grads_at_step: bool = True  # False: every gradient was consumed (and freed) inside backward
    trains_norms: bool = True  # the RMSNorm weights train: each norm keeps its normalized x
    trains_embedding: bool = True  # the embedding receives a gradient (dense or sketched)
    saves_inputs: bool = True  # each projection (or its adapter) keeps its input x for a weight gradient
    input_bytes: int | None = None  # bytes per element of the kept norm outputs (None: the weight dtype)
    layer_extra: list[tuple[int, int, str]] = field(default_factory=list)  # per decoder layer and token: (elements, bytes each, what)
    embed_grad: bool = True  # the embedding gets a dense V x h gradient (the backward_end candidate)
    head_grad: bool = True  # an LM head (tied or not) gets a dense fp32 V x h weight gradient in its backward
    head: list[Term] = field(default_factory=list)  # more terms alive in the LM head's backward (e.g. a head sketch)
    assumptions: list[str] = field(default_factory=list)  # printed among the plan's assumptions
    dense_layer_grads: bool = True  # a decoder layer's weights get dense gradients (FSDP holds one layer's unsharded)
    sketched_rows: int = 0  # Σ m of the weights synced as low-rank ops (m x r factors in the payload)
    sketched_max_rows: int = 0  # the largest such m (a sharded sender gathers one factor at a time)
    receiver_bytes: int = 0  # bytes per sketched element an engine keeps beside its weights (masters, compensations)


def adamw_temporaries(ctx: PlanContext, biggest: int, precision: str | None = None, stepped: int = 0) -> Term:
    """torch's AdamW temporaries in the moments' dtype: on CPU (single-tensor) two the size of the largest
    tensor it steps; on CUDA (foreach) one the size of every ``stepped`` element: ``_foreach_sqrt`` of the
    second moments (checked by reading torch's ``_multi_tensor_adamw``, not measured here)."""
    if ctx.device == "cuda" and stepped:
        return Term("activations", "AdamW temporaries (CUDA foreach)", stepped * ctx.moment_bytes(precision) // ctx.shard_optimizer,
                    "_foreach_sqrt(exp_avg_sq): one temporary per stepped tensor, all at once (of its shard) - UNCHECKED on a GPU")
    return Term("activations", "AdamW temporaries", 2 * biggest * ctx.moment_bytes(precision) // ctx.shard_optimizer,
                "two of the largest tensor (of its shard); CPU single-tensor AdamW")


def master_gradients(ctx: PlanContext, elements: int) -> Term:
    """Mixed precision at the step: every bf16 gradient has become its master's fp32 gradient
    (m.grad ← fp32(p.grad), p.grad dropped; baselines/precision.py), 4 B per trained element."""
    return Term("grads", "fp32 gradients of the masters", elements * 4 // ctx.shard_grads,
                "m.grad = fp32(p.grad) for every trained tensor; the bf16 gradients are dropped as they are cast")
