"""analysis/: tables and figures from a results root, checked against a fixture of tiny runs.

The fixture (written here, nothing committed) is a results root laid out like a sweep's: run
directories at depth two with config.yaml, meta.json and metrics.jsonl whose metrics follow the
closed forms below, plus memory/memory.csv. Every expected number is recomputed from those forms
with the statistics module, not read back through the code under test.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import zlib
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import yaml

from analysis import accuracy, kl, memory, sync
from analysis.__main__ import main
from analysis.load import find_runs, load_memory_csv, load_runs, per_run
from analysis.render import tex

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
SEEDS = (0, 1, 2)
KAPPA = 0.01
FULL = 64 * 2**20  # full-weight sync bytes
END = {("dense", "arith"): 0.70, ("logra", "arith"): 0.66, ("lora", "arith"): 0.60,
       ("dense", "gsm8k"): 0.30, ("logra", "gsm8k"): 0.31, ("lora", "gsm8k"): 0.20}
PEAK = {"dense": 3000 * 2**20, "logra": 1800 * 2**20, "lora": 1500 * 2**20}
LR = {"dense": 1e-5, "logra": 2e-5, "lora": 1e-4}


def start_acc(seed):
    return 0.10 + 0.01 * seed


def end_acc(method, task, seed, lr_scale=1.0):
    return END[(method, task)] * lr_scale + 0.02 * seed


def peak(method, step, seed):
    return PEAK[method] + step * 2**20 * (1 + seed)  # grows with the step: the peak is at the last step


def phase_times(method, step, seed):
    """Seconds per phase as the runs' timers log them; the step is their sum (+ 0.05 s of reward)."""
    t = {"rollout": 1.0 + 0.1 * seed + 0.01 * step, "fwd_bwd": 2.0 if method == "dense" else 1.5,
         "optimizer": 0.5 if method == "dense" else 0.2, "sync": 0.1, "reward": 0.05}
    if method == "logra":
        t["kl_predict"], t["kl_realized"] = 0.3, 0.4
    return {**t, "step": sum(t.values())}


def predicted(step, seed):
    return 0.004 * step + 0.001 * seed  # steps 3, 4 exceed κ and get shrunk


