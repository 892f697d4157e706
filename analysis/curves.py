"""Reward and eval-accuracy curves of run directories, in one PNG (and PDF).

    python -m analysis.curves results/logra_vs_dense/* --out results/logra_vs_dense/curves.png

Left: the training reward per step (thin) and its 5-step moving average (thick). Right: greedy
pass@1 on the held-out problems at each evaluation. Reads only ``config.yaml`` and
``metrics.jsonl``; a run is labelled by its directory name, method and learning rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402


def load(run_dir: Path) -> tuple[str, list[dict]]:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    method = cfg["method"]
    lr = cfg.get(method, {}).get("lr")
    what = f"{method} lr={lr:g}" if lr is not None else method
    return f"{run_dir.name} ({what})" if run_dir.name != what else what, rows


def moving_average(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot(run_dirs: list[Path], out: Path) -> None:
    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = set()
    for i, run_dir in enumerate(run_dirs):
        label, rows = load(Path(run_dir))
        color = f"C{i}"
        train = [r for r in rows if r["step"] > 0 and r.get("reward/mean") is not None]
        steps, reward = [r["step"] for r in train], [r["reward/mean"] for r in train]
        ax_r.plot(steps, reward, color=color, alpha=0.3, linewidth=1)
        ax_r.plot(steps, moving_average(reward), color=color, linewidth=2, label=label)
        evals = [r for r in rows if r.get("eval/accuracy") is not None]
        sizes |= {int(r["eval/num_problems"]) for r in evals}
        ax_e.plot([r["step"] for r in evals], [100 * r["eval/accuracy"] for r in evals], "o-", color=color, label=label)
    ax_r.set(xlabel="GRPO step", ylabel="mean reward of sampled completions", title="training reward (5-step average)")
    ax_e.set(xlabel="GRPO step", ylabel="greedy pass@1 (%)",
             title=f"held-out accuracy ({' / '.join(map(str, sorted(sizes))) or '?'} problems)")
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, out)


def save(fig, out: Path) -> None:
    """``out`` (PNG) and a PDF beside it; closes the figure."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    fig.savefig(out.with_suffix(".pdf"))
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="PNG path (a PDF is written beside it)")
    args = parser.parse_args(argv)
    plot(args.run_dirs, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.pdf')}")


if __name__ == "__main__":
    main()
