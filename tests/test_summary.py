"""analysis.summary reads a run directory and reports exactly what it holds."""

import json

import pytest

from analysis.summary import main, summarize

pytestmark = pytest.mark.unit


def test_summary_of_a_fixture_run(tmp_path, capsys):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "config.yaml").write_text("method: dense\nseed: 3\ntask:\n  name: arith\n")
    (run / "meta.json").write_text(json.dumps({"git_sha": "abcdef1234567890"}))
    rows = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "time/step_s": 10.0, "mem/peak_rss_bytes": 2**30},
        {"step": 2, "time/step_s": 30.0, "mem/peak_rss_bytes": 3 * 2**30, "eval/accuracy": 0.45},
        {"step": 3, "time/step_s": 20.0, "mem/peak_rss_bytes": 2 * 2**30},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(run)
    assert (s["steps"], s["eval@start"], s["eval@end"], s["median s/step"], s["peak RSS GiB"]) == (3, "0.10", "0.45", "20.0", "3.00")
    assert s["eval steps"] == "0:0.10 2:0.45" and s["git sha"] == "abcdef1234567890" and s["seed"] == 3  # the sha whole
    main([str(run), "--out", str(tmp_path / "s.md")])
    assert "| r1 | dense | arith | 3 | 3 |" in capsys.readouterr().out
    assert (tmp_path / "s.md").read_text().count("\n") == 3
