"""README's headline table and docs/results.md's cpu entry are generated (analysis/readme.py): the
committed blocks equal what the committed results/ render now, a number edited by hand in them is
caught, and no sha in them is cut short. Integration tier: the row builders read every results folder
and expand short shas with ``git rev-parse``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from analysis import readme

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def expected():
    return readme.rendered(REPO)


def test_committed_blocks_are_what_results_render(expected):
    diffs = readme.differences(REPO, expected)
    assert not diffs, "README.md / docs/results.md differ from results/: run python -m analysis.readme\n" + "\n".join(diffs)


def test_a_number_edited_by_hand_is_caught(expected, tmp_path):
    (tmp_path / "docs").mkdir()
    for name, text in expected.items():
        (tmp_path / name).write_text(text)
    assert readme.differences(tmp_path, expected) == []
    block = expected["README.md"].split(readme.BEGIN)[1]
    number = re.search(r"\*\*(\d+\.\d+)×\*\*", block).group(1)  # the first bold ratio: the memory claim
    edited = expected["README.md"].replace(f"**{number}×**", f"**{float(number) + 0.01:.2f}×**", 1)
    (tmp_path / "README.md").write_text(edited)
    (diff,) = readme.differences(tmp_path, expected)
    assert f"-{''}" in diff and f"{float(number) + 0.01:.2f}×" in diff


def test_every_sha_in_the_blocks_is_whole(expected):
    for name, text in expected.items():
        block = text.split(readme.BEGIN)[1].split(readme.END)[0]
        for sha in re.findall(r"\b[0-9a-f]{7,}\b", block):
            assert len(sha) == 40, f"{name}: a cut sha {sha}"
    assert "-dirty" in expected["README.md"]  # e.g. the fp32 memory table's tree had uncommitted changes


def test_splice_replaces_only_the_block():
    text = f"before\n{readme.BEGIN}\nold\n{readme.END}\nafter\n"
    assert readme.splice(text, "new\n") == f"before\n{readme.BEGIN}\nnew\n{readme.END}\nafter\n"
    with pytest.raises(ValueError):
        readme.splice("no markers", "new\n")
