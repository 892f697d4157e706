"""analysis.curves draws a decodable PNG (and a PDF) from run directories."""

import json

import matplotlib.image as mpimg
import pytest

from analysis.curves import main, moving_average

pytestmark = pytest.mark.unit


def test_moving_average_hand_worked():
    assert moving_average([1, 2, 3, 4, 5, 6], k=3) == [1, 1.5, 2, 3, 4, 5]


def test_curves_png(tmp_path):
    for i, method in enumerate(["dense", "logra"]):
        run = tmp_path / method
        run.mkdir()
        (run / "config.yaml").write_text(f"method: {method}\n{method}:\n  lr: 1.0e-5\n")
        rows = [{"step": 0, "eval/accuracy": 0.1, "eval/num_problems": 10.0}]
        rows += [{"step": s, "reward/mean": 0.1 * s + i} for s in range(1, 6)]
        rows += [{"step": 5, "eval/accuracy": 0.5, "eval/num_problems": 10.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "fig" / "curves.png"
    main([str(tmp_path / "dense"), str(tmp_path / "logra"), "--out", str(out)])
    image = mpimg.imread(out)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert out.with_suffix(".pdf").read_bytes().startswith(b"%PDF")


def test_traces_png_and_table(tmp_path):
    from analysis.traces import main as traces_main

    run = tmp_path / "ctl"
    run.mkdir()
    (run / "config.yaml").write_text("method: logra\nlogra:\n  lr: 2.0e-5\n")
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/num_problems": 10.0}]
    rows += [{"step": s, "kl/predicted": 4e-3 * s, "kl/predicted_scaled": 1e-3, "kl/realized": 1e-3 * (1 + 0.1 * s),
              "step/scale": (1 / (4 * s)) ** 0.5} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "traces.png"
    traces_main([str(run), "--out", str(out)])
    assert mpimg.imread(out).shape[1] > 100
    md = out.with_suffix(".md").read_text()
    assert "| ctl (logra lr=2e-05) | kl/predicted | 3 | 0.008 | 0.004 | 0.012 |" in md
    assert "| realized / predicted·s² | 3 | 1.2 | 1.1 | 1.3 |" in md
