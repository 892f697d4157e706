"""The launcher against a real SLURM scheduler: a single-node cluster with accounting that the session
starts itself (tests/conftest.py ``slurm_cluster``: scripts/slurm_local.sh). Tiny-llama runs, 2 cores.

- a sweep through ``python -m experiments.launch launcher=slurm``: one job array with a parallelism
  limit; every run done but one with a bad override, reported with its log while the others finish;
  a rerun submits only that one; the analysis renders the root;
- one run preempted (submitit's ``job._interrupt()``: SIGTERM then SIGUSR2, as a preempting
  scheduler sends them), then cut short by its time limit (``scontrol update TimeLimit=``: the
  scheduler's own ``--signal=USR2@90`` from the sbatch script): each time a checkpoint at the step
  boundary, a requeue and a resume; its final weights ``torch.equal`` an uninterrupted run's;
- a 2-GPU job (fake gres GPUs): torchrun with two gloo ranks of an fsdp2 logra run under the job's
  environment, preempted, requeued, resumed, ``torch.equal`` to an uninterrupted 2-rank job;
- a job that dies without a result while sacct answers nothing (a cluster without accounting):
  the launcher's wait ends with an error naming the job and its log instead of waiting forever;
- the paper profile's sbatch lines: ``--gpus-per-node=8`` reaches the job as CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import tests.toy_task  # noqa: F401  (the toy task in this process; the jobs import it through LOGRA_PLUGINS)
from experiments import launch
from experiments.launcher import slurm
from experiments.launcher.sweep import DONE, load_sweep
from experiments.rl.checkpoint import list_checkpoints
from experiments.rl.metrics import read_metrics
from experiments.rl.sharded_checkpoint import read_model_weights
from tests.conftest import REPO

pytestmark = pytest.mark.slurm

TOY = {"model": {"name": "tiny-llama"}, "task": {"name": "toy"}, "rollout": {"max_new_tokens": 8},
       "train": {"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 4}, "eval": {"size": 4, "every": 4},
       "checkpoint": {"every": 0}, "log": {"progress": False}, "threads": 1}
LOGRA = {"method": "logra", "logra": {"rank": 8, "lr": 1e-3}}
LAUNCHER = {"name": "slurm", "cpus_per_task": 1, "mem_gb": 2, "timeout_min": 20, "poll_s": 1}


@pytest.fixture(autouse=True)
def cluster(slurm_cluster, monkeypatch):
    monkeypatch.setenv("LOGRA_PLUGINS", "tests.toy_task")  # exported to the jobs by sbatch
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return slurm_cluster


def write_sweep(tmp_path: Path, base: dict, launcher: dict, **extra) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": base, "grid": {"seed": [0]}, "launcher": launcher, **extra}, sort_keys=False))
    return str(path)


def submit(sweep: str, root: Path, train_fn: str):
    """Submit a one-run sweep (the launcher returns once it is queued); its run and its job."""
    assert launch.main([f"sweep={sweep}", f"root={root}"], train_fn=train_fn) == 0
    run = load_sweep(sweep, str(root)).runs()[0]
    return run, slurm.job_of(run)


def log_of(job) -> str:
    return job.paths.stdout.read_text() if job.paths.stdout.exists() else ""


def wait_until(what: str, ready, job, timeout: float = 240.0) -> None:
    t0 = time.time()
    while not ready():
        if time.time() - t0 > timeout:
            raise AssertionError(f"no {what} within {timeout:.0f} s (job {job.job_id}: {slurm.state_of(job)})\n{log_of(job)[-3000:]}")
        if job.paths.result_pickle.exists():
            raise AssertionError(f"job {job.job_id} ended before {what}:\n{log_of(job)[-3000:]}")
        time.sleep(0.2)


def logged_step(run) -> int:
    return max((m["step"] for m in read_metrics(run.run_dir)), default=-1)


def resumed_from(job) -> list[int]:
    """The steps each requeued attempt continued from, as its log says."""
    return [int(s) for s in re.findall(r"\[resume\] continuing \S+ from step (\d+)", log_of(job))]


def comparable(run) -> list[dict]:
    """Every metric but wall-clock times and process memory."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))} for m in read_metrics(run.run_dir)]


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=30)


