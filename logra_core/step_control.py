"""Predicted-KL step control (DESIGN §3.2): scale an update so the policy moves by about κ.

The second-order prediction is quadratic in the step: KL̂(s) = s²·KL̂(1). For a target κ,

    s = min(1, √(κ / KL̂(1)))

so a step predicted to move the policy by more than κ (mean per-token KL(π_old ‖ π_new) on the
probe tokens) is shrunk to land on κ, and a smaller one is applied as proposed. A prediction that
is not finite (a broken update) gives s = 0: the step is skipped, and logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class StepControlConfig:
    enabled: Optional[bool] = None  # predicted-KL step control (DESIGN §3.2); None = the method's default (on for logra only)
    target_kl: float = 1e-2  # κ: the mean per-token KL(π_old‖π_new) on the probe tokens a step may reach (results/step_control)
    probe_seqs: int = 16  # sequences of the update's batch whose response tokens form the probe batch
    chunk: int = 64  # tokens per chunk of the LM-head / vocabulary sums (CPU path; 64: extra memory below a forward's)
    measure_realized: bool = False  # also compute the exact KL of the applied step on the probe (one more forward)

    def __post_init__(self):
        if self.target_kl <= 0:
            raise ValueError(f"step_control.target_kl must be > 0, got {self.target_kl}")
        if self.probe_seqs < 1 or self.chunk < 1:
            raise ValueError("step_control.probe_seqs and step_control.chunk must be >= 1")


def step_scale(predicted_kl: float, target_kl: float) -> float:
    """s = min(1, √(κ / KL̂)); 1 for a step predicted to change nothing, 0 for a non-finite prediction."""
    if not math.isfinite(predicted_kl):
        return 0.0
    if predicted_kl <= target_kl:
        return 1.0
    return math.sqrt(target_kl / predicted_kl)
