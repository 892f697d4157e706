"""The seed study's look tool (analysis/seeds.py) on fake results roots: runs written with exactly the
config the sweep experiments/sweeps/cpu_seeds.yaml gives each method (seeds 100 and up), their final
per-problem outcomes chosen so that the rule's outcome is known, and the rule's text tied to the sweep's
header, where it was fixed before the runs."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis import crossed, seeds
from analysis.load import load_runs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = 200


def nested(flat: dict) -> dict:
    """``analysis.load.flatten`` undone: dotted keys -> nested dicts (lists were JSON strings)."""
    tree: dict = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[last] = json.loads(value) if isinstance(value, str) and value.startswith("[") else value
    return tree


def write_run(root: Path, method: str, seed: int, solved: set[int], **changes) -> Path:
    config = dict(seeds.study_configs()[0][method], seed=seed, **changes)
    run = root / "runs" / f"{method}-arith-s{seed}-{seed:08x}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(nested(config)))
    (run / "meta.json").write_text(json.dumps({"git_sha": "c" * 40 + "-dirty"}))
    (run / "done.json").write_text("{}")
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/num_problems": float(PROBLEMS)},
            {"step": 1, "reward/mean": 0.5, **({"kl/predicted": 0.02} if method == "logra" else {})},
            {"step": 2, "eval/accuracy": len(solved) / PROBLEMS, "eval/num_problems": float(PROBLEMS)}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = list(range(PROBLEMS))
    random.Random(seed).shuffle(ids)  # each run its own order: paired by id
    line = {"step": 2, "problem_ids": [f"arith/test/{i}" for i in ids], "correct": "".join(str(int(i in solved)) for i in ids)}
    (run / "eval_outcomes.jsonl").write_text(json.dumps(line) + "\n")
    return run


def make_root(root: Path, gaps: list[float], noise: int = 0) -> Path:
    """Fresh seeds 100.. with dense solving 150 problems and logra solving ``150 + gap·PROBLEMS`` of the
    same ranking (plus ``noise`` problems swapped per seed)."""
    for i, gap in enumerate(gaps):
        seed = 100 + i
        ranking = list(range(PROBLEMS))
        random.Random(f"rank{seed}").shuffle(ranking)
        dense = set(ranking[:150])
        k = 150 + round(gap * PROBLEMS)
        logra = set(ranking[noise:k + noise])
        write_run(root, "dense", seed, dense)
        write_run(root, "logra", seed, logra)
    return root


def test_rule_text_is_the_sweep_header_s():
    text = (REPO / "experiments/sweeps/cpu_seeds.yaml").read_text()
    header = " ".join(line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#"))
    assert "looks after 5, 10, 15 and 20 fresh seeds" in header and "looks after 5, 10, 15 and 20 fresh seeds" in seeds.RULE
    assert "1 − 0.05/4 = 98.75 %" in header and f"{100 * seeds.LEVEL:.2f} %" == "98.75 %"
    for verdict in ("equal within 5 points", "a gap beyond 5 points", "undecided at 20 seeds"):
        assert verdict in header and verdict in seeds.RULE
    grid = yaml.safe_load(text)["grid"]["seed"]
    assert seeds.study_configs()[1] == grid and min(grid) >= 100


def test_decide_reads_the_interval_against_the_margin():
    def iv(lo, hi):
        return crossed.Interval(0.5 * (lo + hi), lo, hi)
    assert seeds.decide(iv(-0.04, 0.02), last=False) == "equal"
    assert seeds.decide(iv(-0.12, -0.06), last=False) == "gap"
    assert seeds.decide(iv(-0.08, 0.01), last=False) == "continue"
    assert seeds.decide(iv(-0.08, 0.01), last=True) == "undecided"


def test_five_equal_seeds_decide_equal_at_the_first_look(tmp_path):
    runs = load_runs(make_root(tmp_path, [0.0, 0.005, -0.005, 0.0, 0.01, 0.0, 0.0]))
    st = seeds.state(runs)
    assert sorted(st["diffs"]) == list(range(100, 107)) and st["excluded"] == []
    (look,) = st["looks"]  # decided at 5: seeds 105 and 106 are not looked at
    assert look.n == 5 and look.seeds == (100, 101, 102, 103, 104) and look.decision == "equal"
    assert look.delta.estimate == pytest.approx(0.002) and look.delta.level == seeds.LEVEL
    assert st["verdict"] == "equal within 5 points"
    table = seeds.table(runs)
    assert "| 1 of 4 | 5 | +0.2 |" in table.markdown() and "decided at look 1" in table.markdown()


def test_a_clear_gap_is_a_gap(tmp_path):
    st = seeds.state(load_runs(make_root(tmp_path, [-0.20, -0.21, -0.19, -0.20, -0.22])))
    assert st["looks"][-1].decision == "gap" and st["verdict"] == "a gap beyond 5 points"


def test_before_a_decision_the_study_continues_and_says_how_far_it_is(tmp_path):
    # per-seed gaps straddling −5 points: the 98.75 % interval over 6 seeds reaches past it
    runs = load_runs(make_root(tmp_path, [-0.10, 0.04, -0.08, 0.05, -0.09, 0.02]))
    st = seeds.state(runs)
    (look,) = st["looks"]
    assert look.decision == "continue" and look.delta.low < -0.05 < look.delta.high
    assert st["verdict"] == "undecided after 6 fresh seeds; the study continues"
    assert st["finals"][101] == (0.75, pytest.approx(0.79)) and st["finals"][104] == (0.75, pytest.approx(0.66))
    note = next(n for n in seeds.table(runs).notes if n.startswith("per counted seed"))
    assert "100: 0.750 / 0.650 (-10.0); 101: 0.750 / 0.790 (+4.0);" in note and note.endswith("105: 0.750 / 0.770 (+2.0)")


def test_runs_off_the_study_s_config_or_unfinished_do_not_count(tmp_path):
    make_root(tmp_path, [0.0] * 4)
    write_run(tmp_path, "dense", 104, set(range(150)))
    write_run(tmp_path, "logra", 104, set(range(150)), **{"logra.lr": 4e-5})  # another rate: not the study's
    write_run(tmp_path, "dense", 105, set(range(150)))  # its logra is missing
    (write_run(tmp_path, "logra", 106, set(range(150))) / "done.json").unlink()
    write_run(tmp_path, "dense", 106, set(range(150)))
    st = seeds.state(load_runs(tmp_path))
    assert sorted(st["diffs"]) == [100, 101, 102, 103] and st["looks"] == []
    assert any("config differs from the study's in logra.lr" in w for w in st["excluded"])
    assert st["verdict"] == "undecided after 4 fresh seeds; the study continues"
    members = seeds.membership(load_runs(tmp_path))
    assert not members.set_index("run").loc["runs/logra-arith-s104-00000068", "matches"]


def test_the_committed_cpu_runs_below_the_study_s_seeds_are_its_dense_and_logra_cells():
    """results/cpu: the study's configuration matches dense and logra at the probe floor (seeds 0-2), not
    logra without the floor (a key it lacks), without control or with sketched embeddings."""
    members = seeds.membership(load_runs(REPO / "results/cpu"))
    matched = sorted(members[members["matches"] & ~members["fresh"]]["run"])
    assert [re.sub(r"-s\d-.*", "", r) for r in matched] == ["runs/dense-arith"] * 3 + ["runs/logra-floor-arith"] * 3


def test_only_the_sampling_engine_s_settings_decide_membership():
    """A run that predates rollout.vllm.* (or set it otherwise) still matches a study that samples with the
    HF engine; with the study sampling through vLLM those keys count, a missing one included."""
    study = seeds.study_configs()[0]["logra"]
    assert study["rollout.engine"] != "vllm"
    run = {k: v for k, v in study.items() if not k.startswith("rollout.vllm.")}
    assert seeds.disagreements(run, study, True) == []
    assert seeds.disagreements(dict(run, **{"logra.lr": 1.0}), study, True) == ["logra.lr"]
    on_vllm = dict(study, **{"rollout.engine": "vllm"})
    missing = seeds.disagreements(dict(run, **{"rollout.engine": "vllm"}), on_vllm, True)
    assert missing and all(k.startswith("rollout.vllm.") for k in missing)


def test_a_root_s_other_accuracy_tables_leave_the_study_s_runs_to_its_rule(tmp_path):
    """Pooled into tables/accuracy_intervals.md and claims, the study's seeds would give a nominal 95 %
    interval after every published seed, beside seeds that chose the rates: those tables read the runs
    outside the study and say what they leave out; seed_study and the cost tables read every run."""
    from analysis import report

    make_root(tmp_path, [0.0, 0.01, -0.01, 0.0, 0.02])
    ranking = list(range(PROBLEMS))
    for seed in (0, 1):
        write_run(tmp_path, "dense", seed, set(ranking[:150]))
        write_run(tmp_path, "logra", seed, set(ranking[:100]))
    results = report.load(tmp_path)
    assert sorted(set(results.profile["seed"].astype(int))) == [0, 1]
    tables = report.tables(results)
    data = tables["accuracy_intervals"].data.set_index("method")
    assert data.loc["logra", "seeds"] == 2 and data.loc["logra", "delta"] == pytest.approx(-0.25)
    assert any("seed study's 10 runs (fresh seeds 100, 101, 102, 103, 104) are left out" in n
               for n in tables["accuracy_intervals"].notes)
    assert tables["seed_study"].data["seeds"].tolist() == [5]
    assert any("(2 seeds, paired)" in line for line in report.summary_lines(results))
