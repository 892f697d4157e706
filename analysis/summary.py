"""One Markdown row per run directory: eval accuracy at the start and the end, time per step.

    python -m analysis.summary runs/quick/dense [more run dirs ...] [--out summary.md]

Reads only what the run wrote (``config.yaml``, ``meta.json``, ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

COLUMNS = ["run", "method", "task", "seed", "steps", "eval@start", "eval@end", "eval steps", "median s/step", "peak RSS GiB", "git sha"]


def summarize(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r["step"] > 0]
    return {
        "run": run_dir.name,
        "method": cfg["method"],
        "task": cfg["task"]["name"],
        "seed": cfg["seed"],
        "steps": max((r["step"] for r in steps), default=0),
        "eval@start": f"{evals[0]['eval/accuracy']:.2f}" if evals else "-",
        "eval@end": f"{evals[-1]['eval/accuracy']:.2f}" if evals else "-",
        "eval steps": " ".join(f"{r['step']}:{r['eval/accuracy']:.2f}" for r in evals),
        "median s/step": f"{statistics.median(r['time/step_s'] for r in steps):.1f}" if steps else "-",
        "peak RSS GiB": f"{max(r['mem/peak_rss_bytes'] for r in steps) / 2**30:.2f}" if steps else "-",
        "git sha": meta.get("git_sha", "unknown")[:12],
    }


def to_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    table = to_markdown([summarize(d) for d in args.run_dirs])
    print(table, end="")
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