def write_run(root: Path, name: str, method: str, task: str, seed: int, lr: float | None = None,
              engine: str = "shared", split: bool = True, lr_scale: float = 1.0) -> Path:
    run = root / "runs" / f"{name}-{zlib.crc32(name.encode()):08x}"  # like the launcher's <name>-<hash8>
    run.mkdir(parents=True)
    cfg = {"method": method, "seed": seed, "out_dir": str(run), "model": {"name": "tiny-llama"},
           "task": {"name": task, "seed": seed}, "rollout": {"engine": engine},
           "step_control": {"enabled": None, "target_kl": KAPPA, "measure_realized": True},
           **{m: {"lr": LR[m], "rank": 8} for m in LR}}
    cfg[method]["lr"] = lr if lr is not None else LR[method]
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "meta.json").write_text(json.dumps({"git_sha": f"{seed}" * 40}))
    rows = [{"step": 0, "eval/accuracy": start_acc(seed), "eval/num_problems": 20.0}]
    for s in range(1, STEPS + 1):
        row = {"step": s, "reward/mean": END[(method, task)] * lr_scale * s / STEPS + 0.01 * seed, "mem/peak_bytes": float(peak(method, s, seed)),
               "mem/peak_rss_bytes": float(peak(method, s, seed))}
        if split:
            p = peak(method, s, seed)
            row |= {"mem/params_bytes": 0.25 * p, "mem/grads_bytes": (0.25 if method == "dense" else 0.0) * p,
                    "mem/optimizer_bytes": (0.5 if method == "dense" else 0.05) * p,
                    "mem/activations_bytes": (0.0 if method == "dense" else 0.7) * p}
        row |= {f"time/{k}_s": v for k, v in phase_times(method, s, seed).items()}
        if engine != "shared":
            row |= {"sync/full_bytes": float(FULL), "sync/resyncs": float(s == 2 and method == "logra"),
                    "sync/bytes": float(FULL if method == "dense" or s == 2 else FULL // 10)}
        if method == "logra":
            pred = predicted(s, seed)
            scale = min(1.0, math.sqrt(KAPPA / pred))
            row |= {"kl/predicted": pred, "step/scale": scale, "kl/predicted_scaled": pred * scale**2,
                    "kl/realized": 1.1 * pred * scale**2}
        if s == STEPS:
            row |= {"eval/accuracy": end_acc(method, task, seed, lr_scale), "eval/num_problems": 20.0}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


MEMORY_CSV = [  # method, peak MiB, params, grads, optimizer, activations, planner MiB
    ("dense", 2000, 500, 500, 800, 200, 2100),
    ("logra", 1100, 500, 0, 50, 550, 1050),
    ("lora", 900, 500, 0, 20, 380, None),
]


def make_fixture(root: Path) -> Path:
    for task in ("arith", "gsm8k"):
        for method in ("dense", "logra", "lora"):
            for seed in SEEDS:
                write_run(root, f"{method}-{task}-s{seed}", method, task, seed,
                          engine="hf" if method in ("dense", "logra") and task == "arith" else "shared",
                          split=method != "lora")
    # a second dense learning rate on arith (one seed, worse): the reference must stay lr 1e-5
    write_run(root, "dense-lr5e-6-arith-s0", "dense", "arith", 0, lr=5e-6, lr_scale=0.5,
              engine="hf", split=True)
    crashed = root / "runs" / "crashed"  # started, no metrics yet: skipped
    crashed.mkdir()
    (crashed / "config.yaml").write_text("method: dense\n")
    (crashed / "metrics.jsonl").write_text("")
    decoy = root / "runs" / "dense-arith-s0-decoy" / "checkpoints" / "step_2"  # never searched
    decoy.mkdir(parents=True)
    (decoy / "config.yaml").write_text("method: dense\n")
    (decoy / "metrics.jsonl").write_text('{"step": 1}\n')
    (root / "memory").mkdir()
    lines = ["method,model,peak_bytes,params_bytes,grads_bytes,optimizer_bytes,activations_bytes,peak_rss_bytes,"
             "planner_bytes,git_sha"]
    for method, *mib, planner in MEMORY_CSV:
        b = [m * 2**20 for m in mib]
        lines.append(f"{method},tiny-llama,{','.join(map(str, b))},{b[0] + 2**28},"
                     f"{'' if planner is None else planner * 2**20},{'a' * 40}")
    (root / "memory" / "memory.csv").write_text("\n".join(lines) + "\n")
    (root / "time").mkdir()  # python -m experiments.time_table's layout: one row per method and phase
    phases = ["rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync", "step"]
    rows = ["method,model,device,phase,median_s,q25_s,q75_s,min_s,max_s,repeats,x_dense,git_sha"]
    for method, secs in (("dense", [2, 0, 3, 1, 0, 0, 6]), ("logra", [2, 0, 2, 0.5, 0.5, 0, 5])):
        rows += [f"{method},tiny-llama,cpu,{p},{v},{v},{v},{v},{v},3,{v / d if d else 'nan'},{'a' * 40}"
                 for p, v, d in zip(phases, secs, [2, 0, 3, 1, 0, 0, 6])]
    (root / "time" / "time.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def runs(root):
    return load_runs(root)


def row(data, **match):
    hit = data
    for k, v in match.items():
        hit = hit[hit[k] == v]
    assert len(hit) == 1, (match, len(hit))
    return hit.iloc[0]


def test_loader_finds_every_run_and_labels_experiments(root, runs):
    assert len(find_runs(root)) == 20  # 18 + the second dense lr + the crashed one; not the checkpoint decoy
    configs = per_run(runs)
    assert len(configs) == 19  # the crashed run has no metrics
    assert len(runs) == 19 * (STEPS + 1)
    assert set(configs["variant"]) == {"dense lr=1e-05", "dense lr=5e-06", "logra", "lora"}
    assert set(configs["task_label"]) == {"arith", "gsm8k"}  # task.seed follows the seed: no task variant
    r = configs.loc[configs["run"].str.startswith("runs/logra-gsm8k-s2")].iloc[0]
    assert (r["git_sha"], r["logra.rank"], r["seed"], r["model.name"]) == ("2" * 40, 8, 2, "tiny-llama")
    assert Path(r["run_dir"]).is_dir() and not r["done"]


def test_step_control_settings_name_a_variant_only_where_step_control_ran(tmp_path):
    """A galore run saved with step_control.measure_realized true and one with false computed the same
    thing (no step control ran: no kl/predicted), so they are one variant — as their run keys are; for
    logra, which ran it, the same difference names two variants."""
    for seed, realized in ((0, True), (1, False)):
        for method in ("lora", "logra"):
            run = write_run(tmp_path, f"{method}-arith-s{seed}", method, "arith", seed)
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["step_control"]["measure_realized"] = realized
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    variants = per_run(load_runs(tmp_path)).groupby("method")["variant"].agg(set)
    assert variants["lora"] == {"lora"}
    assert variants["logra"] == {"logra measure_realized=True", "logra measure_realized=False"}


def test_accuracy_table_matches_fixture(runs):
    t = accuracy.table(runs)
    for task in ("arith", "gsm8k"):
        dense_end = statistics.mean(end_acc("dense", task, s) for s in SEEDS)
        for method, variant in (("logra", "logra"), ("lora", "lora"), ("dense", "dense lr=1e-05")):
            r = row(t.data, task_label=task, variant=variant)
            ends = [end_acc(method, task, s) for s in SEEDS]
            assert r["seeds"] == 3 and (r["start_step"], r["end_step"]) == (0, STEPS)
            assert r["start_mean"] == pytest.approx(statistics.mean(start_acc(s) for s in SEEDS))
            assert r["start_std"] == pytest.approx(statistics.stdev(start_acc(s) for s in SEEDS))
            assert r["end_mean"] == pytest.approx(statistics.mean(ends))
            assert r["end_std"] == pytest.approx(statistics.stdev(ends))  # 0.02
            assert r["delta_end"] == pytest.approx(statistics.mean(ends) - dense_end)
            assert r["reference"] == "dense lr=1e-05"  # the better of the two dense learning rates
    r = row(t.data, task_label="arith", variant="dense lr=5e-06")
    assert r["seeds"] == 1 and math.isnan(r["end_std"]) and r["delta_end"] == pytest.approx(0.35 - 0.72)
    md = t.markdown()
    # logra on arith: end 0.66, 0.68, 0.70 -> 68.0 ± 2.0 %; dense 72.0 -> −4.0 pp
    assert "| arith | logra | 3 | 4 | 11.0 ± 1.0 | 68.0 ± 2.0 | -4.0 |" in md
    assert "| arith | dense lr=5e-06 | 1 | 4 | 10.0 | 35.0 | -37.0 |" in md
    assert "| arith | dense lr=1e-05 | 3 | 4 | 11.0 ± 1.0 | 72.0 ± 2.0 | ref |" in md


def test_memory_tables_match_fixture(root, runs):
    step = memory.step_table(load_memory_csv(root))
    for method, peak_mib, *_ in MEMORY_CSV:
        r = row(step.data, method=method)
        assert r["ratio"] == pytest.approx(peak_mib / 2000)
        assert r["reduction"] == pytest.approx(1 - peak_mib / 2000)
    md = step.markdown()
    assert "| tiny-llama | logra | 1,100 | 500 | 0 | 50 | 550 | 1,356 | 1,050 | 0.55 | 45.0 % |" in md
    assert "| tiny-llama | lora | 900 | 500 | 0 | 20 | 380 | 1,156 | — | 0.45 | 55.0 % |" in md

    t = memory.runs_table(runs)
    for task in ("arith", "gsm8k"):
        dense_peak = statistics.mean(peak("dense", STEPS, s) for s in SEEDS)
        for method, variant in (("logra", "logra"), ("lora", "lora"), ("dense", "dense lr=1e-05")):
            r = row(t.data, task_label=task, variant=variant)
            peaks = [peak(method, STEPS, s) for s in SEEDS]
            assert r["peak_bytes"] == pytest.approx(statistics.mean(peaks))
            assert r["mean_peak_bytes"] == pytest.approx(statistics.mean(
                statistics.mean(peak(method, st, s) for st in range(1, STEPS + 1)) for s in SEEDS))
            assert r["ratio"] == pytest.approx(statistics.mean(peaks) / dense_peak)
            if method == "lora":  # logged no split: NaN, not zero
                assert math.isnan(r["optimizer_bytes"])
            else:
                share = 0.5 if method == "dense" else 0.05
                assert r["optimizer_bytes"] == pytest.approx(share * statistics.mean(peaks))
    assert "mean reduction over tasks: " in t.markdown()


def test_memory_runs_take_the_profilers_peak_where_the_runs_ran_it(tmp_path):
    """With log.memory_profile the step peak is the live-tensor peak (its categories sum to it), not the RSS."""
    for method in ("dense", "logra"):
        run = write_run(tmp_path, method, method, "arith", 0)
        rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        for r in rows[1:]:
            if method == "logra":
                r["mem/tensor_peak_bytes"] = 0.5 * r["mem/peak_bytes"]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = memory.runs_table(load_runs(tmp_path))
    logra, dense = row(t.data, variant="logra"), row(t.data, variant="dense")
    assert logra["peak_bytes"] == 0.5 * peak("logra", STEPS, 0) and bool(logra["profiled"])
    assert dense["peak_bytes"] == peak("dense", STEPS, 0) and not dense["profiled"]
    assert any("profiled (live tensors): logra; the others: mem/peak_bytes" in n for n in t.notes)


def test_time_runs_table_matches_fixture(runs):
    from analysis import steptime

    t = steptime.runs_table(runs)
    for task in ("arith", "gsm8k"):
        dense_variant = "dense lr=1e-05"  # the accuracy table's dense reference
        per_seed = lambda method, phase: statistics.mean(  # noqa: E731  median over steps, mean over seeds
            statistics.median(phase_times(method, st, s)[phase] for st in range(1, STEPS + 1)) for s in SEEDS)
        for method, variant in (("logra", "logra"), ("lora", "lora"), ("dense", dense_variant)):
            r = row(t.data, task_label=task, variant=variant)
            for phase in ("rollout", "fwd_bwd", "optimizer", "sync", "step"):
                assert r[phase] == pytest.approx(per_seed(method, phase)), (task, variant, phase)
            assert r["kl_predict"] == pytest.approx(0.3 if method == "logra" else 0.0)
            assert r["kl_realized"] == pytest.approx(0.4 if method == "logra" else 0.0)
            assert r["x_dense"] == pytest.approx(per_seed(method, "step") / per_seed("dense", "step"))
            assert r["train_x_dense"] == pytest.approx((2.5 if method == "dense" else 1.5 + 0.2) / 2.5)  # fwd_bwd + optimizer
    md = t.markdown()  # named as people say them; the fixture's runs predate the probe floor
    assert "| arith | LoGRA, no probe floor | 3 | 4 |" in md and "before the timers" not in md
    assert "| arith | dense AdamW, lr 1e-05 | 3 | 4 |" in md and "| arith | dense AdamW, lr 5e-06 | 1 | 4 |" in md
    assert "| gsm8k | dense AdamW | 3 | 4 |" in md  # one dense variant there: no rate to tell apart


def test_time_runs_leave_out_runs_without_timers_and_say_where_the_optimizer_holds_more(tmp_path):
    from analysis import steptime

    for seed in (0, 1):
        write_run(tmp_path, f"dense-arith-s{seed}", "dense", "arith", seed)
    logra = write_run(tmp_path, "logra-arith-s0", "logra", "arith", 0)
    strip = lambda run, drop: (run / "metrics.jsonl").write_text("".join(  # noqa: E731
        json.dumps({k: v for k, v in json.loads(line).items() if not drop(k)}) + "\n"
        for line in (run / "metrics.jsonl").read_text().splitlines()))
    strip(next((tmp_path / "runs").glob("dense-arith-s1-*")), lambda k: k.startswith("time/") and k != "time/step_s")
    strip(logra, lambda k: k == "time/kl_realized_s")  # a run from before the realized KL had its own timer
    t = steptime.runs_table(load_runs(tmp_path))
    dense = row(t.data, variant="dense")
    assert dense["seeds"] == 1 and dense["fwd_bwd"] == pytest.approx(2.0)  # seed 1's missing phases are not 0 s
    assert dense["step"] == pytest.approx(statistics.median(phase_times("dense", s, 0)["step"] for s in range(1, STEPS + 1)))
    assert "1 run(s) from before the timers are left out" in t.markdown()
    assert "count those forwards in their optimizer phase" in t.markdown()


def test_time_runs_pair_the_ratio_by_seed_while_a_sweep_s_runs_land(tmp_path):
    from analysis import steptime

    for seed in (0, 1, 2):  # dense's seed 2 landed, logra's not yet: its rollout is the slowest (0.1 s per seed)
        write_run(tmp_path, f"dense-arith-s{seed}", "dense", "arith", seed)
    for seed in (0, 1):
        write_run(tmp_path, f"logra-arith-s{seed}", "logra", "arith", seed)
    t = steptime.runs_table(load_runs(tmp_path))
    step = lambda method, seeds: statistics.mean(  # noqa: E731
        statistics.median(phase_times(method, st, s)["step"] for st in range(1, STEPS + 1)) for s in seeds)
    logra, dense = row(t.data, variant="logra"), row(t.data, variant="dense")
    assert dense["seeds"] == 3 and dense["step"] == pytest.approx(step("dense", (0, 1, 2)))  # its phases: every seed
    assert logra["x_dense"] == pytest.approx(step("logra", (0, 1)) / step("dense", (0, 1)))
    assert logra["x_dense"] != pytest.approx(step("logra", (0, 1)) / step("dense", (0, 1, 2)))
    assert logra["train_x_dense"] == pytest.approx((1.5 + 0.2) / 2.5) and dense["x_dense"] == pytest.approx(1.0)
    assert "here not every seed has both: arith LoGRA, no probe floor on 2 (it ran 2, dense 3)" in t.markdown()


def test_sync_table_matches_fixture(runs):
    t = sync.table(runs)
    assert set(t.data["variant"]) == {"dense lr=1e-05", "dense lr=5e-06", "logra"}  # lora used the shared engine
    r = row(t.data, task_label="arith", variant="logra")
    per_step = [FULL if s == 2 else FULL // 10 for s in range(1, STEPS + 1)]  # step 2: a full resync
    assert r["bytes_per_step"] == pytest.approx(statistics.mean(per_step))
    assert r["ratio"] == pytest.approx(statistics.mean(per_step) / FULL)  # (3·0.1 + 1) / 4 = 0.325
    assert (r["resyncs"], r["steps"], r["seeds"]) == (3, 3 * STEPS, 3)
    assert row(t.data, task_label="arith", variant="dense lr=1e-05")["ratio"] == pytest.approx(1.0)
    assert "| arith | logra | 3 | 12 | 20.8 | 64.0 | 64.0 | 0.325 | 3 |" in t.markdown()


def test_kl_table_matches_fixture(runs):
    t = kl.table(runs)
    assert set(t.data["variant"]) == {"logra"}
    for task in ("arith", "gsm8k"):
        r = row(t.data, task_label=task, variant="logra")
        preds = [predicted(st, s) for s in SEEDS for st in range(1, STEPS + 1)]
        scales = [min(1.0, math.sqrt(KAPPA / p)) for p in preds]
        assert r["steps"] == 12 and r["target_kl"] == KAPPA
        assert r["predicted_median"] == pytest.approx(statistics.median(preds))
        assert r["scale_median"] == pytest.approx(statistics.median(scales))
        assert r["scale_min"] == pytest.approx(min(scales))
        assert r["shrunk_frac"] == pytest.approx(sum(s < 1 for s in scales) / 12)
        assert r["ratio_median"] == pytest.approx(1.1)
        assert r["on_target_frac"] == 1.0  # every shrunk step realized 1.1 κ, within ± 25 %


def test_cli_writes_every_table_and_figure(root, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    tables = {"memory_step", "memory_runs", "time_step", "time_runs", "accuracy", "accuracy_intervals", "lr_sweep", "sync",
              "kl", "claims"}  # lr_sweep: dense ran at two rates on arith
    figures = {"memory", "memory_accuracy", "lr_sweep", "curves", "kl_scatter", "scale_trace", "sync_bytes"}
    assert {p.stem for p in (out / "tables").glob("*.md")} == tables | {"summary"}
    assert {p.stem for p in (out / "tables").glob("*.tex")} == tables
    assert {p.stem for p in (out / "figures").glob("*.png")} == figures
    for name in figures:
        png = out / "figures" / f"{name}.png"
        image = mpimg.imread(png)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300, name
        assert image[..., :3].std() > 0.05, f"{name}.png is blank"
        assert (out / "figures" / f"{name}.pdf").read_bytes().startswith(b"%PDF")
        assert f"wrote {png}" in printed
    for name in tables:
        src = (out / "tables" / f"{name}.tex").read_text()
        assert src.isascii() and r"\begin{tabular}" in src and src.count(r"\\") >= 3
        assert src.count("{") == src.count("}")
    # the tables without their input here: no variant ran both with and without step control, and no run
    # has the seed study's configuration
    skipped = [line for line in printed.splitlines() if "skipped table" in line or "skipped figure" in line]
    assert skipped == ["[analysis] skipped table control: no variant was run both with and without step control "
                       "(step_control.enabled=false)",
                       "[analysis] skipped table seed_study: no dense and logra runs of the seed study's configuration "
                       "(experiments/sweeps/cpu_seeds.yaml)"], skipped
    assert "crashed: no metrics yet" in printed
    csv = (out / "tables" / "runs.csv").read_text().splitlines()
    assert len(csv) == 1 + 19 * (STEPS + 1) and "reward/mean" in csv[0]
    time_md = (out / "tables" / "time_step.md").read_text()
    assert "| tiny-llama | logra | 2.00 | 0.00 | 2.00 | 0.50 | 0.50 | 0.00 | 5.00 | 0.83 | 0.62 | 10.0 % |" in time_md


def test_absent_data_is_skipped_not_an_error(tmp_path, capsys):
    bare = tmp_path / "bare"  # one lora run: no memory.csv, no mem/sync/kl metrics
    run = write_run(bare, "lora", "lora", "arith", 0, split=False)
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("mem/")}) + "\n"
                                               for r in lines))
    assert main([str(bare)]) == 0
    printed = capsys.readouterr().out
    for name in ("table memory_step", "table memory_runs", "table sync", "table kl", "figure memory",
                 "figure kl_scatter", "figure scale_trace", "figure sync_bytes"):
        assert f"skipped {name}: " in printed
    assert (bare / "tables" / "accuracy.md").exists() and (bare / "figures" / "curves.png").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 0
    assert "0 runs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing")])


