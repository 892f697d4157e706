"""What every table and figure module shares: the Table type (Markdown + LaTeX), number formats,
groups of seeds, the dense reference, and the signal that an output's data is absent."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

GROUP = ["task_label", "variant"]  # one experiment = a task × a method variant, repeated over seeds
REFERENCE = "dense"  # the method every "× dense" and "Δ vs dense" column divides by or subtracts


class Absent(Exception):
    """The data an output needs is not in the results root (the output is skipped, not an error)."""


@dataclass
class Table:
    """One table: ``data`` holds the numbers (one row per group; what tests and the notebook read),
    ``shown`` the same rows formatted for a reader, ``notes`` lines printed under it."""

    name: str
    title: str
    data: pd.DataFrame
    shown: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        cols = list(self.shown.columns)
        lines = [f"**{self.title}**", "", "| " + " | ".join(cols) + " |",
                 "|" + "|".join("---:" if _numeric(self.shown[c]) else "---" for c in cols) + "|"]
        lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in self.shown.itertuples(index=False)]
        lines += [""] + [f"- {n}" for n in self.notes] if self.notes else []
        return "\n".join(lines) + "\n"

    def latex(self) -> str:
        """A booktabs table, shrunk to the text width when wider; a header's "(unit)" on a second line."""
        cols = list(self.shown.columns)
        spec = "".join("r" if _numeric(self.shown[c]) else "l" for c in cols)
        body = [" & ".join(_tex_header(c) for c in cols) + r" \\", r"\midrule"]
        body += [" & ".join(tex(v) for v in row) + r" \\" for row in self.shown.itertuples(index=False)]
        notes = [r"\par\smallskip\footnotesize " + "; ".join(tex(n) for n in self.notes) + "."] if self.notes else []
        return "\n".join([r"% written by python -m analysis; needs \usepackage{booktabs,graphicx}",
                          r"\begin{table}[t]", r"\centering", rf"\caption{{{tex(self.title)}}}",
                          rf"\label{{tab:{self.name.replace('_', '-')}}}",
                          r"\resizebox{\ifdim\width>\linewidth\linewidth\else\width\fi}{!}{%",
                          rf"\begin{{tabular}}{{{spec}}}", r"\toprule", *body, r"\bottomrule", r"\end{tabular}}",
                          *notes, r"\end{table}"]) + "\n"

    def write(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        md, tx = out_dir / f"{self.name}.md", out_dir / f"{self.name}.tex"
        md.write_text(self.markdown())
        tx.write_text(self.latex())
        return [md, tx]


def _numeric(column: pd.Series) -> bool:
    """A column reads as numbers if its cells start with a digit or a sign (right-aligned)."""
    cells = [str(v) for v in column if str(v) not in ("", "-", "—", "ref")]
    return all(c.lstrip("+-−").lstrip()[:1].isdigit() for c in cells)  # no number at all: right-aligned too


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "×": r"$\times$",
        "Δ": r"$\Delta$", "κ": r"$\kappa$", "·": r"$\cdot$", "≤": r"$\leq$", "≥": r"$\geq$", "−": "-",
        "—": "--", "–": "--", "²": r"$^2$", "→": r"$\to$"}


def tex(value) -> str:
    """Plain text -> LaTeX source: special characters escaped, the symbols the tables print as math;
    any other character passes through (UTF-8 input, LaTeX's default since 2018)."""
    return "".join(_TEX.get(ch, ch) for ch in str(value))


def _tex_header(name: str) -> str:
    head, sep, rest = name.partition(" (")
    if not sep:
        return tex(name)
    return rf"\begin{{tabular}}[b]{{@{{}}c@{{}}}}{tex(head)}\\ {tex(sep.strip() + rest)}\end{{tabular}}"


def byte_unit(values) -> tuple[str, float]:
    """GiB when the largest value is at least 10 GiB, else MiB."""
    finite = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return ("GiB", 2**30) if finite and max(finite) >= 10 * 2**30 else ("MiB", 2**20)


def fmt(value, digits: int = 3, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def fmt_g(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}g}"


