"""Predicted-KL step control (docs/design.md §3.2): scale an update so the policy moves by about κ.

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

from logra_core.kl_predictor import PREDICTORS


PROBE_WEIGHTINGS = ("tokens", "advantage")


@dataclass
class StepControlConfig:
    enabled: Optional[bool] = None  # predicted-KL step control (docs/design.md §3.2); None = the method's default (on for logra only)
    target_kl: float = 1e-2  # κ: the mean per-token KL(π_old‖π_new) on the probe tokens a step may reach (results/step_control)
    probe_seqs: int = 16  # at most this many sequences of the update's batch form the probe batch (their response tokens)
    probe_fraction: float = 0.25  # probe round(fraction × batch sequences) of them (≥ 1, ≤ probe_seqs), drawn across prompt groups; SmolLM2 probe study: 4-16 of 64 sequences read the batch's KL within 4-15 % (docs/speed.md)
    probe_min: int = 12  # but at least this many sequences (≤ the batch, ≤ probe_seqs): a floor for batches with few trained rows, where a quarter is a probe of 2-6 and most misses of κ were; 12 since 3 controlled cpu runs held the realized KL within ±25 % of κ on more of the shrunk steps than at 0 (docs/speed.md)
    probe_weighting: str = "tokens"  # the ratio estimator's size per probe row: tokens (the probe's token mean) | advantage (tokens × |advantage|; on a trained SmolLM2 policy 1.6-1.7x the sampling error of tokens: an option to study, docs/speed.md)
    chunk: int = 64  # the LM-head / vocabulary sums hold chunk × V elements at a time (chunk tokens × the vocabulary; the secant's one-pass sums: chunk·V/1024 tokens × 1024 head rows); 64: extra memory below a forward's
    measure_realized: bool = False  # also compute the exact KL of the applied step on every trained response token (kl/realized; two more forwards of the batch)
    predictor: str = "secant"  # exact (second-order term by a forward-mode tangent, ~3.35 forwards of the probe) | secant (the KL measured at the last step's scale, 2 plain forwards; logra_core/kl_secant.py)
    share_context: bool = True  # secant: the probe's forwards compute the context its rows share (chat header, a group's prompt) once, by a KV cache (same states up to fp reordering; logra_core/shared_context.py)
    min_trial_scale: float = 1e-3  # the secant's trial scale never drops below this (a skipped or tiny step)
    max_trials: int = 3  # secant: measure again at the chosen scale (up to this many trials) while it is > 2x off the trial

    def __post_init__(self):
        if self.target_kl <= 0:
            raise ValueError(f"step_control.target_kl must be > 0, got {self.target_kl}")
        if self.probe_seqs < 1 or self.chunk < 1:
            raise ValueError("step_control.probe_seqs and step_control.chunk must be >= 1")
        if self.probe_min < 0:
            raise ValueError(f"step_control.probe_min must be >= 0, got {self.probe_min}")
        if not 0 < self.probe_fraction <= 1:
            raise ValueError(f"step_control.probe_fraction must be in (0, 1], got {self.probe_fraction}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"step_control.predictor must be one of {sorted(PREDICTORS)}, got {self.predictor!r}")
        if self.probe_weighting not in PROBE_WEIGHTINGS:
            raise ValueError(f"step_control.probe_weighting must be one of {PROBE_WEIGHTINGS}, got {self.probe_weighting!r}")
        if self.max_trials < 1:
            raise ValueError(f"step_control.max_trials must be >= 1, got {self.max_trials}")
        if not 0 < self.min_trial_scale <= 1:
            raise ValueError(f"step_control.min_trial_scale must be in (0, 1], got {self.min_trial_scale}")

    def probe_rows(self, batch_seqs: int) -> int:
        """Sequences to probe in a batch of ``batch_seqs``: round(probe_fraction · batch_seqs), at least 1
        and ``probe_min``, at most ``probe_seqs`` and the batch.

        Cost: the default secant predictor runs one forward of the probe at the trial weights (its
        state at θ is kept from the update's forward) and two vocabulary-sized head products per probe
        token; the update's forward + backward is ≈ 3 forwards of the whole batch, so the prediction
        is ≈ n / (3 · batch_seqs) of the training pass plus the head. Measured shares of logra's step
        (docs/speed.md, results/time_table/step_*_c19ea52, kl_cost_16x8): 4.6 % at 64 sequences (16
        probed), 2.8 % at 128, 10.4 % at 16 (the floor probes 12). The probe's sampling error is logged as
        ``kl/predicted_stderr``."""
        return max(1, min(self.probe_seqs, batch_seqs, max(self.probe_min, round(self.probe_fraction * batch_seqs))))


def step_scale(predicted_kl: float, target_kl: float) -> float:
    """s = min(1, √(κ / KL̂)); 1 for a step predicted to change nothing, 0 for a non-finite prediction."""
    if not math.isfinite(predicted_kl):
        return 0.0
    if predicted_kl <= target_kl:
        return 1.0
    return math.sqrt(target_kl / predicted_kl)
