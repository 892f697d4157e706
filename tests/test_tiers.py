"""The tier markers of tests/conftest.py: the closest tier wins, an untiered test is refused."""

import pytest

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]

CONFTEST = "from tests.conftest import TIERS, pytest_collection_modifyitems  # noqa: F401\n"
MIXED = """
import pytest

pytestmark = pytest.mark.unit


def test_math():
    pass


@pytest.mark.integration
def test_end_to_end():
    pass


@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_param(x):
    pass
"""


def selected(pytester, expr):
    result = pytester.runpytest_inprocess("-m", expr, "--collect-only", "-q")
    return sorted(line.split("::", 1)[1] for line in result.outlines if "::" in line)


def test_closest_tier_wins(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_mixed=MIXED)
    assert selected(pytester, "unit") == ["test_math", "test_param[1]"]
    assert selected(pytester, "integration") == ["test_end_to_end"]
    assert selected(pytester, "slow") == ["test_param[2]"]


def test_an_untiered_test_is_refused(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_plain="def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("--collect-only", "-q")
    assert result.ret != 0
    assert "tests without a tier marker" in "\n".join(result.errlines + result.outlines)
