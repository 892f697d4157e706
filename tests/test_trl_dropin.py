"""LoGRA drops into TRL's GRPOTrainer: two GRPO steps on tiny-llama through examples/trl_grpo_logra.py."""

import math

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -c constraints.txt 'trl>=1.0', dev extra)")

from examples.trl_grpo_logra import build_trainer  # noqa: E402
from logra_core.sketch import SketchedLinear  # noqa: E402

pytestmark = pytest.mark.integration


def test_grpo_trainer_steps_with_logra(tmp_path):
    trainer, optimizer = build_trainer("tiny-llama", steps=2, output_dir=str(tmp_path), rank=8, lr=1e-3,
                                       num_generations=4, max_completion_length=8)
    sketched = optimizer.modules_by_name
    assert sketched and all(isinstance(m, SketchedLinear) for m in sketched.values())
    before = {n: m.weight.detach().clone() for n, m in sketched.items()}

    trainer.train()

    assert trainer.state.global_step == 2
    assert optimizer.sketch_step == 2  # LoGRA.step ran once per optimizer step
    # TRL kept the model and its sketched modules (no rewrapping that renames or replaces them)
    names = dict(trainer.model.named_modules())
    assert all(names.get(n) is m for n, m in sketched.items())
    changed = [n for n, m in sketched.items() if not torch.equal(m.weight.detach(), before[n])]
    assert changed == list(sketched), f"unchanged sketched weights: {sorted(set(sketched) - set(changed))}"
    assert all(m.weight.grad is None for m in sketched.values())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), trainer.state.log_history
