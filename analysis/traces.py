"""Per-step traces of step control: predicted and realized KL, and the applied scale, per run.

    python -m analysis.traces results/step_control/*/ --out results/step_control/traces.png

One panel per metric (``--keys``, default ``kl/predicted kl/realized step/scale``; KL panels on a log
scale), one line per run directory, plus a Markdown table beside the PNG (``traces.md``) with, per
run and metric, the median, min and max over the steps that logged it and, for runs that logged
both KLs, the median of realized / predicted·s². Runs are read by :func:`analysis.load.load_dirs`;
for a whole results root, ``python -m analysis <root>`` writes the ``kl`` table and the
``kl_scatter`` / ``scale_trace`` figures instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.load import dir_labels, load_dirs  # noqa: E402
from analysis.render import save_png_pdf  # noqa: E402

DEFAULT_KEYS = ("kl/predicted", "kl/realized", "step/scale")


def _logged(rows: pd.DataFrame, key: str) -> pd.DataFrame:
    return rows[rows[key].notna()] if key in rows else rows.iloc[:0]


def table(runs: pd.DataFrame, keys: tuple[str, ...]) -> str:
    labels = dir_labels(runs)
    lines = ["| run | metric | steps | median | min | max |", "|---|---|---|---|---|---|"]
    for run, rows in runs.groupby("run", sort=False):
        for key in keys:
            values = _logged(rows, key)[key]
            if len(values):
                lines.append(f"| {labels[run]} | {key} | {len(values)} | {values.median():.3g} | "
                             f"{values.min():.3g} | {values.max():.3g} |")
        both = _logged(_logged(rows, "kl/realized"), "kl/predicted_scaled")
        both = both[both["kl/predicted_scaled"] != 0]
        if len(both):
            ratio = both["kl/realized"] / both["kl/predicted_scaled"]
            lines.append(f"| {labels[run]} | realized / predicted·s² | {len(ratio)} | {ratio.median():.3g} | "
                         f"{ratio.min():.3g} | {ratio.max():.3g} |")
    return "\n".join(lines) + "\n"


def plot(run_dirs: list[Path], out: Path, keys: tuple[str, ...] = DEFAULT_KEYS) -> None:
    runs = load_dirs(run_dirs)
    labels = dir_labels(runs)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    for i, (run, rows) in enumerate(runs.groupby("run", sort=False)):
        for ax, key in zip(axes[0], keys):
            pts = _logged(rows, key)
            if len(pts):
                ax.plot(pts["step"], pts[key], ".-", color=f"C{i}", label=labels[run])
    for ax, key in zip(axes[0], keys):
        ax.set(xlabel="GRPO step", title=key)
        if key.startswith("kl/"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_png_pdf(fig, out)
    out.with_suffix(".md").write_text(table(runs, keys))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="PNG path; a PDF and a .md table are written beside it")
    ap.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    args = ap.parse_args(argv)
    missing = [d for d in args.run_dirs if not (d / "metrics.jsonl").exists()]
    if missing:
        ap.error(f"not run directories (no metrics.jsonl): {', '.join(map(str, missing))}")
    plot(args.run_dirs, args.out, tuple(args.keys))
    print(f"wrote {args.out}, {args.out.with_suffix('.pdf')} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
