"""The learning-rate sweep table, the accuracy intervals, the memory–accuracy points and the claims
table, on tiny fake results roots written here in the launcher's layout (``runs/<name>-<hash8>/``
with config.yaml, meta.json, metrics.jsonl, done.json, eval_outcomes.jsonl where a test asks for it;
``memory/memory.csv``; ``time/time.csv``).

Expected numbers come from the closed forms below and from the bootstrap's textbook cases (a
constant, a binomial proportion, two equally likely seed values), not from the code under test.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis import bootstrap, claims, control, intervals, lr_sweep, outcomes, tradeoff
from analysis.__main__ import main
from analysis.load import load_runs, per_run

pytestmark = pytest.mark.unit

PROBLEMS = 500


def write_run(root: Path, name: str, method: str, seed: int, accs: dict[int, float], lr: float,
              task: dict | None = None, control=None, embeddings: bool = False, sync_ratio: float | None = None, steps: int | None = None) -> Path:
    """A finished run: evaluations ``{step: accuracy}`` on PROBLEMS problems (accuracies are multiples
    of 1/500), a training step between them, the config keys the loader reads."""
    run = root / "runs" / f"{name}-{zlib.crc32(name.encode()):08x}"
    run.mkdir(parents=True)
    section = {"lr": lr}
    if method == "logra":
        section |= {"dense_lr": lr / 4, "embeddings": embeddings, "rank": 64}
    cfg = {"method": method, "seed": seed, "out_dir": str(run),
           "model": {"name": "smollm2-135m-instruct", "dtype": "float32"},
           "task": {"name": "arith", "seed": 0, "digits": 2, **(task or {})}, "rollout": {"engine": "shared"},
           "train": {"steps": steps or max(accs)}, "eval": {"every": 15, "size": PROBLEMS},
           "step_control": {"enabled": control, "target_kl": 0.01}, method: section}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "meta.json").write_text(json.dumps({"git_sha": "f" * 40}))
    (run / "done.json").write_text(json.dumps({"steps": max(accs)}))
    lines = []
    for step in range(max(accs) + 1):
        row = {"step": step}
        if step:
            row["reward/mean"] = 0.5
            if sync_ratio is not None:
                row |= {"sync/bytes": sync_ratio * 1000.0, "sync/full_bytes": 1000.0, "sync/resyncs": 0.0}
        if step in accs:
            row |= {"eval/accuracy": accs[step], "eval/num_problems": float(PROBLEMS)}
        lines.append(json.dumps(row) + "\n")
    (run / "metrics.jsonl").write_text("".join(lines))
    return run


def write_outcomes(run: Path, step: int, solved: set[int], order: str) -> None:
    """An ``eval_outcomes.jsonl`` line (the trainer's layout, experiments/rl/run_dir.py): problems
    ``arith/test/<i>``, i < PROBLEMS, in an order shuffled by ``order``, those in ``solved`` correct."""
    ids = list(range(PROBLEMS))
    random.Random(order).shuffle(ids)
    line = {"step": step, "problem_ids": [f"arith/test/{i}" for i in ids], "correct": "".join(str(int(i in solved)) for i in ids)}
    with open(run / "eval_outcomes.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


# ---- the bootstrap ---------------------------------------------------------------------------------
def test_bootstrap_of_a_constant_is_the_constant():
    for k in (0, PROBLEMS):  # every problem wrong / right in every seed: every replicate is the same
        mean, reps = bootstrap.mean_interval([k, k, k], [PROBLEMS] * 3, key="c")
        assert (mean.estimate, mean.low, mean.high) == (k / PROBLEMS,) * 3
        assert np.all(reps == k / PROBLEMS)


def test_bootstrap_of_one_run_is_the_binomial_interval():
    # one seed, 250/500: the problem stage alone, 0.5 ± 1.96·√(0.25/500) = 0.5 ± 0.0438
    mean, _ = bootstrap.mean_interval([250], [PROBLEMS], key="one")
    half = 1.96 * math.sqrt(0.25 / PROBLEMS)
    assert mean.estimate == 0.5
    assert mean.low == pytest.approx(0.5 - half, abs=0.004) and mean.high == pytest.approx(0.5 + half, abs=0.004)


def test_bootstrap_resamples_the_seeds():
    # two seeds at 0.4 and 0.6 with problems so many that their noise vanishes: a replicate's mean of two
    # seeds drawn with replacement is 0.4, 0.5 or 0.6 with probability 1/4, 1/2, 1/4 -> interval [0.4, 0.6]
    n = 10**8
    mean, reps = bootstrap.mean_interval([0.4 * n, 0.6 * n], [n, n], key="seeds")
    assert mean.estimate == pytest.approx(0.5)
    assert mean.low == pytest.approx(0.4, abs=1e-3) and mean.high == pytest.approx(0.6, abs=1e-3)
    assert np.mean(np.isclose(reps, 0.5, atol=1e-3)) == pytest.approx(0.5, abs=0.02)


def test_bootstrap_is_reproducible_per_cell():
    a1 = bootstrap.mean_interval([300, 310], [PROBLEMS] * 2, key="arith|logra")
    a2 = bootstrap.mean_interval([300, 310], [PROBLEMS] * 2, key="arith|logra")
    b = bootstrap.mean_interval([300, 310], [PROBLEMS] * 2, key="arith|dense")
    assert a1[0] == a2[0] and np.array_equal(a1[1], a2[1])
    assert not np.array_equal(a1[1], b[1])  # another cell, another generator


def test_difference_has_the_sign_of_a_minus_b():
    better = bootstrap.mean_interval([400, 405, 395], [PROBLEMS] * 3, key="a")  # 0.80
    worse = bootstrap.mean_interval([300, 305, 295], [PROBLEMS] * 3, key="b")  # 0.60
    up = bootstrap.difference_interval(better, worse)
    down = bootstrap.difference_interval(worse, better)
    assert up.estimate == pytest.approx(0.2) and down.estimate == pytest.approx(-0.2)
    assert 0.1 < up.low < 0.2 < up.high < 0.3 and -0.3 < down.low < -0.2 < down.high < -0.1


def test_bootstrap_rejects_bad_counts():
    with pytest.raises(ValueError):
        bootstrap.mean_interval([501], [PROBLEMS], key="x")
    with pytest.raises(ValueError):
        bootstrap.mean_interval([], [], key="x")


def test_verdict_reads_the_interval_against_minus_five_points():
    assert intervals.verdict(bootstrap.Interval(-0.02, -0.045, 0.01)) == "yes"
    assert intervals.verdict(bootstrap.Interval(-0.10, -0.14, -0.06)) == "no"
    assert intervals.verdict(bootstrap.Interval(-0.04, -0.08, 0.0)) == "undecided"


def test_paired_difference_of_identical_outcomes_is_exactly_zero():
    d = np.zeros((3, PROBLEMS))  # both methods solved the same problems in every seed
    assert bootstrap.paired_difference(d, key="same") == bootstrap.Interval(0.0, 0.0, 0.0)


def test_paired_difference_of_one_seed_is_the_disagreement_interval():
    # one seed, a misses 50 problems b solves and agrees on the rest: Δ = −0.1, and a replicate's Δ is
    # −(draws among those 50)/500 ~ −Binomial(500, 0.1)/500 -> −0.1 ± 1.96·√(0.1·0.9/500) = −0.1 ± 0.0263
    d = np.zeros((1, PROBLEMS))
    d[0, :50] = -1
    delta = bootstrap.paired_difference(d, key="one")
    half = 1.96 * math.sqrt(0.1 * 0.9 / PROBLEMS)
    assert delta.estimate == pytest.approx(-0.1)
    assert delta.low == pytest.approx(-0.1 - half, abs=0.004) and delta.high == pytest.approx(-0.1 + half, abs=0.004)


def test_paired_difference_resamples_the_seeds_and_the_problems_once():
    # seed 0: a is 0.2 ahead, seed 1: 0.2 behind, on disjoint problems; with both stages the replicates'
    # mean is 0 (±) and their spread at least the seeds' alone (Δ ∈ {−0.2, 0, 0.2} w.p. 1/4, 1/2, 1/4)
    d = np.zeros((2, PROBLEMS))
    d[0, :100], d[1, 100:200] = 1, -1
    delta = bootstrap.paired_difference(d, key="two")
    assert delta.estimate == 0.0 and delta.low < -0.18 and delta.high > 0.18
    assert bootstrap.paired_difference(d, key="two") == delta  # seeded: the same interval again
    with pytest.raises(ValueError):
        bootstrap.paired_difference(np.full((1, 3), 2.0), key="x")  # not a difference of 0/1 outcomes


def test_outcomes_pair_by_seed_and_problem_id():
    a = [outcomes.RunOutcomes(1, "a1", {"p2": 1, "p1": 0}), outcomes.RunOutcomes(0, "a0", {"p1": 1, "p2": 1})]
    b = [outcomes.RunOutcomes(0, "b0", {"p2": 0, "p1": 1}), outcomes.RunOutcomes(1, "b1", {"p1": 1, "p2": 1})]
    d, why = outcomes.pair(a, b)
    assert why == "" and d.tolist() == [[0, 1], [-1, 0]]  # rows: seeds 0, 1; columns: p1, p2
    assert outcomes.pair(a, b[:1])[0] is None  # seed 1 has no partner
    other = [b[0], outcomes.RunOutcomes(1, "b1", {"p1": 1, "p3": 1})]
    assert "different problems" in outcomes.pair(a, other)[1]


# ---- the learning-rate sweep -----------------------------------------------------------------------
# final accuracy per (family, lr); mid = final − 0.1 except where a tie is broken by mid
LR_FINAL = {("dense", 5e-6): 0.600, ("dense", 1e-5): 0.770, ("dense", 2e-5): 0.700, ("dense", 4e-5): 0.100,
            ("logra", 1e-5): 0.500, ("logra", 2e-5): 0.700, ("logra", 4e-5): 0.750, ("logra", 8e-5): 0.750,
            ("nokl", 1e-5): 0.600, ("nokl", 2e-5): 0.740, ("nokl", 4e-5): 0.670, ("nokl", 8e-5): 0.300}
LR_MID = {("logra", 4e-5): 0.600, ("logra", 8e-5): 0.640}  # the tie at 0.750: 8e-5's higher mid wins
BEST = {"dense": 1e-5, "logra": 8e-5, "logra step_control.enabled=False": 2e-5}


def make_lr_root(root: Path) -> Path:
    for (family, lr), final in LR_FINAL.items():
        method = "dense" if family == "dense" else "logra"
        mid = LR_MID.get((family, lr), final - 0.1)
        write_run(root, f"{family}-lr{lr:g}-s0", method, 0, {0: 0.106, 15: mid, 30: final}, lr,
                  control=False if family == "nokl" else None)
    return root


@pytest.fixture(scope="module")
def lr_root(tmp_path_factory):
    return make_lr_root(tmp_path_factory.mktemp("lr"))


def test_step_control_off_is_its_own_variant_and_family(lr_root):
    configs = per_run(load_runs(lr_root))
    # step_control.enabled null (the method's default: on) vs false: two logra variants per rate, not one
    assert configs["variant"].nunique() == 12
    assert set(configs["family"]) == set(BEST)


def test_lr_table_marks_the_best_rate(lr_root):
    data = lr_sweep.table(load_runs(lr_root)).data
    assert len(data) == 12
    for r in data.itertuples():
        key = ("dense" if r.family == "dense" else "logra" if r.family == "logra" else "nokl", r.lr)
        assert r.end_mean == pytest.approx(LR_FINAL[key])
        assert r.mid_mean == pytest.approx(LR_MID.get(key, LR_FINAL[key] - 0.1)) and r.mid_step == 15
        assert r.best == (r.lr == pytest.approx(BEST[r.family]))
    assert data.groupby("family")["best"].sum().eq(1).all()
    line = lr_sweep.headline(load_runs(lr_root))[0]
    assert "dense 1e-05 (77.0 %)" in line and "logra 8e-05 (75.0 %)" in line
    assert "logra step_control.enabled=False 2e-05 (74.0 %)" in line


def test_lr_table_needs_two_rates(tmp_path):
    write_run(tmp_path, "dense-s0", "dense", 0, {0: 0.1, 30: 0.7}, 1e-5)
    with pytest.raises(lr_sweep.Absent):
        lr_sweep.table(load_runs(tmp_path))


def test_unfinished_runs_are_named(tmp_path):
    write_run(tmp_path, "dense-lr1e-5-s0", "dense", 0, {0: 0.1, 30: 0.7}, 1e-5)
    (write_run(tmp_path, "dense-lr2e-5-s0", "dense", 0, {0: 0.1, 15: 0.5}, 2e-5, steps=30) / "done.json").unlink()
    notes = lr_sweep.table(load_runs(tmp_path)).notes
    assert "1 of 2 runs not finished (no done.json): their final accuracy is their last evaluation so far" in notes


def test_cli_renders_the_lr_sweep_and_its_summary_line(lr_root, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(lr_root), "--out", str(out)]) == 0
    md = (out / "tables" / "lr_sweep.md").read_text()
    assert "| arith | dense | 1e-05 | 1 | 10.6 | 67.0 | 77.0 | best |" in md
    assert "| arith | dense | 4e-05 | 1 | 10.6 | 0.0 | 10.0 |  |" in md
    assert (out / "figures" / "lr_sweep.png").stat().st_size > 10_000
    summary = (out / "tables" / "summary.md").read_text()
    assert "best learning rate on arith (final accuracy): dense 1e-05 (77.0 %)" in summary


# ---- the reproduction ------------------------------------------------------------------------------
SEEDS = (0, 1, 2)
# final correct answers (of 500) per seed: logra_emb 20 points below dense (a clear "no"), logra equal
CPU_FINAL = {("arith", "dense"): (380, 385, 390), ("arith", "logra"): (378, 386, 391),
             ("arith", "nokl"): (360, 370, 380), ("arith", "emb"): (280, 285, 290),
             ("digits3", "dense"): (200, 210, 220), ("digits3", "logra"): (190, 200, 210)}
STEP_PEAK_MIB = {"dense": 2000, "logra": 1200, "logra:logra.embeddings=true": 960}


def make_cpu_root(root: Path, memory_csv: bool = True, time_csv: bool = True, eval_outcomes: bool = False,
                  final: dict | None = None) -> Path:
    """The reproduction's root (``final``: correct answers per cell and seed, CPU_FINAL by default).
    ``eval_outcomes``: each run also logs its per-problem outcomes (step 0: none solved; the final
    step: the first k of a ranking of the problems drawn per task setting and seed — shared by the
    methods, so who solves what is strongly correlated between them, as on a real task)."""
    for (setting, kind), counts in (final or CPU_FINAL).items():
        method = "dense" if kind == "dense" else "logra"
        lr = {"dense": 1e-5, "logra": 4e-5, "nokl": 2e-5, "emb": 4e-5}[kind]
        for seed, k in zip(SEEDS, counts):
            name = f"{setting}-{kind}-s{seed}"
            run = write_run(root, name, method, seed, {0: 0.05, 15: 0.4, 30: k / PROBLEMS}, lr,
                            task={"digits": 3} if setting == "digits3" else None, control=False if kind == "nokl" else None,
                            embeddings=kind == "emb", sync_ratio=0.25 if method == "logra" else 1.0)
            if eval_outcomes:
                ranking = list(range(PROBLEMS))
                random.Random(f"{setting}/{seed}").shuffle(ranking)
                write_outcomes(run, 0, set(), order=name)  # each run its own problem order: paired by id
                write_outcomes(run, 30, set(ranking[:k]), order=name)
    if memory_csv:
        (root / "memory").mkdir()
        rows = ["method,model,peak_bytes,params_bytes,grads_bytes,optimizer_bytes,activations_bytes,peak_rss_bytes,"
                "planner_bytes,git_sha"]
        rows += [f"{m},smollm2-135m-instruct,{mib * 2**20},1,1,1,1,1,1,{'a' * 40}" for m, mib in STEP_PEAK_MIB.items()]
        (root / "memory" / "memory.csv").write_text("\n".join(rows) + "\n")
    if time_csv:
        (root / "time").mkdir()
        rows = ["method,model,device,phase,median_s,x_dense,repeats,git_sha"]  # time_table's layout
        for method, step_s in (("dense", 10.0), ("logra:step_control.enabled=true", 14.7)):
            phases = {"rollout": 5.0, "old_logprobs": 0.0, "fwd_bwd": 4.0, "optimizer": 1.0,
                      "kl_predict": step_s - 10.0, "sync": 0.0, "step": step_s}
            rows += [f"{method},smollm2-135m-instruct,cpu,{p},{v},{v / d if d else 'nan'},3,bbbbbbb"
                     for (p, v), d in zip(phases.items(), [5.0, 0.0, 4.0, 1.0, 0.0, 0.0, 10.0])]
        (root / "time" / "time.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture(scope="module")
def cpu_root(tmp_path_factory):
    return make_cpu_root(tmp_path_factory.mktemp("cpu"))


@pytest.fixture(scope="module")
def cpu_runs(cpu_root):
    return load_runs(cpu_root)


def variant_of(runs, setting, kind):
    name = f"{setting}-{kind}-s0"
    return runs[runs["run"].str.startswith(f"runs/{name}-")]["variant"].iloc[0]


def test_interval_table_matches_the_counts(cpu_runs):
    """Without per-problem outcomes a cell's interval is the per-seed accuracies' t-interval with a
    binomial problem term: mean ± t_2(0.975) · √(s²/3 + p̄(1 − p̄)/500), t_2(0.975) = 4.302653 (any t
    table); Δ's unpaired interval combines two: ± 4.302653 · √(V_a + V_b)."""
    t2 = 4.302653
    data = intervals.table(cpu_runs).data

    def variance(counts):
        accs = [k / PROBLEMS for k in counts]
        return statistics.variance(accs) / 3 + statistics.mean(accs) * (1 - statistics.mean(accs)) / PROBLEMS

    for (setting, kind), counts in CPU_FINAL.items():
        task = "arith digits=3" if setting == "digits3" else "arith digits=2"
        r = data[(data["task_label"] == task) & (data["variant"] == variant_of(cpu_runs, setting, kind))].iloc[0]
        accs = [k / PROBLEMS for k in counts]
        dense = statistics.mean(k / PROBLEMS for k in CPU_FINAL[(setting, "dense")])
        assert r.seeds == 3 and r.end_mean == pytest.approx(statistics.mean(accs))
        assert r.end_std == pytest.approx(statistics.stdev(accs))
        half = t2 * math.sqrt(variance(counts))
        assert (r.ci_low, r.ci_high) == pytest.approx((r.end_mean - half, r.end_mean + half), abs=1e-6)
        if kind == "dense":
            assert math.isnan(r.delta) and r.verdict == ""
            continue
        assert r.delta == pytest.approx(statistics.mean(accs) - dense)
        half = t2 * math.sqrt(variance(counts) + variance(CPU_FINAL[(setting, "dense")]))
        assert (r.delta_low, r.delta_high) == pytest.approx((r.delta - half, r.delta + half), abs=1e-6)
    emb = data[data["variant"] == variant_of(cpu_runs, "arith", "emb")].iloc[0]
    logra = data[(data["variant"] == variant_of(cpu_runs, "arith", "logra")) & (data["task_label"] == "arith digits=2")].iloc[0]
    assert emb.delta_high < -0.05 and emb.verdict == "no"  # 20 points below
    assert logra.verdict == "undecided"  # equal means, but unpaired over 3 seeds the interval reaches past −5 pp


def _row(data, runs, setting, kind):
    task = "arith digits=3" if setting == "digits3" else "arith digits=2"
    return data[(data["task_label"] == task) & (data["variant"] == variant_of(runs, setting, kind))].iloc[0]


def test_without_outcomes_the_interval_is_unpaired_and_says_so(cpu_runs):
    table = intervals.table(cpu_runs)
    others = table.data[table.data["pairing"] != ""]
    assert len(others) == 4 and others["pairing"].str.startswith("unpaired: ").all()
    assert "no eval_outcomes.jsonl line for its final evaluation (step 30)" in others["pairing"].iloc[0]
    assert any(n.startswith("Δ's 95 % interval: unpaired") for n in table.notes)


@pytest.fixture(scope="module")
def paired_runs(tmp_path_factory):
    return load_runs(make_cpu_root(tmp_path_factory.mktemp("paired"), eval_outcomes=True))


def test_paired_interval_is_narrower_on_correlated_outcomes(cpu_runs, paired_runs):
    """The same counts as the unpaired root, now with outcomes where both methods solve mostly the same
    problems: the same Δ, every interval paired and narrower — logra's (Δ of −2, +1, +1 problems per
    seed) to a fraction, deciding "yes" where the unpaired one could not."""
    unpaired, table = intervals.table(cpu_runs).data, intervals.table(paired_runs)
    assert any(n.startswith("Δ's 95 % interval: paired:") for n in table.notes)
    for (setting, kind) in CPU_FINAL:
        if kind == "dense":
            continue
        u, p = _row(unpaired, cpu_runs, setting, kind), _row(table.data, paired_runs, setting, kind)
        assert p.pairing == "paired" and p.delta == pytest.approx(u.delta)
        assert p.delta_low <= p.delta <= p.delta_high
        assert p.delta_high - p.delta_low < u.delta_high - u.delta_low
    u, p = _row(unpaired, cpu_runs, "arith", "logra"), _row(table.data, paired_runs, "arith", "logra")
    assert p.delta_high - p.delta_low < 0.3 * (u.delta_high - u.delta_low)
    assert _row(table.data, paired_runs, "arith", "emb").verdict == "no" and p.verdict == "yes"
    again = intervals.table(paired_runs).data
    assert again[["delta_low", "delta_high"]].equals(table.data[["delta_low", "delta_high"]])  # seeded


def test_identical_outcomes_give_a_zero_difference_interval(tmp_path):
    same = {("arith", "dense"): (380, 385, 390), ("arith", "logra"): (380, 385, 390)}
    runs = load_runs(make_cpu_root(tmp_path, memory_csv=False, time_csv=False, eval_outcomes=True, final=same))
    data = intervals.table(runs).data
    r = data[data["variant"] == "logra"].iloc[0]  # the only task and logra variant: no keys in their names
    assert r.pairing == "paired" and (r.delta, r.delta_low, r.delta_high) == (0.0, 0.0, 0.0)


def test_control_table_pairs_a_variant_with_its_uncontrolled_twin(tmp_path):
    """logra with control (390/395/400 of 500) against the same config with step_control.enabled=false
    (370/375/380): Δ = +4 points, paired; the sketched-embedding variant (another config) and dense have
    no twin, so one row only."""
    final = {"dense": (380, 385, 390), "logra": (390, 395, 400), "nokl": (370, 375, 380), "emb": (300, 305, 310)}
    for kind, counts in final.items():
        for seed, k in zip(SEEDS, counts):
            name = f"arith-{kind}-s{seed}"
            run = write_run(tmp_path, name, "dense" if kind == "dense" else "logra", seed, {0: 0.05, 30: k / PROBLEMS},
                            1e-5 if kind == "dense" else 2e-5, control=False if kind == "nokl" else None,
                            embeddings=kind == "emb")
            ranking = list(range(PROBLEMS))
            random.Random(f"arith/{seed}").shuffle(ranking)
            write_outcomes(run, 30, set(ranking[:k]), order=name)
    runs = load_runs(tmp_path)
    table = control.table(runs)
    assert len(table.data) == 1
    r = table.data.iloc[0]
    assert (r.variant, r.without) == (variant_of(runs, "arith", "logra"), variant_of(runs, "arith", "nokl"))
    assert r.pairing == "paired" and r.seeds == 3
    assert r.delta == pytest.approx(0.04) and r.delta_low < 0.04 < r.delta_high
    assert r.with_mean == pytest.approx(0.79) and r.without_mean == pytest.approx(0.75)
    assert "| +4.0 |" in table.markdown()


def test_control_table_is_absent_without_an_uncontrolled_run(tmp_path):
    write_run(tmp_path, "arith-logra-s0", "logra", 0, {0: 0.05, 30: 0.7}, 2e-5)
    with pytest.raises(control.Absent, match="step_control.enabled=false"):
        control.table(load_runs(tmp_path))


def test_paired_falls_back_to_unpaired_for_a_cell_missing_outcomes(tmp_path):
    root = make_cpu_root(tmp_path, memory_csv=False, time_csv=False, eval_outcomes=True)
    runs = load_runs(root)
    gone = Path(runs[runs["run"].str.startswith("runs/arith-nokl-s1-")]["run_dir"].iloc[0]) / "eval_outcomes.jsonl"
    gone.unlink()
    wrong = Path(runs[runs["run"].str.startswith("runs/arith-emb-s2-")]["run_dir"].iloc[0]) / "eval_outcomes.jsonl"
    lines = wrong.read_text().splitlines()
    last = json.loads(lines[-1]) | {"correct": "1" * PROBLEMS}  # disagrees with its metrics' 290 of 500
    wrong.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    table = intervals.table(runs)
    nokl, emb = _row(table.data, runs, "arith", "nokl"), _row(table.data, runs, "arith", "emb")
    assert nokl.pairing.startswith("unpaired: runs/arith-nokl-s1-") and "no eval_outcomes.jsonl line" in nokl.pairing
    assert emb.pairing.startswith("unpaired: runs/arith-emb-s2-") and "500 of 500 correct, its metrics 290 of 500" in emb.pairing
    assert _row(table.data, runs, "arith", "logra").pairing == "paired"
    note = next(n for n in table.notes if n.startswith("Δ's 95 % interval"))
    assert "paired: the crossed t-interval" in note and "for arith digits=2 logra" in note and "the others unpaired" in note


def test_memory_accuracy_points_pair_each_variant_with_its_memory_row(cpu_root, cpu_runs):
    from analysis.load import load_memory_csv

    data, source = tradeoff.points(load_memory_csv(cpu_root), cpu_runs)
    assert source == "memory/memory.csv"
    x = {(r.task_label, r.variant): r.x_dense for r in data.itertuples()}
    assert x[("arith digits=2", variant_of(cpu_runs, "arith", "dense"))] == pytest.approx(1.0)
    assert x[("arith digits=2", variant_of(cpu_runs, "arith", "logra"))] == pytest.approx(0.6)
    assert x[("arith digits=2", variant_of(cpu_runs, "arith", "nokl"))] == pytest.approx(0.6)  # plain logra row
    assert x[("arith digits=2", variant_of(cpu_runs, "arith", "emb"))] == pytest.approx(0.48)  # the embeddings row


def test_claims_table_rows_and_sources(cpu_root, cpu_runs, monkeypatch, tmp_path):
    monkeypatch.setattr(claims, "REPO", tmp_path)  # no fallback to the committed results/
    data = claims.table(cpu_root, cpu_runs).data
    assert list(data["claim"].str.split(":").str[0]) == (
        ["peak memory of one training step, logra / dense"] + ["equal accuracy"] * 4
        + ["step time", "weight sync"])
    assert data["measured"].iloc[0] == "0.600 (logra); 0.480 (logra:logra.embeddings=true)"
    emb = data[data["claim"].str.contains("embeddings=True")].iloc[0]
    assert emb["measured"].startswith("-20.0 pp, 95 % interval [") and emb["measured"].endswith("≥ −5 pp: no")
    assert data["measured"].iloc[5] == "1.47 (logra:step_control.enabled=true)"
    assert data["measured"].iloc[6].startswith("0.250 (")
    assert data["results"].iloc[0].endswith("memory") and data["results"].iloc[5].endswith("time")


def test_claims_fall_back_to_the_committed_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "REPO", tmp_path / "nowhere")
    root = make_cpu_root(tmp_path / "results" / "cpu", memory_csv=False, time_csv=False)
    make_cpu_root(tmp_path / "elsewhere")  # its memory/ and time/ moved where the claims look next
    (tmp_path / "elsewhere" / "memory").rename(tmp_path / "results" / "memory_table")
    (tmp_path / "elsewhere" / "time").rename(tmp_path / "results" / "time_table")
    data = claims.table(root, load_runs(root)).data
    assert data["results"].iloc[0].endswith("results/memory_table") and data["measured"].iloc[0].startswith("0.600 (logra)")
    assert data["results"].iloc[5].endswith("results/time_table") and data["measured"].iloc[5].startswith("1.47")


