"""Sweeps and launching: grid expansion, config hashing, skip-completed, failure isolation, the local
executor with real tiny-llama runs, the slurm submission script, requeue, the profiles' plans."""

import json
import re
import signal
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from experiments import launch
from experiments.config import ConfigError, build_config
from experiments.launcher.executors import render_sbatch
from experiments.launcher.jobs import RunPreempted, TrainJob
from experiments.launcher.sweep import DONE, config_hash, flatten, identity, load_sweep
from tests.conftest import TINY

pytestmark = pytest.mark.unit

FAKE = "tests.launch_fakes:fake_train"


def write_sweep(tmp_path: Path, data: dict, name: str = "s") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def small_sweep(tmp_path, seeds=(0, 1, 2), **extra) -> str:
    return write_sweep(tmp_path, {"base": {"model": {"name": "tiny-llama"}, "train": {"steps": 1}},
                                  "grid": {"method": ["dense"], "seed": list(seeds)}, "root": str(tmp_path / "root"), **extra})


def calls(run_dir: Path) -> int:
    path = run_dir / "calls.txt"
    return len(path.read_text()) if path.exists() else 0


# ---- grid expansion ---------------------------------------------------------------------------
def test_grid_and_ablations_expand_to_the_cartesian_product(tmp_path):
    path = write_sweep(tmp_path, {
        "base": {"model": {"name": "tiny-llama"}, "train.steps": 2},
        "grid": {"method": ["dense", "logra"], "task": ["arith", "gsm8k"], "seed": [0, 1]},
        "ablations": [
            {"name": "nokl", "set": {"method": "logra", "step_control": {"enabled": False}}},
            {"name": "rank", "set": {"method": "logra"}, "grid": {"logra.rank": [8, 32]}},
        ],
    })
    runs = load_sweep(path, root=str(tmp_path / "r")).runs()
    # grid 2 x 2 x 2 = 8; nokl crossed with task x seed (method is set) = 4; rank: 2 ranks x 4 = 8
    assert len(runs) == 20
    grid = [r for r in runs if r.ablation is None]
    assert {(r.cfg.method, r.cfg.task.name, r.cfg.seed) for r in grid} == {
        (m, t, s) for m in ("dense", "logra") for t in ("arith", "gsm8k") for s in (0, 1)}
    assert all(r.cfg.train.steps == 2 and r.cfg.model.name == "tiny-llama" for r in runs)
    nokl = [r for r in runs if r.ablation == "nokl"]
    assert len(nokl) == 4 and all(r.cfg.method == "logra" and r.cfg.step_control.enabled is False for r in nokl)
    ranks = sorted(r.cfg.logra.rank for r in runs if r.ablation == "rank")
    assert ranks == [8] * 4 + [32] * 4
    names = [r.run_dir.name for r in runs]
    assert "dense-arith-s0-" in names[0] and any(n.startswith("nokl-gsm8k-s1-") for n in names)
    assert any(n.startswith("rank-arith-rank32-s0-") for n in names)
    assert len(set(names)) == 20 and all(r.run_dir.parent == tmp_path / "r" / "runs" for r in runs)
    assert all(Path(r.cfg.out_dir) == r.run_dir for r in runs)


def test_duplicate_configs_collapse_to_one_run(tmp_path):
    # the ablation repeats a grid point exactly: same hash, one run
    path = write_sweep(tmp_path, {"grid": {"method": ["dense"], "seed": [0]},
                                  "ablations": [{"name": "again", "set": {"method": "dense"}}]})
    assert len(load_sweep(path).runs()) == 1


def test_an_ablation_is_not_crossed_with_another_methods_grid_axis(tmp_path):
    # dense.lr is dense's axis: an ablation that sets method=logra runs once, named without it
    path = write_sweep(tmp_path, {"grid": {"method": ["dense"], "dense.lr": [1e-5, 2e-5], "seed": [0]},
                                  "ablations": [{"name": "lg", "set": {"method": "logra", "logra.lr": 4e-5}}]})
    runs = load_sweep(path, root=str(tmp_path / "r")).runs()
    assert [r.cfg.method for r in runs] == ["dense", "dense", "logra"]
    assert runs[2].run_dir.name.startswith("lg-s0-") and "lr" not in runs[2].run_dir.name.split("-s0-")[0][2:]
    assert sorted(r.cfg.dense.lr for r in runs[:2]) == [1e-5, 2e-5]


