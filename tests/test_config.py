"""Config: merge order, shorthands, and clear errors before anything heavy loads."""

import subprocess
import sys
import time

import pytest

from experiments.config import ConfigError, build_config
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def test_defaults_and_shorthands():
    cfg = build_config(["task=gsm8k", "model=tiny-llama", "train.steps=7", "dense.lr=1e-5"])
    assert cfg.task.name == "gsm8k" and cfg.model.name == "tiny-llama"
    assert cfg.train.steps == 7 and cfg.dense.lr == 1e-5 and cfg.method == "dense"


def test_yaml_then_cli(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 11\n  group_size: 4\n")
    cfg = build_config([f"config={path}", "train.steps=12"])
    assert (cfg.train.steps, cfg.train.group_size) == (12, 4)
    assert build_config(["config=arith_dense"]).train.steps == 30  # a name from experiments/configs/


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stpes=3", "unknown config key 'train.stpes'.*did you mean 'train.steps'"),
        ("nonsense=1", "unknown config key 'nonsense'"),
        ("train.steps=abc", "bad value for 'train.steps'"),
        ("rollout.temperature=hot", "bad value for 'rollout.temperature'"),
        ("train.group_size=0", "train.group_size must be >= 1"),
        ("method=adamw9000", "unknown method 'adamw9000'"),
        ("config=no_such_config", "config file 'no_such_config' not found"),
        ("justakey", "expected key=value"),
    ],
)
def test_bad_config_is_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config([override])


def test_config_is_read_only():
    cfg = build_config([])
    with pytest.raises(Exception):
        cfg.train.steps = 3


@pytest.mark.integration
def test_cli_rejects_bad_key_before_loading_a_model():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "train.stpes=3"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown config key 'train.stpes'" in proc.stderr
    assert time.perf_counter() - t0 < 30
    proc = subprocess.run([sys.executable, "-c", "import sys, experiments.train as t; t.main(['train.steps=x']); "
                           "print('torch-model-loaded' if 'experiments.rl.trainer' in sys.modules else 'clean')"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip().endswith("clean"), proc.stdout + proc.stderr


def test_every_key_has_a_meaning():
    from experiments.config import describe

    lines = [l for l in describe().splitlines() if l.strip()]
    assert len(lines) > 40
    undocumented = [l.split()[0] for l in lines if len(l.split(None, 1)) < 2]
    assert not undocumented, f"config fields without a '# meaning' comment: {undocumented}"
