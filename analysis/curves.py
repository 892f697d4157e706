"""Reward and eval-accuracy curves of named run directories, in one PNG (and PDF).

    python -m analysis.curves results/logra_vs_dense/* --out results/logra_vs_dense/curves.png

Left: the training reward per step (thin) and its 5-step trailing moving average (thick). Right:
greedy pass@1 on the held-out problems at each evaluation. One line per run directory (no seed
averaging: for a whole results root with seed bands, ``python -m analysis <root>`` draws
``figures/curves.png``). Runs are read by :func:`analysis.load.load_dirs` and named by
:func:`analysis.load.dir_labels` (directory, method and learning rate).
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

SMOOTH = 5


def moving_average(values, k: int = SMOOTH) -> list[float]:
    """Trailing mean over the last ``k`` values (fewer at the start)."""
    return pd.Series(values, dtype=float).rolling(k, min_periods=1).mean().tolist()


def plot(run_dirs: list[Path], out: Path) -> None:
    runs = load_dirs(run_dirs)
    labels = dir_labels(runs)
    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = set()
    for i, (run, rows) in enumerate(runs.groupby("run", sort=False)):
        color = f"C{i}"
        if "reward/mean" in rows:
            train = rows[(rows["step"] > 0) & rows["reward/mean"].notna()]
            ax_r.plot(train["step"], train["reward/mean"], color=color, alpha=0.3, linewidth=1)
            ax_r.plot(train["step"], moving_average(train["reward/mean"]), color=color, linewidth=2, label=labels[run])
        if "eval/accuracy" in rows:
            evals = rows[rows["eval/accuracy"].notna()]
            sizes |= {int(n) for n in evals.get("eval/num_problems", pd.Series(dtype=float)).dropna()}
            ax_e.plot(evals["step"], 100 * evals["eval/accuracy"], "o-", color=color, label=labels[run])
    ax_r.set(xlabel="GRPO step", ylabel="mean reward of sampled completions",
             title=f"training reward ({SMOOTH}-step average)")
    ax_e.set(xlabel="GRPO step", ylabel="greedy pass@1 (%)",
             title=f"held-out accuracy ({' / '.join(map(str, sorted(sizes))) or '?'} problems)")
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_png_pdf(fig, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="PNG path (a PDF is written beside it)")
    args = parser.parse_args(argv)
    plot(args.run_dirs, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.pdf')}")


if __name__ == "__main__":
    main()