def test_bad_sweeps_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown sweep keys"):
        load_sweep(write_sweep(tmp_path, {"grdi": {}}))
    with pytest.raises(ConfigError, match="non-empty list"):
        load_sweep(write_sweep(tmp_path, {"grid": {"seed": 3}}))
    with pytest.raises(ConfigError, match="run 'dense'.*unknown config key"):
        load_sweep(write_sweep(tmp_path, {"base": {"train.stpes": 3}, "grid": {"method": ["dense"]}})).runs()
    with pytest.raises(ConfigError, match="not found"):
        load_sweep("no_such_sweep")


# ---- hashing ----------------------------------------------------------------------------------
def test_equal_configs_hash_equal_however_spelled(tmp_path):
    a = build_config(["model=tiny-llama", "dense.lr=1e-5", "seed=3"])
    b = build_config(["seed=3", "model.name=tiny-llama", "dense.lr=0.00001", "dense.max_grad_norm=1.0"])  # default spelled out
    (tmp_path / "c.yaml").write_text("seed: 3\nmodel: {name: tiny-llama}\ndense: {lr: 1.0e-5}\n")
    c = build_config([f"config={tmp_path / 'c.yaml'}"])
    # keys that do not change what is computed: where it lives, resume, threads, logging
    d = build_config(["model=tiny-llama", "dense.lr=1e-5", "seed=3", "out_dir=elsewhere", "resume=true", "threads=1",
                      "log.progress=false", "log.samples=0", "log.tensorboard=true", "task.data_dir=/data", "model.cache_dir=/c"])
    assert config_hash(a) == config_hash(b) == config_hash(c) == config_hash(d)
    assert len(config_hash(a)) == 8


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v * 2 + 1
    if v is None:
        return "x"
    return str(v) + "x"


def test_any_change_of_an_identity_key_changes_the_hash():
    cfg = build_config(["model=tiny-llama"])
    base = config_hash(cfg)
    keys = identity(cfg)
    assert {"method", "seed", "train.steps", "model.name", "dense.lr", "task.name", "eval.size"} <= set(keys)
    assert not {"out_dir", "resume", "threads", "log.progress", "logra.rank"} & set(keys)  # only its own method's section
    for key, value in keys.items():
        changed = OmegaConf.create(OmegaConf.to_container(cfg))
        OmegaConf.update(changed, key, _changed(value))
        assert config_hash(changed) != base, key
    # and through the real config builder, a single override moves the run to a new directory
    assert config_hash(build_config(["model=tiny-llama", "train.steps=21"])) != base


def test_changing_a_galore_default_keeps_dense_and_logra_run_keys(tmp_path, monkeypatch):
    import dataclasses

    from baselines import METHODS

    path = write_sweep(tmp_path, {"base": {"model": {"name": "tiny-llama"}, "train.steps": 1, "logra": {"rank": 8}},
                                  "grid": {"method": ["dense", "logra", "galore"], "seed": [0, 1]}})
    before = {r.name: r.run_dir for r in load_sweep(path, root=str(tmp_path / "r")).runs()}
    galore = METHODS["galore"].config_cls
    changed = dataclasses.make_dataclass("ChangedGaLoreConfig", [("scale", float, dataclasses.field(default=0.5))],
                                         bases=(galore,))
    monkeypatch.setattr(METHODS["galore"], "config_cls", changed)
    assert build_config(["method=galore"]).galore.scale == 0.5  # the default did change
    after = {r.name: r.run_dir for r in load_sweep(path, root=str(tmp_path / "r")).runs()}
    assert {k: v for k, v in after.items() if not k.startswith("galore")} == \
        {k: v for k, v in before.items() if not k.startswith("galore")}
    assert len(before) == 6
    # a run that set the changed key itself moves (its value now differs from the default)
    set_scale = ["method=galore", "galore.scale=0.25"]
    monkeypatch.setattr(METHODS["galore"], "config_cls", galore)
    key = config_hash(build_config(set_scale))
    monkeypatch.setattr(METHODS["galore"], "config_cls", changed)
    assert config_hash(build_config(set_scale)) != key