def test_a_sweep_is_one_array_a_failure_is_reported_and_a_rerun_runs_only_it(tmp_path, capsys):
    base = {**TOY, "train": {**TOY["train"], "steps": 2}, "eval": {"size": 4, "every": 2}}
    sweep = write_sweep(tmp_path, base, {**LAUNCHER, "max_parallel": 2, "wait": True},
                        grid={"method": ["dense", "logra"], "seed": [0]},
                        ablations=[{"name": "broken", "set": {"method": "dense", "rollout.engine": "no-such-engine"}}])
    root = tmp_path / "root"
    cmd = [sys.executable, "-m", "experiments.launch", f"sweep={sweep}", f"root={root}", "launcher=slurm"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # one run failed
    runs = {r.name: r for r in load_sweep(sweep, str(root)).runs()}
    assert sorted(n for n, r in runs.items() if r.done) == ["dense-s0", "logra-s0"]
    broken = runs["broken-s0"]
    assert "summary: 2 done, 1 failed" in first.stdout
    line = next(l for l in first.stdout.splitlines() if l.startswith("[   failed]") and broken.label in l)
    log = Path(line.split("log: ")[1])
    assert "unknown rollout.engine 'no-such-engine'" in log.read_text()  # the job's own error, in the log named

    tasks = {n: json.loads((r.run_dir / "submitted.json").read_text())["job_id"] for n, r in runs.items()}
    array = {t.split("_")[0] for t in tasks.values()}
    assert len(array) == 1 and sorted(t.split("_")[1] for t in tasks.values()) == ["0", "1", "2"]  # one array
    script = (root / "submitit" / array.pop() / f"{tasks['dense-s0'].split('_')[0]}_submission.sh").read_text()
    assert "#SBATCH --array=0-2%2" in script  # at most 2 tasks at once
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", tasks["dense-s0"].split("_")[0], "-o", "JobID,Start,End"],
                           capture_output=True, text=True, check=True).stdout.split()
    spans = [(s, e) for _, s, e in (row.split("|") for row in sacct)]
    assert len(spans) == 3 and all(sum(s <= t < e for s, e in spans) <= 2 for t, _ in spans)  # never 3 running

    finished = {n: (runs[n].run_dir / DONE).read_text() for n in ("dense-s0", "logra-s0")}
    capsys.readouterr()
    assert launch.main(cmd[3:]) == 1  # the same command again (in this process)
    again = capsys.readouterr().out
    assert "3 runs (2 done, skipped; 1 to run)" in again and "summary: 1 failed, 2 skipped" in again, again[-3000:]
    assert {n: (runs[n].run_dir / DONE).read_text() for n in finished} == finished  # not run again

    from analysis.report import build

    build(root, log=lambda line: None)  # python -m analysis <root>
    table = (root / "tables" / "accuracy.md").read_text()
    assert "| dense " in table and "| logra " in table


