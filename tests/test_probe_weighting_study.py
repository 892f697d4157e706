"""experiments.memory.probe_weighting_study on a tiny model: one row per batch × size × draw × estimator,
every estimator reads the same exact KL, the whole bookkeeping of the probe's rows is right."""

import json

import pytest

from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.integration


def test_probe_weighting_study_writes_every_estimator_per_probe(tmp_path, capsys):
    from experiments.memory.probe_weighting_study import main

    out = tmp_path / "pw"
    argv = [f"out={out}", "batches=2", "probe_seqs=2", "draws=3", "max_tries=6", "target_kl=1e-4", "advance=false",
            *[a for a in TINY if not a.startswith("eval.")], "train.prompts_per_step=4", "logra.rank=4", "logra.lr=3e-2"]
    rc = main(argv)
    if rc == 1:  # the toy policy never produced a batch with mixed rewards in 6 tries
        pytest.skip(capsys.readouterr().err)
    assert rc == 0
    rows = [r for r in (out / "probe_weighting.csv").read_text().splitlines()[1:]]
    meta = json.loads((out / "probe_weighting.json").read_text())
    assert meta["git_sha"] and len(meta["batches"]) == 2 and len(rows) == 2 * 3 * 4  # later batches sampled too
    import csv
    recs = list(csv.DictReader((out / "probe_weighting.csv").open()))
    assert {r["estimator"] for r in recs} == {"tokens", "advantage", "gini", "entropy"}
    for r in recs:
        assert float(r["exact"]) > 0 and float(r["estimate"]) > 0 and float(r["stderr"]) >= 0
        assert abs(float(r["rel_err"]) - abs(float(r["estimate"]) - float(r["exact"])) / float(r["exact"])) < 1e-9
    assert "advantage" in (out / "probe_weighting.txt").read_text()


def test_token_spread_is_zero_for_a_sure_token_and_maximal_for_a_uniform_one():
    import math

    import torch

    from experiments.memory.probe_weighting_study import token_spread

    W = torch.eye(4) * 50.0  # vocabulary of 4, hidden 4
    h = torch.stack([torch.tensor([1.0, 0, 0, 0]), torch.zeros(4)])  # one-hot logits (sure) / all equal
    gini, ent = token_spread(h, W, chunk=1)
    assert gini[0] < 1e-12 and ent[0] < 1e-12
    assert abs(gini[1] - 0.75) < 1e-12 and abs(ent[1] - math.log(4)) < 1e-12
