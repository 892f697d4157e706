"""One Markdown row per run directory: eval accuracy at the start and the end, time per step.

    python -m analysis.summary runs/quick/dense [more run dirs ...] [--out summary.md]

Reads what the run wrote (``config.yaml``, ``meta.json``, ``metrics.jsonl``) through
:func:`analysis.load.load_dirs`. For a whole results root (seeds averaged, differences to dense),
``python -m analysis <root>`` writes ``tables/accuracy.md`` instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.load import load_dirs
from analysis.provenance import shown

COLUMNS = ["run", "method", "task", "seed", "steps", "eval@start", "eval@end", "eval steps", "median s/step", "peak RSS GiB", "git sha"]


def _column(rows: pd.DataFrame, key: str) -> pd.Series:
    return rows[key].dropna() if key in rows else pd.Series(dtype=float)


def summarize_rows(run: str, rows: pd.DataFrame) -> dict:
    """The summary row of one run, from its rows of :func:`analysis.load.load_dirs`."""
    first = rows.iloc[0]
    evals = rows[rows["eval/accuracy"].notna()] if "eval/accuracy" in rows else rows.iloc[:0]
    steps = rows[rows["step"] > 0]
    step_s, rss = _column(steps, "time/step_s"), _column(steps, "mem/peak_rss_bytes")
    return {
        "run": run,
        "method": first["method"],
        "task": first.get("task.name", "?"),
        "seed": first.get("seed", "?"),
        "steps": int(steps["step"].max()) if len(steps) else 0,
        "eval@start": f"{evals['eval/accuracy'].iloc[0]:.2f}" if len(evals) else "-",
        "eval@end": f"{evals['eval/accuracy'].iloc[-1]:.2f}" if len(evals) else "-",
        "eval steps": " ".join(f"{s}:{a:.2f}" for s, a in zip(evals["step"], evals["eval/accuracy"])),
        "median s/step": f"{step_s.median():.1f}" if len(step_s) else "-",
        "peak RSS GiB": f"{rss.max() / 2**30:.2f}" if len(rss) else "-",
        "git sha": shown(first["git_sha"]),
    }


def summarize(run_dir: Path) -> dict:
    """The summary row of one run directory (ValueError if it logged no metrics yet)."""
    runs = load_dirs([run_dir])
    if runs.empty:
        raise ValueError(f"{run_dir}: no metrics yet")
    return summarize_rows(runs["run"].iloc[0], runs)


def to_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    runs = load_dirs(args.run_dirs)
    table = to_markdown([summarize_rows(run, rows) for run, rows in runs.groupby("run", sort=False)])
    print(table, end="")
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
