"""No method name is compared as a string outside the method's own file: the tools ask the registry
(``baselines.METHODS``: config, metrics, memory terms) instead of branching on ``"logra"``."""

import ast
import inspect
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

SCANNED = ("baselines", "experiments", "analysis")  # logra_core is the logra method itself (its "dense" is a tensor kind)
# (file, name): uses that are not dispatch on a method, each with its reason
ALLOWED = {
    ("baselines/logra.py", "dense"): "logra_core's param-group kind of the unsketched tensors, not the dense method",
    ("analysis/render.py", "dense"): "the tables' reference variant for 'x dense' columns (a reporting choice)",
    ("analysis/memory.py", "dense"): "the memory table's reference row for the reduction column",
    ("analysis/steptime.py", "dense"): "the time table's reference row for the 'x dense' columns",
    ("experiments/time_table.py", "dense"): "the time table's reference row for its x_dense column",
    **{("analysis/names.py", name): "each method's readable name in tables and figures (a reporting choice, not "
       "dispatch; Method.display_name in baselines/ would own it)"
       for name in ("dense", "logra", "galore", "lora", "galore_layerwise")},
}


def method_names_used(source: str, names) -> list[tuple[int, str]]:
    """(line, name) of every string literal equal to one of ``names`` that is compared (``==``, ``!=``,
    ``in``, also inside a tuple/list/set operand), used as a dict key or a subscript, or matched in a
    ``case``: the places where code branches on a method's name."""
    found = []

    def literal(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, node.value))

    def operand(node):
        literal(node)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for e in node.elts:
                literal(e)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for x in [node.left, *node.comparators]:
                operand(x)
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                if k is not None:
                    literal(k)
        elif isinstance(node, ast.Subscript):
            operand(node.slice)
        elif isinstance(node, ast.MatchValue):
            literal(node.value)
    return found


def test_the_scan_finds_a_branch_on_a_method_name():
    names = {"logra", "dense"}
    code = ('if method == "logra":\n    pass\nkind = {"dense": 1}[m]\nx = m in ("a", "dense")\ny = T["logra"]\n'
            'z = "logra"  # an assignment is not a branch\nmatch m:\n    case "dense":\n        pass\n')
    assert sorted(method_names_used(code, names)) == [(1, "logra"), (3, "dense"), (4, "dense"), (5, "logra"), (8, "dense")]


def test_no_method_name_is_compared_outside_its_own_file():
    from baselines import METHODS

    own = {}  # file -> the names registered in it
    for name, cls in METHODS.items():
        own.setdefault(Path(inspect.getfile(cls)).resolve(), set()).add(name)
    names = set(METHODS)
    bad = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for line, name in method_names_used(path.read_text(), names - own.get(path.resolve(), set())):
                if (rel, name) not in ALLOWED:
                    bad.append(f"{rel}:{line}: {name!r}")
    assert not bad, ("method names compared outside the method's own file (ask the registry: a Method attribute, "
                     "its memory_terms, plan_options or metrics): " + ", ".join(bad))
