"""The method interface: what differs between dense AdamW, GaLore, LoRA and LoGRA.

The GRPO trainer (``experiments/rl/trainer.py``) is written once against :class:`Method`; a method
is found by name in :data:`METHODS` and never by an ``if`` in the trainer. A method brings its own
config dataclass (``config_cls``), nested in the run config under its registry name.

Life cycle, per run: ``setup(model)`` = ``prepare(model)`` (wrap or instrument the model, choose
what trains) -> ``build_optimizer(model)``; per update: the trainer accumulates gradients with ``backward`` over
micro-batches (``backward(loss, last=...)``), with several processes sums them over the ranks with
``reduce_gradients(group)``, then calls ``step()`` once; ``state_dict()`` / ``load_state_dict()`` carry
everything needed to continue bit for bit. With predicted-KL step control the trainer calls
``propose()`` (the update, not applied) and ``apply(update, scale)`` instead of ``step()``.
A method whose model is bf16/fp16 may keep fp32 master weights (``master_weights``,
:mod:`baselines.precision`): its optimizer then steps the masters, and ``propose``/``apply``,
``clipped_step`` and the state dict go through them.
Before stepping, the trainer asks ``nonfinite()`` for the first accumulated tensor with a NaN/Inf
and, if there is one, calls ``discard()`` instead of stepping (``experiments/rl/guard.py``).

A method also declares what only it knows, so the tools ask it instead of naming it: the metric keys
it logs beyond the harness' (``metrics``, with their meanings; ``experiments/rl/metrics.py``), and its
part of a step's memory for the planner (``memory_terms``, ``rank_key``, ``plan_option_names``;
:mod:`baselines.memory_terms`, ``experiments/memory/planner.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from baselines.precision import MasterWeights
from baselines.memory_terms import MemoryTerms, PlanContext
from logra_core.distributed import all_reduce_sum, local
from logra_core.update import Update

METHODS: dict[str, type["Method"]] = {}


def first_nonfinite(named: Iterable[tuple[str, Optional[torch.Tensor]]]) -> Optional[str]:
    """The name of the first tensor holding a NaN or ±Inf, or None; ``None`` tensors are skipped.

    One host synchronisation for all tensors (a DTensor is checked on this rank's shard). A tensor is
    read through its min and max, which a NaN or an Inf anywhere in it makes non-finite: one pass over
    it and no mask of its size (``isfinite(t).all()`` allocates one: 20× slower on SmolLM2's embedding)."""
    items = [(n, local(t).detach()) for n, t in named if t is not None]
    if not items:
        return None
    device = items[0][1].device
    flags = torch.stack([_finite(t).to(device) for _, t in items])
    if bool(flags.all()):
        return None
    return items[int((~flags).nonzero()[0, 0])][0]


def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: no NaN and no ±Inf in ``t`` (integer and empty tensors: True)."""
    if t.is_complex():
        t = torch.view_as_real(t)  # real and imaginary parts, no copy
    if not t.is_floating_point() or t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)  # NaN propagates through both; ±Inf is an extreme
    return torch.isfinite(lo) & torch.isfinite(hi)


def register_method(name: str):
    """Class decorator: register a :class:`Method` subclass under ``name``."""

    def wrap(cls):
        cls.name = name
        METHODS[name] = cls
        return cls

    return wrap


class Method:
    """Base class. Subclasses set ``config_cls`` and implement ``build_optimizer``."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type]
    # predicted-KL step control when step_control.enabled is unset (on for logra: docs/design.md §3.2)
    step_control_default: ClassVar[bool] = False
    supports_step_control: ClassVar[bool] = True  # False where updates happen inside backward
    supports_data_parallel: ClassVar[bool] = True  # False where updates land before gradients could be reduced
    elementwise_optimizer: ClassVar[bool] = False  # its optimizer acts elementwise on trainable tensors (DeepSpeed ZeRO may partition it)
    adds_parameters: ClassVar[bool] = False  # prepare() adds parameters a checkpoint lacks (adapters), initialized by their own library
    metrics: ClassVar[dict[str, str]] = {}  # metric keys its step() logs beyond experiments/rl/metrics.py's, with their meanings
    rank_key: ClassVar[str | None] = None  # the config field that is the planner's `rank` (sketch rank, LoRA r); None: no rank
    plan_option_names: ClassVar[frozenset[str]] = frozenset()  # planner options only this method reads (PlanContext.options)

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """Its part of one training step's memory (:mod:`baselines.memory_terms`), for the planner."""
        raise NotImplementedError(f"method {cls.name!r} declares no memory terms (Method.memory_terms)")

    @classmethod
    def plan_options(cls, cfg: Any) -> dict:
        """The planner's keyword arguments that follow from this method's config section ``cfg``
        (``rank`` from ``rank_key``, and the fields named in ``plan_option_names``)."""
        out = {"rank": int(getattr(cfg, cls.rank_key))} if cls.rank_key else {}
        out.update({k: getattr(cfg, k) for k in sorted(cls.plan_option_names)})
        return out

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: nn.Module | None = None
        self.master_weights: MasterWeights | None = None  # fp32 masters of a bf16 model (precision=mixed)

    def setup(self, model: nn.Module, wrap=None) -> nn.Module:
        """``prepare``, then ``wrap(model, self)`` when given (e.g. FSDP sharding), then
        ``build_optimizer``; returns the model to train."""
        self.model = self.prepare(model)
        if wrap is not None:
            self.model = wrap(self.model, self)
        self.build_optimizer(self.model)
        return self.model

    def prepare(self, model: nn.Module) -> nn.Module:
        """Return the model to train (default: as is, every parameter trainable)."""
        return model

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Backward of one micro-batch's loss; ``last``: the final micro-batch before ``step()``."""
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reduce_gradients(self, group=None) -> int:
        """Sum the accumulated gradients over the data-parallel ranks of ``group``, once per update
        (after the last micro-batch, before ``step``/``propose``); returns the bytes all-reduced.
        Default: ``.grad`` of every trainable tensor that is not a DTensor (FSDP reduced those)."""
        params = [p for p in self.trainable_parameters(self.model) if not isinstance(p, DTensor)]
        summed, nbytes = all_reduce_sum([p.grad for p in params], group, like=[lambda p=p: p for p in params])
        for p, g in zip(params, summed):
            p.grad = g
        return nbytes

    def nonfinite(self) -> str | None:
        """The name of the first accumulated tensor ``step``/``propose`` would use that holds a NaN or
        ±Inf, or None. Default: the ``.grad`` of every trainable parameter (this rank's shard)."""
        return first_nonfinite((f"{n}.grad", p.grad) for n, p in self.model.named_parameters() if p.requires_grad)

    def discard(self) -> None:
        """Drop the accumulated gradients (sketches) of a skipped update; weights and optimizer
        state stay as they are. Default: ``zero_grad``."""
        self.zero_grad()

    def step(self) -> dict[str, float]:
        """Apply one update from the accumulated gradients; return metrics (e.g. ``step/grad_norm``)."""
        self.optimizer.step()
        return {}

    @staticmethod
    def clip_gradients(params: list[torch.Tensor], max_grad_norm: float) -> dict[str, float]:
        """Clip the global gradient norm of ``params`` to ``max_grad_norm`` (0 = off)."""
        max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        return {"step/grad_norm": float(grad_norm)}

    def clip(self) -> dict[str, float]:
        """Clip the global gradient norm of the method's trainable tensors to its ``max_grad_norm``;
        returns ``step/grad_norm`` (before clipping). Methods whose gradients are not plain ``.grad``
        tensors (logra's sketches) override this."""
        return self.clip_gradients(self.trainable_parameters(self.model), self.cfg.max_grad_norm)

    def clipped_step(self, params: list[torch.Tensor], max_grad_norm: float) -> dict[str, float]:
        """Clip the global gradient norm of ``params`` to ``max_grad_norm`` (0 = off), then step.
        With master weights: gradients move to the masters (fp32), clip, step, p ← round(master)."""
        mw = self.master_weights
        if mw is not None:
            mw.grads_to_masters()
            params = mw.substitute(list(params))
        stats = self.clip_gradients(params, max_grad_norm)
        self.optimizer.step()
        if mw is not None:
            mw.masters_to_params()
        return stats

    def full_precision_parameters(self) -> dict[str, torch.Tensor]:
        """Each trainable tensor's value as the optimizer keeps it: its fp32 master where it has one,
        else the parameter itself."""
        mw = self.master_weights
        return {n: (mw.master(p) if mw is not None else p).detach()
                for n, p in self.model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def propose(self) -> tuple[Update, dict[str, float]]:
        """The update of ``step()`` without applying it, and the step's metrics.

        Default, for any torch optimizer: remember the trainable tensors, ``step()``, take
        Δ = θ_new − θ_old, put θ_old back. Δ is as large as the trainable parameters (dense AdamW,
        GaLore: model-sized; LoRA: adapter-sized); methods with low-rank updates override this.
        """
        mw = self.master_weights
        params = [(n, p, mw.master(p) if mw is not None else p) for n, p in self.model.named_parameters() if p.requires_grad]
        old = [(m.detach().clone(), p.detach().clone() if m is not p else None) for _, p, m in params]
        stats = self.step()
        dense = {}
        for (name, p, m), (before, before_p) in zip(params, old):
            dense[name] = m.detach() - before  # with masters: the fp32 master's change
            m.copy_(before)
            if before_p is not None:
                p.copy_(before_p)
        old.clear()
        return Update(dense=dense), stats

    @torch.no_grad()
    def apply(self, update: Update, scale: float = 1.0) -> None:
        """θ ← θ + scale·Δ for an update from :meth:`propose`."""
        params, mw = dict(self.model.named_parameters()), self.master_weights
        for name, delta in update.dense.items():
            p = params[name]
            m = mw.master(p) if mw is not None else p
            m.add_(delta, alpha=scale)
            if m is not p:
                p.copy_(m)

    def sync_entries(self) -> tuple[dict, list[str], dict[str, torch.Tensor]]:
        """What the last applied step changed, for weight sync (:mod:`logra_core.sync`):
        (low-rank ops by parameter name, names of the other changed tensors, fp32 masters by name).
        Default: every trainable tensor changed (sent as its new value), no low-rank ops, no masters."""
        return {}, [n for n, p in self.model.named_parameters() if p.requires_grad], {}

    def state_dict(self) -> dict:
        out = {"optimizer": self.optimizer.state_dict()}
        if self.master_weights is not None:
            out["master_weights"] = self.master_weights.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_master_weights(state)

    def load_master_weights(self, state: dict) -> None:
        """Restore the fp32 masters of a checkpoint (one saved without them: rebuilt from the weights)."""
        if self.master_weights is not None and "master_weights" in state:
            self.master_weights.load_state_dict(state["master_weights"])
