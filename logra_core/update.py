"""``Update``: an optimizer step computed but not applied — what step control and sync consume.

An update moves the parameters by θ ← θ + s·Δ for a scale s chosen after it is computed (DESIGN
§3.2, §7). Δ comes in two forms:

* ``lowrank[module_name] = (D, A)``: ΔW = D A for the weight of that module (D m×r, A r×n; for an
  ``nn.Embedding`` of V×d, D is V×r and A r×d) — sketched LoGRA weights, never formed densely;
* ``dense[param_name] = Δ``: a tensor of the parameter's shape (dense AdamW, GaLore, LoRA adapters,
  and LoGRA's unsketched tensors).

``pending`` is private to the optimizer that proposed the update: what it needs to apply it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Update:
    lowrank: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: Any = None

    def numel(self) -> int:
        """Numbers held by Δ (the memory a predictor's tangent inputs cost)."""
        return sum(d.numel() + a.numel() for d, a in self.lowrank.values()) + sum(t.numel() for t in self.dense.values())
