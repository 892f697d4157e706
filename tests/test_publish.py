"""experiments.publish: a finished training root -> the committed reference folder, and nothing else.

A tiny sweep runs with the fake train function (tests/launch_fakes.py) into a root outside any repo;
the destination is results/s inside a scratch git repository carrying this repo's .gitignore, so the
copy's ignore filter is the real one.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from experiments import launch
from experiments.launcher.sweep import load_sweep
from experiments.publish import PublishError, main, publish

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
FAKE = "tests.launch_fakes:fake_train"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({
        "base": {"model": {"name": "tiny-llama"}, "train": {"steps": 1}},
        "grid": {"method": ["dense"], "seed": [0, 1, 2]},
        "after": [{"name": "memory table", "module": "tests.no_such_module", "creates": "{root}/memory/memory.csv"}]}))
    root = tmp_path / "runs" / "s"
    monkeypatch.setenv("LOGRA_FAKE_FAIL", "1")  # seed 1 fails: the root is unfinished
    assert launch.main([f"sweep={sweep}", f"root={root}", "launcher=debug"], train_fn=FAKE) == 1
    for run in load_sweep(str(sweep), str(root)).runs():  # what training leaves that must not be published
        (run.run_dir / "checkpoints" / "step_1").mkdir(parents=True)
        (run.run_dir / "checkpoints" / "step_1" / "manifest.json").write_text("{}")
        (run.run_dir / "submitit").mkdir()
        (run.run_dir / "submitit" / "0_log.out").write_text("log")
        (run.run_dir / "weights.pt").write_text("x")
        (run.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        (run.run_dir / "eval_outcomes.jsonl").write_text('{"step":1,"problem_ids":["arith/test/0"],"correct":"1"}\n')
    monkeypatch.chdir(repo)
    return sweep, root, repo / "results" / "s"


def published_files(dest: Path) -> set[str]:
    return {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}


def test_an_unfinished_root_is_refused_and_nothing_is_written(setup, capsys):
    sweep, root, dest = setup
    with pytest.raises(PublishError) as err:
        publish(str(sweep), str(root), str(dest), analyse=False)
    text = str(err.value)
    assert "2 of 3 runs done" in text and "dense-s1-" in text and "memory/memory.csv absent" in text and "--partial" in text
    assert not dest.exists()
    assert main([f"sweep={sweep}", f"root={root}", f"to={dest}"]) == 2  # the command line says so too
    assert "publish refused" in capsys.readouterr().err and not dest.exists()
    with pytest.raises(PublishError, match="does not exist"):
        publish(str(sweep), str(root.parent / "nothing"), str(dest), analyse=False)
    with pytest.raises(PublishError, match="destination itself"):
        publish(str(sweep), str(root), str(root), analyse=False)


def test_partial_then_full_publish(setup, monkeypatch):
    sweep, root, dest = setup
    runs = load_sweep(str(sweep), str(root)).runs()
    done = [r.run_dir.name for r in runs if r.done]
    assert len(done) == 2
    publish(str(sweep), str(root), str(dest), partial=True, analyse=False)
    files = published_files(dest)
    assert {f.split("/")[1] for f in files if f.startswith("runs/")} == set(done)  # finished runs only
    for name in done:
        assert {f"runs/{name}/{f}" for f in ("calls.txt", "done.json", "metrics.jsonl", "eval_outcomes.jsonl")} <= files
    assert not any("checkpoints" in f or "submitit" in f or f.endswith(".pt") for f in files)
    with open(dest / "summary.csv") as f:
        status = {row["name"]: row["status"] for row in csv.DictReader(f)}
    assert sorted(status.values()) == ["done", "done", "not run"] and all(str(dest) in r for r in
                                                                         (dest / "summary.csv").read_text().splitlines()[1:3])
    # git sees the published runs (the !results/*/runs/ exception to the runs/ rule) and ignores nothing of them
    listed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True,
                            check=True).stdout
    assert f"results/s/runs/{done[0]}/metrics.jsonl" in listed

    monkeypatch.setenv("LOGRA_FAKE_FAIL", "")  # fill the hole and the after step, then publish in full
    assert launch.main([f"sweep={sweep}", f"root={root}", "launcher=debug"], train_fn=FAKE) == 0
    (root / "memory").mkdir()
    (root / "memory" / "memory.csv").write_text("method,peak_bytes\ndense,1\n")
    (dest / "README.md").write_text("how it was made")
    (dest / "runs" / "old-run-0000").mkdir()
    (dest / "runs" / "old-run-0000" / "metrics.jsonl").write_text("")
    publish(str(sweep), str(root), str(dest), analyse=False)
    files = published_files(dest)
    assert {f.split("/")[1] for f in files if f.startswith("runs/")} == {r.run_dir.name for r in runs}  # old run gone
    assert "memory/memory.csv" in files and (dest / "README.md").read_text() == "how it was made"
    assert not any("checkpoints" in f or "submitit" in f or f.endswith(".pt") for f in files)
