"""analysis.compare: this run's headline tables beside a reference root's, on two fabricated roots.

Each root holds tiny run directories (config.yaml + metrics.jsonl, as the trainer writes them) whose
accuracies, peaks and step times are set below, plus memory/memory.csv; every expected number is
recomputed here from those settings, not read back through the code under test.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from analysis import compare

pytestmark = pytest.mark.unit

MiB = 2**20
# (method, seed) -> (start accuracy, end accuracy, run peak bytes, seconds of steps 1, 2, 3)
THIS = {("dense", 0): (0.10, 0.70, 3000 * MiB, (20.0, 22.0, 30.0)), ("dense", 1): (0.12, 0.74, 3100 * MiB, (21.0, 23.0, 25.0)),
        ("logra", 0): (0.10, 0.66, 1800 * MiB, (40.0, 41.0, 45.0)), ("logra", 1): (0.12, 0.68, 1850 * MiB, (42.0, 44.0, 50.0)),
        ("lora", 0): (0.10, 0.60, 1500 * MiB, (18.0, 19.0, 20.0))}
REF = {("dense", 0): (0.10, 0.66, 3000 * MiB, (10.0, 12.0, 14.0)), ("dense", 1): (0.12, 0.70, 3000 * MiB, (11.0, 12.0, 13.0)),
       ("logra", 0): (0.10, 0.70, 1700 * MiB, (30.0, 31.0, 32.0)),
       ("galore", 0): (0.10, 0.50, 2700 * MiB, (25.0, 26.0, 27.0))}
STEP_PEAK = {"this": {"dense": 3218 * MiB, "logra": 1934 * MiB}, "ref": {"dense": 3200 * MiB, "logra": 2000 * MiB, "galore": 2708 * MiB}}


def write_root(root: Path, runs: dict, step_peak: dict) -> Path:
    for (method, seed), (start, end, peak, secs) in runs.items():
        run = root / "runs" / f"{method}-arith-s{seed}-0000000{seed}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"method": method, "seed": seed, "model": {"name": "tiny-llama"},
                                                         "task": {"name": "arith"}}))
        rows = [{"step": 0, "eval/accuracy": start, "eval/num_problems": 50.0}]
        for step, s in enumerate(secs, 1):
            rows.append({"step": step, "time/step_s": s, "mem/peak_bytes": float(peak - (3 - step) * MiB),
                         **({"eval/accuracy": end, "eval/num_problems": 50.0} if step == len(secs) else {})})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.csv").write_text("method,model,peak_bytes\n" + "".join(
        f"{m},tiny-llama,{b}\n" for m, b in step_peak.items()))
    return root


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("compare")
    return write_root(base / "this", THIS, STEP_PEAK["this"]), write_root(base / "ref", REF, STEP_PEAK["ref"])


def mean(runs, method, index):
    return statistics.mean(v[index] for (m, _), v in runs.items() if m == method)


def row(table, method):
    rows = table.data[table.data["variant"] == method] if "variant" in table.data else table.data[table.data["method"] == method]
    assert len(rows) == 1, (method, table.data)
    return rows.iloc[0]


def test_accuracy_side_by_side_with_the_difference(roots):
    tables = compare.tables(*roots)
    acc = tables["accuracy"]
    for method in ("dense", "logra"):
        r = row(acc, method)
        assert r["end_this"] == pytest.approx(mean(THIS, method, 1)) and r["end_ref"] == pytest.approx(mean(REF, method, 1))
        assert r["delta_end"] == pytest.approx(mean(THIS, method, 1) - mean(REF, method, 1))
    assert row(acc, "dense")["delta_end"] == pytest.approx(0.04)
    shown = acc.shown.set_index("method")
    assert shown.loc["dense", "Δ end (pp)"] == "+4.0" and shown.loc["logra", "Δ end (pp)"] == "-3.0"
    assert shown.loc["logra", "seeds (this/ref)"] == "2/1"
    # a variant on one side only: the other side is a dash, no difference
    assert shown.loc["lora", "end ref (%)"] == "—" and shown.loc["lora", "Δ end (pp)"] == "—"
    assert shown.loc["galore", "end this (%)"] == "—" and shown.loc["galore", "end ref (%)"] == "50.0"


def test_memory_and_time_side_by_side(roots):
    tables = compare.tables(*roots)
    mem = tables["memory"]  # from memory.csv (one step per method), not the runs' peaks
    for method in ("dense", "logra"):
        r = row(mem, method)
        assert r["this_over_ref"] == pytest.approx(STEP_PEAK["this"][method] / STEP_PEAK["ref"][method])
    assert row(mem, "logra")["ratio_this"] == pytest.approx(1934 / 3218)
    assert row(mem, "logra")["ratio_ref"] == pytest.approx(2000 / 3200)
    time = tables["time"]
    for method in ("dense", "logra"):
        this = statistics.mean(statistics.median(v[3]) for (m, _), v in THIS.items() if m == method)
        ref = statistics.mean(statistics.median(v[3]) for (m, _), v in REF.items() if m == method)
        assert row(time, method)["this_over_ref"] == pytest.approx(this / ref)
    assert "time/time.csv" in tables["time table"]  # absent in both: a reason, not an error


def test_runs_memory_when_no_memory_csv(tmp_path):
    this = write_root(tmp_path / "this", THIS, {"dense": 1})
    ref = write_root(tmp_path / "ref", REF, {"dense": 1})
    for root in (this, ref):
        (root / "memory" / "memory.csv").unlink()
    mem = compare.tables(this, ref)["memory"]
    r = row(mem, "dense")  # the largest mem/peak_bytes of each run (its last step), mean over seeds
    assert r["peak_bytes_this"] == pytest.approx(mean(THIS, "dense", 2)) and r["peak_bytes_ref"] == pytest.approx(mean(REF, "dense", 2))


def test_time_csv_is_compared_when_present(roots, tmp_path):
    this, ref = roots
    (tmp_path / "time").mkdir()
    (tmp_path / "time" / "time.csv").write_text("method,model,step_s,tokens_per_s\ndense,tiny,10.0,300\nlogra,tiny,12.0,250\n")
    table = compare.time_csv_table(tmp_path, ref)  # the reference has none: its side is a dash
    shown = table.shown.set_index("method")
    assert list(table.data["model"]) == ["tiny", "tiny"]
    assert shown.loc["logra", "step_s this"] == "12" and shown.loc["logra", "step_s ref"] == "—"
    (this / "time").mkdir(exist_ok=True)
    (this / "time" / "time.csv").write_text("method,model,step_s,tokens_per_s\ndense,tiny,15.0,200\n")
    both = compare.time_csv_table(tmp_path, this).shown.set_index("method")
    assert both.loc["dense", "step_s this/ref"] == "0.67" and both.loc["dense", "tokens_per_s this/ref"] == "1.50"
    assert both.loc["logra", "step_s this/ref"] == "—"
    # the time table's own layout: one row per method and phase, a git sha per row
    header = "method,model,device,phase,median_s,q25_s,x_dense,git_sha\n"
    (tmp_path / "time" / "time.csv").write_text(header + "dense,m,cpu,rollout,4.0,3.9,1.0,aaa\ndense,m,cpu,step,10.0,9.0,1.0,aaa\n"
                                                "logra,m,cpu,step,12.0,11.0,1.2,aaa\n")
    (this / "time" / "time.csv").write_text(header + "dense,m,cpu,step,8.0,7.0,1.0,bbb\nlogra,m,cpu,step,12.0,11.5,1.5,bbb\n")
    table = compare.time_csv_table(tmp_path, this)
    shown = table.shown.set_index("method")
    assert list(shown.index) == ["dense", "logra"] and set(shown["phase"]) == {"step"}  # the whole step only
    assert shown.loc["dense", "median_s this/ref"] == "1.25" and shown.loc["logra", "x_dense this/ref"] == "0.80"
    assert "q25_s this" not in shown.columns and "git_sha" not in shown.columns


def test_report_names_both_roots_and_where_the_figures_are(roots, tmp_path, capsys):
    this, ref = roots
    assert compare.main([str(this), str(ref)]) == 0
    out = capsys.readouterr().out
    assert f"This run ({this}) vs the reference ({ref})" in out
    assert "**Held-out accuracy: this run vs the reference**" in out and "| arith | dense | 2/2 |" in out
    assert f"{this / 'memory'}/" in out and f"the reference's: {ref}/" in out
    missing = tmp_path / "nothing"
    text = compare.report(this, missing)  # no reference yet (a profile never published): this run alone
    assert f"no reference: {missing} does not exist" in text and "| arith | dense | 2/0 |" in text
