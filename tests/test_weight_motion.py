"""experiments.weight_motion: which weights a run changed, counted in bf16 spacings."""

import csv
import json

import pytest
import torch

from experiments.weight_motion import main, motion, spacing


@pytest.mark.unit
def test_spacing_is_the_bf16_ulp():
    w = torch.tensor([1.0, 1.5, 0.02, -0.3], dtype=torch.bfloat16)
    assert spacing(w).tolist() == [2.0**-7, 2.0**-7, 2.0**-13, 2.0**-9]
    for x, ulp in zip(w.float().abs(), spacing(w)):  # one spacing up is the next bf16 number; a quarter rounds back
        assert (x + ulp).to(torch.bfloat16).float() == x + ulp and (x + ulp / 4).to(torch.bfloat16).float() == x


@pytest.mark.unit
def test_motion_counts_changed_elements_and_master_movement():
    start = {"model.layers.0.q_proj.weight": torch.full((4, 5), 0.02, dtype=torch.bfloat16),
             "model.norm.weight": torch.ones(10, dtype=torch.bfloat16)}
    end = {k: v.clone() for k, v in start.items()}
    end["model.layers.0.q_proj.weight"].view(-1)[:6] += 2.0**-13  # 6 of 20 projection elements one ulp up
    ulp = spacing(start["model.layers.0.q_proj.weight"]).float()
    masters = {"model.layers.0.q_proj.weight": start["model.layers.0.q_proj.weight"].float() + 0.3 * ulp}
    masters["model.layers.0.q_proj.weight"].view(-1)[:4] += 0.5 * ulp.view(-1)[:4]  # 4 of 20 at 0.8 spacings
    row = motion(start, end, masters, sample=10_000)
    assert row["elements"] == 30
    assert row["changed"] == pytest.approx(6 / 30) and row["proj_changed"] == pytest.approx(6 / 20)
    assert row["moved_ulp_p50"] == pytest.approx(0.3, rel=1e-3)
    assert row["moved_ulp_p90"] == pytest.approx(0.8, rel=1e-3)
    assert row["moved_half_ulp"] == pytest.approx(4 / 20)
    assert "moved_ulp_p50" not in motion(start, end)  # no masters, no movement columns


@pytest.mark.integration
def test_cli_on_a_bf16_mixed_run(tmp_path, capsys):
    """Two bf16 dense steps with fp32 masters on tiny-llama: the tool reloads the start weights from the
    run's config and reads the checkpoint's masters."""
    from experiments.config import build_config
    from experiments.rl.trainer import GRPOTrainer
    from tests.conftest import TINY
    from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

    run = tmp_path / "run"
    GRPOTrainer(build_config([*TINY, f"out_dir={run}", "model.dtype=bfloat16", "method=dense", "dense.lr=1e-3",
                              "train.steps=2"])).train()
    out = tmp_path / "motion.csv"
    assert main([f"runs={run}", f"out={out}"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 1 and rows[0]["dtype"] == "bfloat16" and rows[0]["step"] == "2"
    assert 0 < float(rows[0]["changed"]) <= 1 and float(rows[0]["moved_ulp_p90"]) > 0
    assert json.loads(out.with_suffix(".json").read_text())["rows"][0]["run"] == "run"
    assert "elements changed" in capsys.readouterr().out
    assert main(["runs="]) == 2  # nothing to read: a clear error, not a traceback