def test_a_run_config_holds_its_own_method_section_only():
    cfg = build_config(["method=logra", "logra.rank=8", "dense.lr=3e-5", "galore.scale=0.5"])
    assert "logra" in cfg and not {"dense", "galore", "galore_layerwise", "lora"} & set(cfg)
    with pytest.raises(ConfigError, match="did you mean 'galore.scale'"):  # other sections are still checked
        build_config(["method=logra", "galore.scal=0.5"])
    # a config saved when run configs held every method's section has the same key and no diff
    from experiments.config import config_diff, schema

    old = OmegaConf.merge(schema(), OmegaConf.to_container(cfg))
    assert {"dense", "galore"} <= set(old) and config_hash(old) == config_hash(cfg)
    assert config_diff(old, cfg) == set() and config_diff(old, build_config(["method=logra"])) == {"logra.rank"}


def test_sweep_run_dirs_are_stable_and_move_with_the_config(tmp_path):
    first = load_sweep(small_sweep(tmp_path)).runs()
    again = load_sweep(small_sweep(tmp_path)).runs()
    assert [r.run_dir for r in first] == [r.run_dir for r in again]
    moved = load_sweep(small_sweep(tmp_path)).runs(("train.steps=2",))
    assert not {r.run_dir for r in first} & {r.run_dir for r in moved}


# ---- skip-completed and failure isolation (debug launcher: in-process) --------------------------
def test_completed_runs_are_skipped(tmp_path, capsys):
    sweep = small_sweep(tmp_path)
    assert launch.main([f"sweep={sweep}", "launcher=debug"], train_fn=FAKE) == 0
    runs = load_sweep(sweep).runs()
    assert all(r.done and calls(r.run_dir) == 1 for r in runs)
    record = json.loads((runs[0].run_dir / DONE).read_text())
    assert record["steps"] == 1 and record["run_dir"] == str(runs[0].run_dir)
    assert launch.main([f"sweep={sweep}", "launcher=debug"], train_fn=FAKE) == 0
    assert all(calls(r.run_dir) == 1 for r in runs)  # nothing ran again
    out = capsys.readouterr().out
    assert "3 done, skipped; 0 to run" in out and "summary: 3 skipped" in out
    summary = (tmp_path / "root" / "summary.csv").read_text().splitlines()
    assert len(summary) == 4 and all(",done," in line for line in summary[1:])


def test_a_failing_run_does_not_stop_the_others_and_a_rerun_fills_the_hole(tmp_path, monkeypatch, capsys):
    sweep = small_sweep(tmp_path)
    monkeypatch.setenv("LOGRA_FAKE_FAIL", "1")
    assert launch.main([f"sweep={sweep}", "launcher=debug"], train_fn=FAKE) == 1
    runs = {r.cfg.seed: r for r in load_sweep(sweep).runs()}
    assert runs[0].done and runs[2].done and not runs[1].done  # the one after the failure ran too
    log = runs[1].run_dir / "launch_error.txt"
    assert "planned failure of seed 1" in log.read_text()
    out = capsys.readouterr().out
    assert "failed" in out and str(log) in out and "2 done, 1 failed" in out
    monkeypatch.setenv("LOGRA_FAKE_FAIL", "")
    assert launch.main([f"sweep={sweep}", "launcher=debug"], train_fn=FAKE) == 0
    assert [calls(runs[s].run_dir) for s in (0, 1, 2)] == [1, 2, 1]  # only the hole ran
    assert runs[1].done


def test_each_job_runs_with_resume_and_its_own_out_dir(tmp_path):
    run = load_sweep(small_sweep(tmp_path, seeds=(0,))).runs()[0]
    job = TrainJob(run.overrides, run.run_dir, train_fn=FAKE)
    assert job.args()[-2:] == [f"out_dir={run.run_dir}", "resume=true"]
    again = job.checkpoint()  # what submitit resubmits on timeout/preemption
    assert isinstance(again.function, TrainJob) and again.function.run_dir == run.run_dir
    assert again.function.overrides == run.overrides and again.function.attempt == 1
    assert "resume=true" in again.function.args()