def test_claims_say_not_run_when_inputs_are_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "REPO", tmp_path / "nowhere")
    root = tmp_path / "bare"
    write_run(root, "dense-s0", "dense", 0, {0: 0.1, 30: 0.7}, 1e-5)
    data = claims.table(root, load_runs(root)).data
    assert (data["measured"] == claims.NOT_RUN).all() and len(data) == 4
    assert claims.headline(load_runs(root)) == []  # no logra run: no accuracy line
    write_run(root, "dense-lr2e-5-s0", "dense", 0, {0: 0.1, 30: 0.6}, 2e-5)  # an lr sweep of dense alone
    assert claims.headline(load_runs(root)) == []


def test_cli_renders_the_reproduction(cpu_root, tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "REPO", tmp_path)
    out = tmp_path / "out"
    assert main([str(cpu_root), "--out", str(out)]) == 0
    for name in ("accuracy_intervals", "claims"):
        assert (out / "tables" / f"{name}.md").exists() and (out / "tables" / f"{name}.tex").exists()
    assert (out / "figures" / "memory_accuracy.png").stat().st_size > 10_000
    assert not (out / "tables" / "lr_sweep.md").exists()  # no method at two rates within a family
    summary = (out / "tables" / "summary.md").read_text()
    assert "no worse than dense by more than 5 pp: no" in summary and "95 % interval [" in summary
