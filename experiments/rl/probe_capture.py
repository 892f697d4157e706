"""The KL probe's last hidden states, kept from the update's own forward (docs/design.md §3.2).

The secant KL predictor (:mod:`logra_core.kl_secant`) compares the probe's logits at θ and at the
trial weights θ + εΔ. The forward at θ is one the step already runs: the forward + backward of the
micro-batches holds every probe row at θ. :class:`ProbeCapture` hooks the decoder during that pass and
keeps, for each probe row, the last hidden state at the positions that predict its response tokens —
in the probe's row order, row-major, as :func:`experiments.rl.trainer.probe_inputs` selects them — so
the predictor needs one forward (the trial) instead of two.

A micro-batch trims its all-padding columns (``Rollouts.select``), so a row sits in fewer or more
padding columns than in the probe batch; with left-padded prompts, right-padded completions and
position ids from the mask, its hidden states are the same up to floating-point reordering (fp32:
~1e-6 relative, a KL floor ~1e-12; the trial's perturbation is what is measured). In bf16 that
reordering noise would enter the measured KL, so the trainer keeps capturing for fp32/fp64 models only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class ProbeCapture:
    """A forward hook on ``decoder`` that keeps the probe rows' response-position hidden states.

    ``probe``: the probe's row indices (batch rows, in probe order); call :meth:`micro_batch` with each
    micro-batch's rows and completion mask before its forward; :meth:`hidden` returns the T × d states
    (detached) once every probe row was seen, else None."""

    def __init__(self, decoder: nn.Module, probe: torch.Tensor):
        self.order = {int(r): i for i, r in enumerate(probe.tolist())}
        self.kept: dict[int, torch.Tensor] = {}
        self._rows: Optional[list[int]] = None
        self._mask: Optional[torch.Tensor] = None
        self._handle = decoder.register_forward_hook(self._hook)

    def micro_batch(self, rows: torch.Tensor, completion_mask: torch.Tensor) -> None:
        """The rows (batch indices) and completion mask [b, C] of the forward that comes next."""
        self._rows, self._mask = rows.tolist(), completion_mask.bool()

    def _hook(self, module, args, out):
        if self._rows is None:
            return
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        C = self._mask.shape[1]
        states = h[:, -C - 1 : -1].detach()  # the positions that predict the C completion columns
        for j, row in enumerate(self._rows):
            if row in self.order:  # a recomputation (activation checkpointing) overwrites with the same values
                self.kept[row] = states[j][self._mask[j].to(states.device)].clone()
        self._rows = None

    def hidden(self) -> Optional[torch.Tensor]:
        if len(self.kept) < len(self.order):
            return None
        return torch.cat([self.kept[r] for r in sorted(self.order, key=self.order.get)])

    def close(self) -> None:
        self._handle.remove()
        self.kept.clear()
