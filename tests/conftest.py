"""Shared fixtures (a toy task whose reward a random tiny model can earn, tiny-run overrides) and the
test tiers.

Every test belongs to exactly one tier (markers registered in pyproject.toml):

- ``unit``: math and equivalences on tiny tensors or small in-process modules; no trained GRPO
  run, no named model loaded, no subprocess. ``./run_tests.sh -m unit`` is the fast loop.
- ``integration``: tiny-llama end to end (the trainer, the launcher, benchmarks), subprocesses,
  torchrun/gloo, the notebook.
- ``slow``: the real SmolLM2-135M-Instruct.
- ``slurm``: tiny-llama sweeps on a real single-node SLURM cluster that the session starts itself
  (:func:`slurm_cluster`: ``scripts/slurm_local.sh``, which installs the Debian packages when
  missing); skipped, with the reason, where they cannot be had (not root, no apt-get, offline).

A file sets its tier with ``pytestmark = pytest.mark.<tier>``; a test marked with another tier
belongs to that tier only (the closest marker wins, so ``-m unit`` never selects an integration
test of a mostly-unit file). A test without a tier is a collection error naming it.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

# 2 threads in one process; under pytest-xdist (./run_tests.sh) the cores shared among the workers
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

REPO = Path(__file__).resolve().parents[1]

# A tiny GRPO run: tiny-llama, 2 prompts × 4 samples, 8 new tokens, toy reward.
TINY = [
    "model=tiny-llama",
    "task=toy",
    "train.prompts_per_step=2",
    "train.group_size=4",
    "train.micro_batch_size=4",
    "rollout.max_new_tokens=8",
    "eval.size=4",
    "eval.every=2",
    "log.progress=false",
]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The GSM8K/MATH-500 JSONL folder (CI: LOGRA_DATA_DIR=../shared/data)."""
    path = Path(os.environ.get("LOGRA_DATA_DIR", REPO.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"no data folder at {path} (set LOGRA_DATA_DIR)")
    return path


TIERS = ("unit", "integration", "slow", "slurm")
SLURM_UNAVAILABLE = 3  # scripts/slurm_local.sh's exit code when the packages cannot be had


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A single-node SLURM cluster with accounting on 127.0.0.1 (``scripts/slurm_local.sh start``),
    ``SLURM_CONF`` exported to this process and so to every job it submits; stopped by its own PIDs
    at the end of the session, whatever the tests did. Yields its directory (configs, ``log/``)."""
    where = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "LOGRA_SLURM_DIR": str(where), "LOGRA_SLURM_KEEP": "1"}  # logs stay in pytest's tmp dir
    env.pop("SLURM_CONF", None)
    script = REPO / "scripts" / "slurm_local.sh"
    stop = lambda: subprocess.run(["bash", str(script), "stop"], env=env, capture_output=True, timeout=120)  # noqa: E731
    try:
        started = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        stop()
        raise
    if started.returncode != 0:
        stop()
        if started.returncode == SLURM_UNAVAILABLE:
            pytest.skip("no SLURM here: " + started.stderr.strip().splitlines()[-1])
        pytest.fail(f"scripts/slurm_local.sh start failed (exit {started.returncode}):\n{started.stderr[-3000:]}")
    conf = started.stdout.strip().split("=", 1)[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        try:
            yield where
        finally:
            with open(where / "log" / "sacct.txt", "w") as f:  # every job's elapsed and CPU time, beside the logs
                subprocess.run(["sacct", "-a", "-D", "-P", "-S", "now-1days", "-o", "JobID,JobName,State,Elapsed,TotalCPU"],
                               stdout=f, stderr=subprocess.STDOUT, timeout=60)
            stop()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Give each test its closest tier marker only (before ``-m`` selects), or refuse it untiered."""
    closest, untiered = {}, []
    for item in items:
        tier = next((m.name for m in item.iter_markers() if m.name in TIERS), None)
        if tier is None:
            untiered.append(item.nodeid)
        closest[item] = tier
    if untiered:
        raise pytest.UsageError(
            f"tests without a tier marker ({' | '.join(TIERS)}): {', '.join(untiered[:10])}"
            f"{' ...' if len(untiered) > 10 else ''}. Add `pytestmark = pytest.mark.unit` (or integration / slow / slurm) "
            "at the top of the file, or mark the test; see tests/conftest.py.")
    parents = {id(node): node for item in items for node in item.listchain()[:-1]}
    for node in parents.values():  # module/class tiers were defaults: each item now carries its own
        node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
    for item, tier in closest.items():
        item.own_markers[:] = [m for m in item.own_markers if m.name not in TIERS]
        item.add_marker(tier)