def test_a_preempted_run_hands_over_to_submitits_requeue(tmp_path, monkeypatch):
    run = load_sweep(small_sweep(tmp_path, seeds=(0,))).runs()[0]
    job = TrainJob(run.overrides, run.run_dir, train_fn="tests.launch_fakes:preempted_train")
    with pytest.raises(RunPreempted):  # outside submitit: reported, nothing requeued
        job()
    seen = []

    def submitit_handler(signum, frame):  # stands in for submitit's checkpoint_and_try_requeue
        seen.append(signum)
        raise SystemExit(-1)

    from submitit.core.job_environment import JobEnvironment

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    # a trainer that raises Preempted by itself, then one that listens to SIGUSR1 and gets submitit's
    # time-limit signal forwarded: either way submitit's handler requeues, and the run is not done
    for train_fn in ("tests.launch_fakes:preempted_train", "tests.launch_fakes:listening_train"):
        seen.clear()
        job = TrainJob(run.overrides, run.run_dir, train_fn=train_fn)
        old = signal.signal(JobEnvironment._usr_sig(), submitit_handler)
        try:
            with pytest.raises(SystemExit):
                job()
        finally:
            signal.signal(JobEnvironment._usr_sig(), old)
        assert seen == [JobEnvironment._usr_sig()] and not (run.run_dir / DONE).exists(), train_fn
    assert (run.run_dir / "told.txt").exists()  # the trainer checkpointed before submitit requeued


