"""The step-time table: every phase for every method, written, summarized and rendered."""

import csv
import json

import pytest

from experiments.time_table import DEFAULT_METHODS, PHASES, main, rotation, summarize

pytestmark = pytest.mark.integration


def test_time_table_has_every_phase_for_every_method(tmp_path, capsys):
    out = tmp_path / "time"
    main(["model=tiny-llama", "repeats=2", "warmup=0", f"out={out}", "logra.rank=8", "train.prompts_per_step=2",
          "train.group_size=2", "rollout.max_new_tokens=4", "train.micro_batch_size=4", "step_control.probe_seqs=2"])
    rows = list(csv.DictReader(open(out / "time.csv")))
    methods = [m.strip() for m in DEFAULT_METHODS.split(",")]
    assert {(r["method"], r["phase"]) for r in rows} == {(m, p) for m in methods for p in PHASES + ["step"]}
    by = {(r["method"], r["phase"]): r for r in rows}
    for m in methods:
        assert float(by[(m, "rollout")]["median_s"]) > 0 and float(by[(m, "fwd_bwd")]["median_s"]) > 0
        assert float(by[(m, "old_logprobs")]["median_s"]) == 0.0  # one PPO epoch: no old log-prob pass
        phases = sum(float(by[(m, p)]["median_s"]) for p in PHASES)
        assert phases <= float(by[(m, "step")]["max_s"]) * 1.05  # the phases fit inside the step
        assert float(by[(m, "step")]["min_s"]) <= float(by[(m, "step")]["median_s"])
    # step control runs the KL prediction; without it the phase is 0
    assert float(by[("logra:step_control.enabled=true", "kl_predict")]["median_s"]) > 0
    assert float(by[("logra:step_control.enabled=false", "kl_predict")]["median_s"]) == 0.0
    assert float(by[("dense", "step")]["x_dense"]) == 1.0
    meta = json.loads((out / "time.json").read_text())
    assert meta["git_sha"] and meta["torch"] and meta["threads"] >= 1 and meta["device"] == "cpu"
    assert all(len(v) == 2 for v in meta["samples"].values())
    assert (out / "time.png").exists()
    assert "× dense" in capsys.readouterr().out

    from analysis.steptime import load_time_csv, step_table

    table = step_table(load_time_csv(tmp_path))
    assert list(table.shown["method"]) == methods and "kl_predict / step" in table.shown.columns


def test_summarize_statistics():
    samples = {"dense": [{p: 1.0 for p in PHASES + ["step"]} | {"step": s} for s in (1.0, 3.0, 2.0)],
               "x": [{p: 0.0 for p in PHASES + ["step"]} | {"step": s} for s in (4.0, 8.0, 6.0)]}
    rows = {(r["method"], r["phase"]): r for r in summarize(samples, "m", "cpu", "sha")}
    assert rows[("x", "step")]["median_s"] == 6.0 and rows[("x", "step")]["x_dense"] == 3.0
    assert (rows[("x", "step")]["min_s"], rows[("x", "step")]["max_s"]) == (4.0, 8.0)
    assert (rows[("x", "step")]["q25_s"], rows[("x", "step")]["q75_s"]) == (5.0, 7.0)
    assert rows[("x", "rollout")]["x_dense"] == 0.0
    # paired by round: 4/1, 8/3, 6/2 -> median 3, not the ratio of medians' 6/2
    assert rows[("x", "step")]["x_dense_paired"] == 3.0
    assert rows[("x", "step")]["x_dense_paired_q25"] == pytest.approx((8 / 3 + 3) / 2)
    assert rows[("x", "step")]["x_dense_paired_q75"] == pytest.approx((3 + 4) / 2)
    assert rows[("x", "rollout")]["x_dense_paired"] == 0.0


def test_rollout_only_rounds_time_generation_alone(tmp_path):
    out = tmp_path / "time"
    main(["model=tiny-llama", "repeats=3", "warmup=0", f"out={out}", "methods=dense,logra", "phases=rollout",
          "logra.rank=8", "train.prompts_per_step=2", "train.group_size=2", "rollout.max_new_tokens=4"])
    by = {(r["method"], r["phase"]): r for r in csv.DictReader(open(out / "time.csv"))}
    for m in ("dense", "logra"):
        assert float(by[(m, "rollout")]["median_s"]) > 0
        assert all(float(by[(m, p)]["max_s"]) == 0.0 for p in PHASES if p != "rollout")  # no update ran
        assert float(by[(m, "rollout")]["x_dense_paired"]) > 0
    with pytest.raises(SystemExit, match="phases="):
        main(["model=tiny-llama", "repeats=1", f"out={out}", "methods=dense", "phases=update"])


def test_rounds_rotate_so_every_method_takes_every_position_and_never_repeats():
    methods = list("ABCD")
    rounds = [rotation(methods, r) for r in range(8)]
    for pos in range(4):  # over 4 rounds each method sits at each position once
        assert sorted(r[pos] for r in rounds[:4]) == methods
    flat = methods + [m for r in rounds for m in r]  # the warm-up round first, then the timed rounds
    assert all(a != b for a, b in zip(flat, flat[1:]))