def test_latex_escaping():
    assert tex("logra lr=2e-05 target_kl=0.01") == r"logra lr=2e-05 target\_kl=0.01"
    assert tex("68.0 ± 2.0 %") == r"68.0 $\pm$ 2.0 \%"
    assert tex("Δ end & κ") == r"$\Delta$ end \& $\kappa$"


def test_committed_notebook_is_valid_and_has_no_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.integration
def test_notebook_executes_against_the_fixture(root, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # A kernel spec naming this interpreter, so the notebook runs in the project's venv whatever
    # kernels the machine has registered.
    spec = tmp_path / "jupyter" / "kernels" / "logra-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "logra (test)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("LOGRA_RESULTS", str(root))
    monkeypatch.setenv("LOGRA_ANALYSIS_OUT", str(tmp_path / "nb_out"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    nbclient.NotebookClient(nb, kernel_name="logra-test", timeout=120, resources={"metadata": {"path": str(REPO)}}).execute()
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert '"output_type": "error"' not in text
    assert "Held-out accuracy at the start and the end of training" in text
    assert text.count("image/png") >= 5  # the five figures
    assert (tmp_path / "nb_out" / "figures" / "curves.png").exists()


@pytest.mark.integration
def test_a_real_tiny_run_reads_back_exactly(tmp_path):
    """One tiny-llama logra run through the real trainer (step control measured, an engine copy
    synced): the tables hold exactly what its metrics.jsonl says."""
    from experiments.config import build_config
    from experiments.rl.metrics import read_metrics
    from experiments.rl.trainer import GRPOTrainer
    from tests.conftest import TINY
    from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

    run_dir = tmp_path / "root" / "runs" / "logra-tiny"
    GRPOTrainer(build_config([*TINY, f"out_dir={run_dir}", "method=logra", "logra.rank=8", "logra.lr=1e-3",
                              "train.steps=2", "rollout.engine=hf", "step_control.measure_realized=true"])).train()
    rows = read_metrics(run_dir)
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    trained = [r for r in rows if r["step"] > 0]
    runs = load_runs(tmp_path / "root")
    acc = row(accuracy.table(runs).data, variant="logra")
    assert (acc["start_mean"], acc["end_mean"], acc["end_step"]) == (evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"], 2)
    s = row(sync.table(runs).data, variant="logra")
    assert s["ratio"] == pytest.approx(statistics.mean(r["sync/bytes"] for r in trained) / trained[0]["sync/full_bytes"])
    assert s["ratio"] < 1
    k = row(kl.table(runs).data, variant="logra")
    assert k["steps"] == 2
    assert k["realized_median"] == pytest.approx(statistics.median(r["kl/realized"] for r in trained))
    m = row(memory.runs_table(runs).data, variant="logra")
    assert m["peak_bytes"] == max(r["mem/peak_bytes"] for r in trained)
    from analysis import steptime

    t = row(steptime.runs_table(runs).data, variant="logra")  # the runs' own phase timers
    for phase in ("fwd_bwd", "optimizer", "kl_predict", "kl_realized", "step"):
        assert t[phase] == pytest.approx(statistics.median(r[f"time/{phase}_s"] for r in trained)) and t[phase] > 0, phase


def test_labels_keep_models_apart_and_ignore_seeds(tmp_path):
    for model in ("m-small", "m-large"):
        for method in ("dense", "logra"):
            run = write_run(tmp_path, f"{method}-{model}", method, "arith", 0)
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["model"]["name"] = model
            cfg["logra"]["seed"] = 7 if model == "m-small" else 8  # a seed key never names a variant
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    configs = per_run(load_runs(tmp_path))
    assert set(configs["task_label"]) == {"arith (m-small)", "arith (m-large)"}
    assert set(configs["variant"]) == {"dense", "logra"}
    t = accuracy.table(load_runs(tmp_path))  # each logra is compared with the dense of its own model
    assert row(t.data, task_label="arith (m-large)", variant="logra")["delta_end"] == pytest.approx(0.66 - 0.70)


def test_a_figure_s_pdf_carries_no_creation_date(tmp_path):
    import matplotlib.pyplot as plt

    from analysis.render import save_png_pdf

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_png_pdf(fig, tmp_path / "f.png")
    pdf = (tmp_path / "f.pdf").read_bytes()
    assert pdf.startswith(b"%PDF") and b"/CreationDate" not in pdf  # the same figure, the same bytes: a regenerated root shows only what changed
