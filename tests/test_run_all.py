"""./run_all.sh end to end in a scratch clone, on the tiny profile (experiments/sweeps/tiny.yaml: the
quick profile's paths on tiny-llama): it trains into runs/<profile>/ (local processes), runs the memory
and time tables (the after: steps), analyses and compares with the committed reference, keeps
`git status` clean, and --publish makes the reference; a second root is compared with it.

The clone holds this repo's tracked files without results/ and is its own git repository; its
bootstrap finds a stand-in virtualenv (LOGRA_VENV) whose python is this interpreter. The quick
profile's real-model run is what ./run_all.sh does for a user, not what the suite runs.
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
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOGRA_DATA_DIR", "LOGRA_VENV", "LOGRA_PLUGINS")}
    env |= {"LOGRA_VENV": str(venv), "OMP_NUM_THREADS": "1"}
    return clone, env


def run_all(clone: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./run_all.sh", "--profile", "tiny", *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=900)


def test_run_all_trains_into_runs_compares_and_publishes(clone, tmp_path):
    clone, env = clone
    first = run_all(clone, env)  # the default root: runs/tiny
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    root = clone / "runs" / "tiny"
    done = sorted(p.parent.name.split("-")[0] for p in (root / "runs").glob("*/done.json"))
    assert done == ["dense", "logra"] and not (clone / "results").exists()
    run_dir = next((root / "runs").glob("logra-arith-s0-*"))
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "submitit").is_dir()  # trained in its own process
    assert (root / "memory" / "memory.csv").is_file() and (root / "time" / "time.csv").is_file()  # the after: steps
    tables = {p.stem for p in (root / "tables").glob("*.md")}
    assert {"memory_step", "memory_runs", "time_step", "time_runs", "accuracy", "sync", "kl"} <= tables, tables
    assert "This run (runs/tiny) vs the reference (results/tiny)" in first.stdout
    assert "no reference: results/tiny does not exist" in first.stdout and "| arith | logra | 1/0 |" in first.stdout
    assert "time table by phase (runs/tiny/tables/time_step.md" in first.stdout
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""  # runs/ is ignored

    again = run_all(clone, env, "--dry-run")  # a rerun skips the finished runs, inside runs/
    assert again.returncode == 0 and f"[done -> skip] runs/tiny/runs/{run_dir.name}" in again.stdout

    refused = run_all(clone, env, "--publish", "train.steps=3")  # other runs: not trained yet
    assert refused.returncode == 2 and "publish refused" in refused.stderr and "is finished" in refused.stderr
    assert not (clone / "results").exists()
    inside = run_all(clone, env, "root=results/tiny")
    assert inside.returncode == 2 and "inside results/" in inside.stderr and not (clone / "results").exists()

    published = run_all(clone, env, "--publish")
    assert published.returncode == 0, published.stdout[-3000:] + published.stderr[-3000:]
    ref = clone / "results" / "tiny"
    files = {str(p.relative_to(ref)) for p in ref.rglob("*") if p.is_file()}
    assert {f"runs/{run_dir.name}/{f}" for f in ("config.yaml", "metrics.jsonl", "meta.json", "done.json")} <= files
    assert {"memory/memory.csv", "time/time.csv", "summary.csv", "tables/accuracy.md", "tables/time_runs.md"} <= files
    assert not any("checkpoints" in f or "submitit" in f for f in files)
    listed = git(clone, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert f"?? results/tiny/runs/{run_dir.name}/metrics.jsonl" in listed  # published runs are not ignored
    assert all(line.startswith("?? results/tiny/") for line in listed)

    other = tmp_path / "elsewhere"  # root= moves this run (here: the same runs, already done); compared with the reference
    shutil.copytree(root, other, ignore=shutil.ignore_patterns("tables", "figures"))
    second = run_all(clone, env, f"root={other}")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "2 runs (2 done, skipped; 0 to run)" in second.stdout and (other / "tables" / "accuracy.md").is_file()
    assert f"This run ({other}) vs the reference (results/tiny)" in second.stdout
    assert "| arith | logra | 1/1 |" in second.stdout  # both sides filled
    assert git(clone, "status", "--porcelain", "--untracked-files=all").splitlines() == listed  # results/ untouched
