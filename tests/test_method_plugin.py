"""A method is one file: a toy ``sgd`` written in a module outside ``baselines/`` (its own config,
one metric key of its own, its memory terms) trains, plans, enters the memory table and the metrics
writer with no edit anywhere else; from the command line it is registered through LOGRA_PLUGINS."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.integration

PLUGIN = textwrap.dedent('''
    """Plain SGD (no momentum) behind the method interface: a method in one file."""
    from dataclasses import dataclass

    import torch

    from baselines.base import Method, register_method
    from baselines.memory_terms import MemoryTerms, Term


    @dataclass
    class SGDConfig:
        lr: float = 1e-3  # step size of w <- w - lr * grad


    @register_method("sgd")
    class SGD(Method):
        config_cls = SGDConfig
        metrics = {"step/sgd_lr": "the SGD step size of the update"}

        def build_optimizer(self, model):
            self.optimizer = torch.optim.SGD(self.trainable_parameters(model), lr=self.cfg.lr)
            return self.optimizer

        def step(self):
            self.optimizer.step()
            return {"step/sgd_lr": self.cfg.lr}

        @classmethod
        def memory_terms(cls, ctx):
            """No optimizer state, every weight's gradient, no temporaries (CPU single-tensor add_)."""
            n = ctx.shapes.total
            return MemoryTerms(grads=[Term("grads", "gradients", n * ctx.weight_bytes // ctx.shard_grads, "every weight")])
''')


@pytest.fixture
def sgd(tmp_path, monkeypatch):
    """The plugin module written to a temporary folder and imported (registered); removed afterwards."""
    from baselines import METHODS

    (tmp_path / "sgd_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "sgd" not in METHODS
    import sgd_plugin  # noqa: F401  (registers "sgd")

    yield tmp_path
    METHODS.pop("sgd", None)
    sys.modules.pop("sgd_plugin", None)


def test_toy_method_trains_and_logs_its_metric(sgd, tmp_path):
    from experiments.rl.metrics import read_metrics
    from experiments.train import main

    out = tmp_path / "run"
    assert main([*TINY, "method=sgd", "sgd.lr=0.5", "train.steps=2", "eval.every=0", "train.skip_zero_advantage=false",
                 f"out_dir={out}"]) == 0
    steps = [m for m in read_metrics(out) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["step/sgd_lr"] == 0.5 for m in steps)  # its own key went through MetricsWriter
    assert "sgd:" in (out / "config.yaml").read_text()


def test_toy_method_plans_and_enters_the_memory_table(sgd, tmp_path):
    from experiments.memory.planner import plan
    from experiments.memory_table import KEYS, child

    kw = dict(micro_batch=4, seq_len=160, completion_len=128, rank=64, dtype="fp32", rollout="none", other_gb=0.0)
    p, dense = plan("tiny-llama", "sgd", **kw), plan("tiny-llama", "dense", **kw)
    assert p.categories["optimizer"] == 0 < dense.categories["optimizer"]
    assert p.categories["grads"] == dense.categories["grads"] > 0 and p.total_bytes < dense.total_bytes
    assert "tiny-llama / sgd" in p.table()
    # the memory table's row: two profiled GRPO updates of the toy method beside its planner prediction
    row = child("sgd", {**KEYS, "model": "tiny-llama", "out": str(tmp_path), "overrides": []})
    assert row["optimizer_bytes"] == 0
    assert abs(row["planner_bytes"] / row["peak_bytes"] - 1) <= 0.10, row


def test_metrics_writer_knows_a_method_registered_after_it(tmp_path):
    from baselines import METHODS
    from experiments.rl.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(tmp_path)  # made before the plugin registers
    with pytest.raises(KeyError, match="undocumented metric keys"):
        writer.write({"step": 1, "step/sgd_lr": 0.1})
    (tmp_path / "sgd_plugin.py").write_text(PLUGIN)
    sys.path.insert(0, str(tmp_path))
    try:
        import sgd_plugin  # noqa: F401

        writer.write({"step": 1, "step/sgd_lr": 0.1})
        with pytest.raises(KeyError, match="step/typo"):
            writer.write({"step": 2, "step/typo": 0.0})
    finally:
        sys.path.remove(str(tmp_path))
        METHODS.pop("sgd", None)
        sys.modules.pop("sgd_plugin", None)
    assert read_metrics(tmp_path) == [{"step": 1, "step/sgd_lr": 0.1}]


def test_command_line_registers_a_plugin_by_module_name(tmp_path):
    (tmp_path / "sgd_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "LOGRA_PLUGINS": "sgd_plugin", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    def run(*args):
        return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=REPO)

    shown = run("experiments.train", "--show", "method=sgd", "sgd.lr=0.25", "model=tiny-llama")
    assert shown.returncode == 0, shown.stderr
    assert "method: sgd" in shown.stdout and "lr: 0.25" in shown.stdout
    planned = run("experiments.plan", "model=tiny-llama", "methods=sgd,dense")
    assert planned.returncode == 0, planned.stderr
    assert "tiny-llama / sgd" in planned.stdout and "tiny-llama / dense" in planned.stdout
    missing = subprocess.run([sys.executable, "-m", "experiments.train", "--show", "method=sgd"], capture_output=True,
                             text=True, env={**env, "LOGRA_PLUGINS": "no_such_plugin"}, cwd=REPO)
    assert missing.returncode != 0 and "LOGRA_PLUGINS names module 'no_such_plugin'" in missing.stderr


def test_the_planner_and_the_method_vocabulary_import_without_torch():
    """Methods declare their memory terms with baselines.memory_terms; importing the planner (and
    that vocabulary) must not pull torch or the methods in (plan() does, to ask the registry)."""
    import subprocess
    import sys

    code = ("import sys, experiments.memory.planner, baselines.memory_terms; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('baselines.') and m != 'baselines.memory_terms'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]", out