def test_preemption_then_the_time_limit_each_resume_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    """Attempt 0 is preempted after step 2; attempt 1 (paced: 3 s of sleep per step, so that it is
    still running when slurmctld's 30-second time-limit check comes) gets a 2-minute limit, hence the
    sbatch script's SIGUSR2 at the next check; attempt 2 gets its limit back and finishes."""
    base = {**TOY, **LOGRA, "train": {**TOY["train"], "steps": 16}}
    sweep = write_sweep(tmp_path, base, {**LAUNCHER, "max_num_timeout": 5})
    monkeypatch.setenv("LOGRA_STEP_PAUSE", "3")
    monkeypatch.setenv("LOGRA_PACED_ATTEMPT", "1")
    ref, ref_job = submit(sweep, tmp_path / "ref", "tests.launch_fakes:toy_train")
    cut, job = submit(sweep, tmp_path / "cut", "tests.launch_fakes:paced_train")
    t0 = time.time()

    wait_until("step 2", lambda: logged_step(cut) >= 2, job)
    job._interrupt()  # preemption: SIGTERM, then SIGUSR2
    wait_until("a resumed attempt", lambda: len(resumed_from(job)) == 1 and logged_step(cut) > resumed_from(job)[0], job)
    scontrol("update", f"JobId={job.job_id}", "TimeLimit=2")  # from now on, less than signal_delay_s (90 s) is left
    wait_until("the time limit's requeue", lambda: slurm.squeue_state(job.job_id) in ("PENDING", "REQUEUED"), job, timeout=120)
    scontrol("update", f"JobId={job.job_id}", "TimeLimit=20")

    outcomes = slurm.wait([(cut, job, t0), (ref, ref_job, t0)], poll_s=1)
    assert [o.status for o in outcomes] == ["done", "done"], [(o.status, o.detail, o.log) for o in outcomes]
    first, second = resumed_from(job)
    assert 2 <= first < second < 16, log_of(job)  # each attempt stopped at a step boundary after a checkpoint
    assert json.loads((cut.run_dir / DONE).read_text())["attempt"] == 2
    assert log_of(job).count("Caught signal SIGUSR2") == 2  # ours, then the scheduler's at the time limit
    assert sum(m.get("rollout/trained_seqs", 0) for m in read_metrics(cut.run_dir)) > 0  # something was trained
    assert comparable(cut) == comparable(ref)
    from safetensors.torch import load_file

    a, b = (load_file(str(list_checkpoints(r.run_dir)[-1] / "model.safetensors")) for r in (cut, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_two_gpu_job_runs_two_gloo_ranks_and_resumes_after_preemption(tmp_path):
    base = {**TOY, **LOGRA, "train": {**TOY["train"], "steps": 5, "logprob_chunk": 64}, "eval": {"size": 4, "every": 0},
            "dist": {"strategy": "fsdp2", "seeded_groups": True}, "rollout": {"engine": "hf", "max_new_tokens": 8},
            "step_control": {"target_kl": 1e-4, "probe_fraction": 1}}
    sweep = write_sweep(tmp_path, base, {**LAUNCHER, "gpus_per_node": 2, "cpus_per_task": 2, "mem_gb": 4})
    ref, ref_job = submit(sweep, tmp_path / "ref", "tests.launch_fakes:toy_train")
    cut, job = submit(sweep, tmp_path / "cut", "tests.launch_fakes:toy_train")
    t0 = time.time()
    wait_until("step 2", lambda: logged_step(cut) >= 2, job, timeout=300)
    job._interrupt()
    outcomes = slurm.wait([(cut, job, t0), (ref, ref_job, t0)], poll_s=1)
    assert [o.status for o in outcomes] == ["done", "done"], [(o.status, o.detail, o.log) for o in outcomes]
    log = log_of(job)
    assert "--nproc_per_node=2" in log and log.count("preempted: SIGTERM: stopped at step") == 2  # both ranks
    assert len(set(resumed_from(job))) == 1 and log.count("[resume] continuing") == 2  # both ranks resumed
    assert json.loads((cut.run_dir / DONE).read_text())["attempt"] == 1
    assert (list_checkpoints(cut.run_dir)[-1] / "dcp" / "__1_0.distcp").exists()  # sharded over the 2 ranks
    assert [m["step/scale"] for m in read_metrics(cut.run_dir)] == [m["step/scale"] for m in read_metrics(ref.run_dir)]
    a, b = (read_model_weights(list_checkpoints(r.run_dir)[-1]) for r in (cut, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_job_that_dies_while_sacct_answers_nothing_ends_the_wait_with_an_error(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")  # this process's sacct only
    sweep = write_sweep(tmp_path, TOY, {**LAUNCHER, "wait": True, "lost_after_s": 5})
    assert launch.main([f"sweep={sweep}", f"root={tmp_path / 'root'}"], train_fn="tests.launch_fakes:died_train") == 1
    out = capsys.readouterr().out
    run = load_sweep(sweep, str(tmp_path / "root")).runs()[0]
    job = slurm.job_of(run)
    assert f"job {job.job_id} left the queue without a result" in out and "no accounting" in out
    assert f"log: {job.paths.stderr}" in out and "left the queue" in (run.run_dir / "launch_error.txt").read_text()
    monkeypatch.undo()  # the real sacct knows how it ended
    job.watcher.clear()
    assert slurm.state_of(job) in ("FAILED", "CANCELLED")


def test_the_paper_profiles_gpus_reach_the_job_as_cuda_visible_devices(tmp_path):
    launcher = {**load_sweep("paper").launcher, "cpus_per_task": 1, "mem_gb": 1, "timeout_min": 5}  # the node's size
    run = load_sweep(write_sweep(tmp_path, TOY, launcher), str(tmp_path / "root")).runs()[0]
    assert "#SBATCH --gpus-per-node=8" in slurm.render_sbatch(run, launcher)
    from tests.launch_fakes import job_environment

    job = slurm.slurm_executor(slurm.array_folder(run), "gpus", launcher).submit(job_environment)
    env = job.result()
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and env["SLURM_GPUS_ON_NODE"] == "8", env
