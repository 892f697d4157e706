"""Layers read top-down: no module imports a module of a higher layer (imports parsed with ``ast``).

The layer table, lowest first (a module belongs to the entry with the longest matching prefix):

====  ==========================================  ==========================================================
 0    logra_core                                  the method; imports nothing from the harness
 1    baselines                                   the methods behind one interface; nothing from experiments
 2    experiments.common                          config machinery (merge, CLI, flatten, hash), git sha, atomic writes
 3    experiments.memory.{planner,phases,         the memory model the loop uses (OOM estimate, per-phase plan and
      profiler}, experiments.rl.vllm_config     profile; the vLLM engine's settings and bytes, which it plans)
 4    experiments.rl                              the loop's components: models, tasks, rewards, rollout engines,
                                                  GRPO math, guard, distributed strategies, checkpoints, metrics
 5    experiments.config                          the run config: nests the components' config dataclasses
 6    experiments.rl.{trainer,run_dir,sync_stats} the GRPO loop and what it records
 7    experiments.*, analysis                     tools: train, launch, launcher/, plan, memory_table, the
                                                  memory/ benchmarks, time_table, analysis
====  ==========================================  ==========================================================
"""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

LAYERS = {
    "logra_core": 0,
    "baselines": 1,
    "experiments.common": 2,
    "experiments.memory.planner": 3,
    "experiments.memory.phases": 3,
    "experiments.rl.vllm_config": 3,
    "experiments.memory.profiler": 3,
    "experiments.memory.presets": 3,
    "experiments.rl": 4,
    "experiments.config": 5,
    "experiments.rl.trainer": 6,
    "experiments.rl.run_dir": 6,
    "experiments.rl.sync_stats": 6,
    "experiments": 7,
    "analysis": 7,
}
PACKAGES = ("logra_core", "baselines", "experiments", "analysis")


def layer(module: str):
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None  # not ours (torch, transformers, ...)


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, function-level ones included; ``from a import b``
    counts as ``a.b`` where that is a module of ours."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (REPO / Path(*sub.split("."))).with_suffix(".py").is_file() or (REPO / Path(*sub.split("."))).is_dir()
                out.append((node.lineno, sub if is_module else node.module))
    return out


def files():
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_no_module_imports_a_higher_layer():
    bad = []
    for path in files():
        me = _module_name(path)
        mine = layer(me)
        for line, target in imports(path):
            theirs = layer(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{path.relative_to(REPO)}:{line} ({me}, layer {mine}) imports {target} (layer {theirs})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_core_and_the_baselines_stay_apart_from_the_harness():
    for path in files():
        me = _module_name(path)
        for line, target in imports(path):
            if me.startswith("logra_core"):
                assert not target.startswith(("baselines", "experiments", "analysis")), f"{path}:{line} imports {target}"
            if me.startswith("baselines"):
                assert not target.startswith(("experiments", "analysis")), f"{path}:{line} imports {target}"


def test_the_layer_test_catches_an_upward_import(tmp_path):
    """The checker itself: a module of layer 4 importing the trainer (layer 6) is reported."""
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from experiments.rl.trainer import GRPOTrainer\n")
    (target,) = [t for _, t in imports(src)]
    assert layer(target) == 6 > layer("experiments.rl.models") == 4
    assert layer("experiments.launcher.sweep") == 7 and layer("experiments.rl") == 4 and layer("torch") is None