def mean_std(mean, std, digits: int = 1) -> str:
    """``74.2 ± 1.3``; a single seed (std NaN) shows the mean alone."""
    if mean is None or math.isnan(mean):
        return "—"
    return f"{mean:.{digits}f}" if std is None or math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def dense_reference(runs: pd.DataFrame) -> dict[str, str]:
    """Per task, the dense variant every table compares with: the only one or, among several (e.g.
    learning rates), the one with the best mean final ``eval/accuracy`` over its seeds (the
    strongest baseline); without evaluations the first by name. A variant's method is the first
    word of its label."""
    dense = runs[runs["variant"].str.split(" ").str[0] == REFERENCE]
    if dense.empty:
        return {}
    if "eval/accuracy" in dense:
        final = dense.dropna(subset=["eval/accuracy"]).sort_values("step").groupby("run").tail(1)
        score = final.groupby(GROUP)["eval/accuracy"].mean()
    else:
        score = pd.Series(dtype=float)
    ref = {}
    for task, of_task in dense.groupby("task_label"):
        variants = sorted(of_task["variant"].unique())
        ref[task] = max(variants, key=lambda v: (score.get((task, v), -math.inf), -variants.index(v)))
    return ref


def save_png_pdf(fig, out: Path, dpi: int | None = 120) -> None:
    """``out`` (PNG, at ``dpi``; None: the figure's) and a PDF beside it; closes the figure. The PDF
    carries no creation date, so the same figure gives the same bytes (a regenerated folder shows only
    the figures that changed)."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi if dpi is not None else "figure")
    fig.savefig(out.with_suffix(".pdf"), metadata={"CreationDate": None})
    plt.close(fig)


def save_figure(fig, out_dir: Path, name: str) -> list[Path]:
    """``<out_dir>/<name>.png`` and ``.pdf``; closes the figure."""
    png = out_dir / f"{name}.png"
    save_png_pdf(fig, png)
    return [png, png.with_suffix(".pdf")]


def seed_note(groups: pd.DataFrame, n_col: str = "seeds", std: bool = True) -> str:
    counts = sorted(set(int(n) for n in groups[n_col]))
    if counts == [1]:
        return "one seed per row" + (" (no std)" if std else "")
    seeds = "/".join(map(str, counts))
    return (f"mean ± std over the seeds of each row ({seeds}; std omitted for one seed)" if std
            else f"mean over the seeds of each row ({seeds})")


def colors(labels) -> dict[str, str]:
    """A stable color per label (tab10, tab20 past ten labels)."""
    labels = list(dict.fromkeys(labels))
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


MARKERS = "osD^vP*X"
DASHES = ["-", "--", "-.", ":"]


def line_styles(labels) -> dict[str, dict]:
    """A marker and dash per label, markers shrinking down the list: lines with equal values (two
    methods with the same first steps) stay visible, a later marker sitting inside an earlier one."""
    return {label: {"marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % len(DASHES)],
                    "markersize": max(3.0, 7.0 - 0.8 * i)} for i, label in enumerate(dict.fromkeys(labels))}


def seed_band(ax, frame: pd.DataFrame, key: str, color, label: str, scale: float = 1.0, smooth: int = 1,
              **style) -> None:
    """Mean over the runs in ``frame`` of ``key`` per step (each run first smoothed by a trailing
    ``smooth``-step moving average), with a ± 1 std band where more than one run has the step."""
    pts = frame.dropna(subset=[key]).sort_values("step")
    if pts.empty:
        return
    per_run = [g.assign(v=g[key].rolling(smooth, min_periods=1).mean() * scale) for _, g in pts.groupby("run")]
    stats = pd.concat(per_run).groupby("step")["v"].agg(["mean", "std", "count"])
    ax.plot(stats.index, stats["mean"], color=color, label=label, **style)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # x is the GRPO step
    band = stats[stats["count"] > 1]
    if not band.empty:
        ax.fill_between(band.index, band["mean"] - band["std"], band["mean"] + band["std"], color=color, alpha=0.2,
                        linewidth=0)


def legend_right(ax, fontsize: int = 7) -> None:
    """The axes' legend outside, right of the plot (long variant labels do not hide the data)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def plain_log_ticks(ax, axis: str = "y") -> None:
    """Tick labels of a log axis as plain numbers (0.006, 20), not 6×10⁻³; call after plotting.
    Minor ticks are labelled at 2 and 5 when the axis spans at most two decades."""
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for a, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        if axis not in ("both", a.axis_name) or lo <= 0:
            continue
        decades = math.log10(hi / lo)
        a.set_major_formatter(plain)
        a.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v:g}" if decades <= 2 and round(v / 10 ** math.floor(math.log10(v) + 1e-9)) in (2, 5) else ""))
    ax.tick_params(axis=axis, which="both", labelsize=8)
