"""The KL probe of step control: rows sampled across prompt groups (seeded by the step), and its
token count logged as kl/probe_tokens."""

import pytest
import torch

from experiments.config import build_config
from experiments.rl.trainer import GRPOTrainer, probe_rows
from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.unit


def test_probe_spans_groups_and_is_seeded_by_step():
    G = 8
    rows = torch.arange(64)  # 8 groups of 8, group-major as the trainer keeps them
    rows = rows[rows % 5 != 0]  # some rows dropped (zero advantage)
    picks = [probe_rows(rows, G, 16, seed=0, step=s) for s in range(4)]
    for p in picks:
        assert len(p) == 16 and len(set(p.tolist())) == 16 and set(p.tolist()) <= set(rows.tolist())
        counts = torch.bincount(p // G, minlength=8)
        assert counts.max() - counts.min() <= 1, counts  # spread evenly over the 8 groups, not 2 groups of 8
    assert not torch.equal(picks[0], picks[1])  # a new draw every step
    assert torch.equal(picks[2], probe_rows(rows, G, 16, seed=0, step=2))  # ... a function of (seed, step)
    assert not torch.equal(picks[2], probe_rows(rows, G, 16, seed=1, step=2))
    assert torch.equal(probe_rows(rows, G, 100, seed=0, step=0).sort().values, rows)  # k ≥ rows: all of them


@pytest.mark.integration
def test_controlled_step_logs_probe_tokens(tmp_path):
    t = GRPOTrainer(build_config([*TINY, f"out_dir={tmp_path}", "eval.every=0", "method=logra", "logra.rank=4",
                                  "step_control.probe_seqs=3"]))
    torch.manual_seed(3)
    rollouts = t.engine.generate(t._prompts(t.train_problems[:2]), n=4)
    rows = torch.arange(8)
    t.method.zero_grad()
    t.accumulate_gradients(rollouts, torch.linspace(-1.5, 1.5, 8), [rows])
    stats = t._controlled_step(rollouts, rows)
    expected = rollouts.completion_mask[probe_rows(rows, 4, 3, t.cfg.seed, t.step)].sum()
    assert stats["kl/probe_tokens"] == float(expected) > 0
    t.close()