# ---- local executor: two real tiny-llama runs in their own processes ------------------------------
@pytest.mark.integration
def test_local_executor_runs_two_tiny_llama_runs(tmp_path, capsys):
    base = dict(o.split("=", 1) for o in TINY)
    base.update({"train.steps": "2", "eval.every": "2", "task.name": "toy", "model.name": "tiny-llama", "threads": "1"})
    base.pop("task"), base.pop("model")
    sweep = write_sweep(tmp_path, {"base": {k: yaml.safe_load(v) for k, v in base.items()},
                                   "grid": {"method": ["dense", "logra"]}, "root": str(tmp_path / "root"),
                                   "launcher": {"name": "local", "max_parallel": 2}})
    assert launch.main([f"sweep={sweep}"], train_fn="tests.launch_fakes:toy_train") == 0
    runs = load_sweep(sweep).runs()
    for run in runs:
        assert run.done, run.run_dir
        lines = [json.loads(l) for l in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(l["step"] for l in lines) == 2
        assert OmegaConf.load(run.run_dir / "config.yaml").method == run.cfg.method
        assert list((run.run_dir / "submitit").glob("*_log.out"))  # per-run logs in the run dir
    out = capsys.readouterr().out
    assert out.count("[     done]") == 2
    assert launch.main([f"sweep={sweep}"], train_fn="tests.launch_fakes:toy_train") == 0
    assert "2 done, skipped; 0 to run" in capsys.readouterr().out


@pytest.mark.integration
def test_local_executor_reports_a_failing_process_with_its_log(tmp_path, monkeypatch, capsys):
    sweep = small_sweep(tmp_path, seeds=(0, 1), launcher={"name": "local", "max_parallel": 2})
    monkeypatch.setenv("LOGRA_FAKE_FAIL", "0")  # inherited by the job processes
    assert launch.main([f"sweep={sweep}"], train_fn=FAKE) == 1
    runs = {r.cfg.seed: r for r in load_sweep(sweep).runs()}
    assert runs[1].done and not runs[0].done
    out = capsys.readouterr().out
    err_logs = list((runs[0].run_dir / "submitit").glob("*_log.err"))
    assert err_logs and "planned failure of seed 0" in err_logs[0].read_text()
    assert str(err_logs[0]) in out


# ---- slurm: the submission script, rendered without a cluster ----------------------------------
def test_slurm_submission_script_is_rendered_for_a_sample_config(tmp_path):
    launcher = {"name": "slurm", "partition": "gpu", "account": "proj42", "gpus_per_node": 8, "cpus_per_task": 64,
                "timeout_min": 120, "nodes": 1, "mem_gb": 500}
    run = load_sweep(small_sweep(tmp_path, seeds=(0,), launcher=launcher)).runs()[0]
    script = render_sbatch(run, launcher)
    for line in ["#SBATCH --partition=gpu", "#SBATCH --account=proj42", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=64", "#SBATCH --time=120", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --job-name={run.label}", "#SBATCH --signal=USR2@", "#SBATCH --mem=500GB"]:
        assert line in script, line
    assert "-m submitit.core._submit" in script and str(tmp_path / "root" / "submitit" / "%j") in script  # the array's folder


@pytest.mark.integration  # slow for the unit tier (see --durations)
def test_paper_profile_dry_run_lists_its_jobs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a dry run must not download anything
    assert launch.main(["sweep=paper", f"root={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    n = 3 * 2 * 2 * 3 + 2 * 2 * 2 * 3 + 3 * 2 * 3  # grid (model x method x task x seed) + galore/lora + logra-nokl
    assert f"paper.yaml): {n} runs, 0 done, {n} to run; launcher slurm" in out
    assert out.count("[         new]") == n and out.count("gemma-2-27b-it-") == 2 * 2 * 3 + 2 * 3
    assert "torchrun --standalone --nproc_per_node=8 -m experiments.train" in out
    assert "#SBATCH --gpus-per-node=8" in out
    assert out.count("planned ") + out.count("memory plan unavailable") + out.count("memory plan failed") == n
    # fsdp2 with vLLM engines, step control and the chunked head, planned phase by phase with the engine as built
    assert "-m experiments.train dist.strategy=fsdp2 " in out and "train.logprob_chunk=256" in out
    plans = dict(re.findall(r"\] (\S+)\n[^\n]*\n\s+(planned peak [^\n]*)", out))
    assert len(plans) == out.count("planned ") == n
    assert all("per phase (GiB): init " in line and "; rollout engine as built " in line for line in plans.values())
    assert sum(" kl_predict " in line for line in plans.values()) == 3 * 2 * 3  # logra's grid jobs: step control on
    gemma = {run.rsplit("/", 1)[1]: line for run, line in plans.items() if "gemma-2-27b" in run}
    assert len(gemma) == 2 * 2 * 3 + 2 * 3
    assert all("DOES NOT FIT" in line.split(";")[0] for run, line in gemma.items() if run.startswith("dense-"))
    assert all(", fits;" in line for run, line in gemma.items() if run.startswith("logra-"))  # the paper's headline
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("profile", ["quick", "cpu"])
def test_profiles_resolve(profile, tmp_path):
    runs = load_sweep(profile, root=str(tmp_path)).runs()
    if profile == "cpu":
        def cell(r):
            variant = ("nokl" if r.cfg.step_control.enabled is False else
                       "emb" if r.cfg.method == "logra" and r.cfg.logra.embeddings else "")
            return (r.cfg.task.digits, r.cfg.method, variant, r.cfg[r.cfg.method].lr)
        arith = {(2, "dense", "", 1e-5), (2, "logra", "", 2e-5), (2, "logra", "nokl", 2e-5), (2, "logra", "emb", 4e-5),
                 (2, "galore", "", 8e-5), (2, "lora", "", 4e-4)}  # results/lr's best rates (cpu.yaml)
        expected = {(c, seed) for c in arith | {(3, "dense", "", 1e-5), (3, "logra", "", 2e-5)} for seed in (0, 1, 2)}
        assert sorted((cell(r), r.cfg.seed) for r in runs) == sorted(expected)  # every cell x 3 seeds, once
        assert all(r.cfg.task.name == "arith" and r.cfg.train.steps == 30 and r.cfg.train.prompts_per_step == 8
                   and r.cfg.train.group_size == 8 and r.cfg.eval.size == 500 for r in runs)
        first_hard = min(i for i, r in enumerate(runs) if r.cfg.task.digits == 3)
        assert all(r.cfg.task.digits == 2 for r in runs[:first_hard])  # a partial run finishes the arith cells first
    else:
        assert {r.cfg.method for r in runs} == {"dense", "galore", "galore_layerwise", "lora", "logra"}
        assert all(r.cfg.model.name == "smollm2-135m-instruct" and r.cfg.task.name == "arith" for r in runs)


def test_sweeps_train_into_runs_unless_told(tmp_path):
    """The default root is the git-ignored runs/<sweep>; results/<sweep> is written only by experiments.publish."""
    assert load_sweep("quick").root == Path("runs/quick")
    assert load_sweep("quick", root=str(tmp_path)).root == tmp_path
    assert all(str(r.run_dir).startswith("runs/quick/runs/") for r in load_sweep("quick").runs())


def test_flatten_mixes_nested_and_dotted_keys():
    assert flatten({"a": {"b": 1}, "c.d": 2}) == {"a.b": 1, "c.d": 2}


def test_dry_run_prints_the_planners_prediction_per_job(tmp_path, monkeypatch, capsys):
    """The contract of experiments.memory.planner.plan, stood in for by a recording fake."""
    import sys
    import types

    seen = []

    class FakePlan:
        total_bytes, capacity_bytes, fits, peak_phase, engine = 3 * 2**30, 80 * 2**30, True, "fwd_bwd", []

        def phase_bytes(self):
            return {"init": 2**30, "fwd_bwd": 3 * 2**30}

    def plan(model, method, **kw):
        seen.append((model, method, kw))
        return FakePlan()

    monkeypatch.setitem(sys.modules, "experiments.memory.planner", types.SimpleNamespace(plan=plan))
    sweep = write_sweep(tmp_path, {"base": {"model": {"name": "Org/Big-Model", "dtype": "bfloat16"}, "train": {"micro_batch_size": 2}},
                                   "grid": {"method": ["dense", "logra", "lora"]}, "root": str(tmp_path / "r"),
                                   "launcher": {"name": "slurm", "gpus_per_node": 8},
                                   "planner": {"gpu_mem_gb": 80, "seq_len": 512, "models": {"Org/Big-Model": "qwen2.5-7b"}}})
    assert launch.main([f"sweep={sweep}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("planned peak 3.0 / 80 GiB per GPU in fwd_bwd, fits; per phase (GiB): init 1.0, fwd_bwd 3.0") == 3
    assert [(m, meth) for m, meth, _ in seen] == [("qwen2.5-7b", "dense"), ("qwen2.5-7b", "logra"), ("qwen2.5-7b", "lora")]
    kw = seen[1][2]
    assert kw["gpus"] == 8 and kw["micro_batch"] == 2 and kw["seq_len"] == 512 and kw["gpu_mem_gb"] == 80
    assert kw["dtype"] == "bf16" and kw["rank"] == 64 and seen[2][2]["rank"] == 16  # logra.rank, lora.r defaults
    assert kw["step_control"] and not seen[0][2]["step_control"]  # logra's default, not dense's


def test_a_resumed_run_keeps_its_saved_values_of_keys_outside_the_hash(tmp_path):
    from experiments.config import to_yaml
    from experiments.launcher.jobs import resume_overrides

    run = load_sweep(small_sweep(tmp_path, seeds=(0,))).runs()[0]
    run.run_dir.mkdir(parents=True)
    saved = build_config(run.overrides + ["log.samples=5", "task.data_dir=/old/data", f"out_dir={run.run_dir}"])
    (run.run_dir / "config.yaml").write_text(to_yaml(saved))
    assert config_hash(saved) == run.key  # same run, spelled with other paths and logging
    keep = resume_overrides(run.run_dir, TrainJob(run.overrides, run.run_dir).args())
    assert sorted(keep) == ['log.samples=5', 'task.data_dir="/old/data"']
    assert build_config(run.overrides + keep).log.samples == 5


def test_migrate_renames_old_keyed_run_dirs_so_the_sweep_skips_them(tmp_path):
    from experiments.config import schema, to_yaml
    from experiments.launcher.migrate import migrate

    sweep = small_sweep(tmp_path, seeds=(0,))
    run = load_sweep(sweep).runs()[0]
    old_dir = run.run_dir.with_name(run.name + "-0123abcd")  # keyed by the earlier scheme
    old_dir.mkdir(parents=True)
    saved = OmegaConf.merge(schema(), OmegaConf.to_container(run.cfg))  # every method's section, as saved then
    OmegaConf.update(saved, "out_dir", str(old_dir))
    (old_dir / "config.yaml").write_text(to_yaml(saved))
    (old_dir / DONE).write_text(json.dumps({"run_dir": str(old_dir)}))
    assert not load_sweep(sweep).runs()[0].done
    assert migrate(tmp_path / "root") == [(old_dir, run.run_dir)]
    assert load_sweep(sweep).runs()[0].done and not old_dir.exists()
    assert OmegaConf.load(run.run_dir / "config.yaml").out_dir == str(run.run_dir)
    assert migrate(tmp_path / "root") == []  # idempotent


def test_a_config_saved_before_a_default_changed_keeps_what_it_ran_with():
    """step_control.predictor became secant: a logra run saved without the key ran the exact path, so
    its key is an explicit exact run's, and resuming it under the new default is a reported change;
    a dense run (control off) is untouched by step control's keys."""
    from omegaconf import OmegaConf

    from experiments.config import config_diff, run_key

    def saved(*overrides):  # a config as a run before the key existed wrote it
        data = OmegaConf.to_container(build_config(list(overrides)), resolve=True)
        del data["step_control"]["predictor"]
        return data

    old_logra = saved("method=logra")
    assert run_key(old_logra) == run_key(build_config(["method=logra", "step_control.predictor=exact"]))
    assert run_key(old_logra) != run_key(build_config(["method=logra"]))
    assert "step_control.predictor" in config_diff(old_logra, build_config(["method=logra"]))
    assert run_key(saved("method=dense")) == run_key(build_config(["method=dense"]))
    # step_control.probe_min became 12: a saved logra config without it ran with no floor
    no_floor = OmegaConf.to_container(build_config(["method=logra", "step_control.predictor=exact"]), resolve=True)
    del no_floor["step_control"]["probe_min"]
    assert run_key(no_floor) == run_key(build_config(["method=logra", "step_control.predictor=exact",
                                                      "step_control.probe_min=0"]))
    assert run_key(no_floor) != run_key(build_config(["method=logra", "step_control.predictor=exact"]))
    assert "step_control.probe_min" in config_diff(no_floor, build_config(["method=logra", "step_control.predictor=exact"]))
    # step control's settings do not change a run without it ...
    assert run_key(build_config(["method=dense", "step_control.measure_realized=true"])) == \
        run_key(build_config(["method=dense"]))
    # ... and do where it is on
    assert run_key(build_config(["method=logra", "step_control.measure_realized=true"])) != \
        run_key(build_config(["method=logra"]))
    assert run_key(build_config(["method=dense", "step_control.enabled=true", "step_control.target_kl=0.02"])) != \
        run_key(build_config(["method=dense", "step_control.enabled=true"]))


@pytest.mark.integration  # a subprocess
def test_a_signal_to_the_job_reaches_torchruns_ranks_as_sigusr1(tmp_path):
    """experiments/launcher/torchrun.py: the child starts with SIGUSR1/SIGUSR2 ignored (a signal to the whole
    process group, as SLURM sends, does not kill it), and the job's own signal is passed on as SIGUSR1 —
    again while the child runs, so a rank that listens only later still gets it."""
    import os
    import sys
    import threading
    import time

    from experiments.launcher import torchrun

    marker = tmp_path / "told"
    child = (f"import os, pathlib, signal, sys, time\n"
             f"os.killpg(0, signal.SIGUSR2)\n"  # the scheduler signals every process of the step: ignored
             f"time.sleep(3.0)\n"  # not listening yet: the first forwarded SIGUSR1 is ignored too
             f"def told(s, f):\n"
             f"    pathlib.Path({str(marker)!r}).write_text('SIGUSR1')\n"
             f"    sys.exit(143)\n"
             f"signal.signal(signal.SIGUSR1, told)\n"
             f"time.sleep(60)\n")
    old = torchrun.REFORWARD_S
    torchrun.REFORWARD_S = 0.5
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGUSR2)).start()  # submitit's signal to the job
    try:
        t0 = time.time()
        rc, told = torchrun.run([sys.executable, "-c", child], listen=signal.SIGUSR2)
    finally:
        torchrun.REFORWARD_S = old
    assert (rc, told) == (143, True) and marker.read_text() == "SIGUSR1" and time.time() - t0 < 30
