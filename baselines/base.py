"""The method interface: what differs between dense AdamW, GaLore, LoRA and LoGRA.

The GRPO trainer (``experiments/rl/trainer.py``) is written once against :class:`Method`; a method
is found by name in :data:`METHODS` and never by an ``if`` in the trainer. A method brings its own
config dataclass (``config_cls``), nested in the run config under its registry name.

Life cycle, per run: ``prepare(model)`` (wrap or instrument the model, choose what trains) ->
``build_optimizer(model)``; per update: the trainer accumulates gradients with ``backward`` over
micro-batches (``backward(loss, last=...)``), then calls ``step()`` once; ``state_dict()`` / ``load_state_dict()`` carry
everything needed to continue bit for bit. (The propose/apply split for predicted-KL step control
refines ``step()`` in a later issue.)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

METHODS: dict[str, type["Method"]] = {}


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

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.optimizer: torch.optim.Optimizer | None = None

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

    def step(self) -> dict[str, float]:
        """Apply one update from the accumulated gradients; return metrics (e.g. ``step/grad_norm``)."""
        self.optimizer.step()
        return {}

    def clipped_step(self, params: list[torch.Tensor], max_grad_norm: float) -> dict[str, float]:
        """Clip the global gradient norm of ``params`` to ``max_grad_norm`` (0 = off), then step."""
        max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        self.optimizer.step()
        return {"step/grad_norm": float(grad_norm)}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
