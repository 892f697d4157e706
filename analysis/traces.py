"""Per-step traces of step control: predicted and realized KL, and the applied scale, per run.

    python -m analysis.traces results/step_control/*/ --out results/step_control/traces.png

One panel per metric (``--keys``, default ``kl/predicted kl/realized step/scale``; KL panels on a log
scale), one line per run, plus a Markdown table beside the PNG (``traces.md``) with, per run and
metric, the median, min and max over the steps that logged it and, for runs that logged both KLs,
the median of realized / predicted·s². Reads only ``config.yaml`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from analysis.curves import load, save  # noqa: E402

DEFAULT_KEYS = ("kl/predicted", "kl/realized", "step/scale")


def table(run_dirs: list[Path], keys: tuple[str, ...]) -> str:
    lines = ["| run | metric | steps | median | min | max |", "|---|---|---|---|---|---|"]
    for run_dir in run_dirs:
        label, rows = load(Path(run_dir))
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                lines.append(f"| {label} | {key} | {len(values)} | {statistics.median(values):.3g} | "
                             f"{min(values):.3g} | {max(values):.3g} |")
        both = [r["kl/realized"] / r["kl/predicted_scaled"] for r in rows
                if r.get("kl/realized") is not None and r.get("kl/predicted_scaled")]
        if both:
            lines.append(f"| {label} | realized / predicted·s² | {len(both)} | {statistics.median(both):.3g} | "
                         f"{min(both):.3g} | {max(both):.3g} |")
    return "\n".join(lines) + "\n"


def plot(run_dirs: list[Path], out: Path, keys: tuple[str, ...] = DEFAULT_KEYS) -> None:
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    for i, run_dir in enumerate(run_dirs):
        label, rows = load(Path(run_dir))
        for ax, key in zip(axes[0], keys):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), ".-", color=f"C{i}", label=label)
    for ax, key in zip(axes[0], keys):
        ax.set(xlabel="GRPO step", title=key)
        if key.startswith("kl/"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, out)
    out.with_suffix(".md").write_text(table(run_dirs, keys))


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
