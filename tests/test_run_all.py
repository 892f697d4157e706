"""./run_all.sh end to end in a scratch clone: it trains into runs/<profile>/, never into results/,
compares with the committed reference, keeps `git status` clean, and --publish makes the reference.

The clone holds this repo's tracked files without results/ and is its own git repository; its
bootstrap finds a stand-in virtualenv (LOGRA_VENV) whose python is this interpreter. The quick
profile is shrunk by run overrides: one tiny-llama dense run (method=dense collapses the method
grid), one step; the memory table's output is put in place beforehand so that step is skipped.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["model.name=tiny-llama", "method=dense", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2",
            "train.micro_batch_size=4", "rollout.max_new_tokens=4", "eval.size=2", "eval.max_new_tokens=4",
            "task.train_size=8", "task.test_size=4", "threads=1"]
MEMORY_CSV = "method,model,peak_bytes\ndense,tiny-llama,1000\n"


def git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("run_all")
    clone = base / "repo"
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True,
                             check=True).stdout.split("\0")
    for name in tracked:
        if name and not name.startswith("results/") and (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    venv = base / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    inputs = b"".join((clone / f).read_bytes() for f in ("pyproject.toml", "constraints.txt", "scripts/bootstrap.sh"))
    (venv / ".logra-installed").write_text(hashlib.sha256(inputs).hexdigest()[:16] + "-dev\n")  # bootstrap's stamp
    git(clone, "init", "-q")
    git(clone, "add", "-A")
    git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "clone")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOGRA_DATA_DIR", "LOGRA_VENV")}
    env |= {"LOGRA_VENV": str(venv), "OMP_NUM_THREADS": "1"}
    return clone, env


def run_all(clone: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./run_all.sh", *args], cwd=clone, env=env, capture_output=True, text=True, timeout=900)


def test_run_all_trains_into_runs_compares_and_publishes(clone, tmp_path):
    clone, env = clone
    (clone / "runs" / "quick" / "memory").mkdir(parents=True)
    (clone / "runs" / "quick" / "memory" / "memory.csv").write_text(MEMORY_CSV)

    first = run_all(clone, env, *TINY_RUN)  # the default root: runs/quick
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    done = list((clone / "runs" / "quick" / "runs").glob("dense-arith-s0-*/done.json"))
    assert len(done) == 1 and not (clone / "results").exists()
    run_dir = done[0].parent
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "submitit").is_dir()
    assert "This run (runs/quick) vs the reference (results/quick)" in first.stdout
    assert "no reference: results/quick does not exist" in first.stdout and "| arith | dense | 1/0 |" in first.stdout
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""  # runs/ is ignored

    again = run_all(clone, env, "--dry-run", *TINY_RUN)  # a rerun skips the finished run, inside runs/
    assert again.returncode == 0 and f"[done -> skip] runs/quick/runs/{run_dir.name}" in again.stdout

    refused = run_all(clone, env, "--publish", *TINY_RUN, "train.steps=2")  # other runs: not trained yet
    assert refused.returncode == 2 and "publish refused" in refused.stderr and "is finished" in refused.stderr
    assert not (clone / "results").exists()
    inside = run_all(clone, env, "root=results/quick", *TINY_RUN)
    assert inside.returncode == 2 and "inside results/" in inside.stderr and not (clone / "results").exists()

    published = run_all(clone, env, "--publish", *TINY_RUN)
    assert published.returncode == 0, published.stdout[-3000:] + published.stderr[-3000:]
    ref = clone / "results" / "quick"
    files = {str(p.relative_to(ref)) for p in ref.rglob("*") if p.is_file()}
    assert {f"runs/{run_dir.name}/{f}" for f in ("config.yaml", "metrics.jsonl", "meta.json", "done.json")} <= files
    assert {"memory/memory.csv", "summary.csv", "tables/accuracy.md"} <= files
    assert not any("checkpoints" in f or "submitit" in f for f in files)
    listed = git(clone, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert f"?? results/quick/runs/{run_dir.name}/metrics.jsonl" in listed  # published runs are not ignored
    assert all(line.startswith("?? results/quick/") for line in listed)

    other = tmp_path / "elsewhere"  # root= moves this run; the comparison is with the published reference
    (other / "memory").mkdir(parents=True)
    (other / "memory" / "memory.csv").write_text(MEMORY_CSV)
    second = run_all(clone, env, f"root={other}", *TINY_RUN)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert len(list((other / "runs").glob("dense-arith-s0-*/done.json"))) == 1
    assert f"This run ({other}) vs the reference (results/quick)" in second.stdout
    assert "| arith | dense | 1/1 |" in second.stdout  # both sides filled
    assert git(clone, "status", "--porcelain", "--untracked-files=all").splitlines() == listed  # results/ untouched
