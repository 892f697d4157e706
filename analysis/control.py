"""Step control with and without: each method variant's final accuracy beside the same variant run
with ``step_control.enabled=false``, and the difference with its 95 % interval.

    python -m analysis.control results/cpu      # prints the Markdown table

Two cells of a task pair up when their runs are of one method and their configs agree on every key
that defines an experiment (``analysis.load``) except step control's: the cell with
``step_control.enabled: false`` is "without", the other "with". Δ = with − without, paired over
seeds and problems where the per-problem outcomes allow it (``analysis.intervals.difference``).
The realized KL of the controlled runs is in ``kl.md`` / ``scale_trace``; a run without control
logs no prediction and no realized KL.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis import intervals
from analysis.cli import root_cli
from analysis.load import defines_experiment, per_run
from analysis.render import Absent, Table, fmt, mean_std

NOT_COMPARED = {"run", "run_dir", "git_sha", "done", "step", "task_label", "variant", "family"}


def _setting(row: pd.Series) -> dict:
    """What a run computes, step control aside: its experiment-defining config keys that have a value."""
    return {k: v for k, v in row.items()
            if "/" not in k and k not in NOT_COMPARED and defines_experiment(k)
            and not k.startswith("step_control.") and not (v is None or (isinstance(v, float) and math.isnan(v)))}


def _agree(a: dict, b: dict) -> bool:
    """Equal on every key both have (a key older runs lack is no difference, as in ``analysis.load``)."""
    return all(str(a[k]) == str(b[k]) for k in a.keys() & b.keys())


def pairs(runs: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(task, variant with control, variant without) for every cell run with ``step_control.enabled``
    false that has a partner."""
    if "step_control.enabled" not in runs:
        return []
    configs = per_run(runs)
    cells = {}
    for (task, variant), group in configs.groupby(["task_label", "variant"], sort=True):
        first = group.iloc[0]
        cells[(task, variant)] = (str(first["step_control.enabled"]).lower() == "false", _setting(first))
    out = []
    for (task, off), (is_off, setting) in cells.items():
        if not is_off:
            continue
        out += [(task, on, off) for (t, on), (other_off, other) in cells.items()
                if t == task and not other_off and _agree(setting, other)]
    return out


def table(runs: pd.DataFrame) -> Table:
    found = pairs(runs)
    if not found:
        raise Absent("no variant was run both with and without step control (step_control.enabled=false)")
    data_cells = intervals.cells(runs)
    rows = []
    for task, on, off in found:
        a, b = data_cells[(task, on)], data_cells[(task, off)]
        delta, pairing, used = intervals.difference(a, b)
        rows.append({"task_label": task, "variant": on, "without": off, "seeds": used,
                     "with_mean": a["interval"].estimate, "with_std": a["end_std"],
                     "without_mean": b["interval"].estimate, "without_std": b["end_std"],
                     "delta": delta.estimate, "delta_low": delta.low, "delta_high": delta.high, "pairing": pairing})
    data = pd.DataFrame(rows)
    shown = pd.DataFrame({
        "task": data["task_label"], "method": data["variant"], "seeds": data["seeds"],
        "with control (%)": [mean_std(100 * m, 100 * s) for m, s in zip(data["with_mean"], data["with_std"])],
        "without (%)": [mean_std(100 * m, 100 * s) for m, s in zip(data["without_mean"], data["without_std"])],
        "Δ with − without (pp)": [fmt(100 * d, 1, signed=True) for d in data["delta"]],
        "Δ 95 % interval (pp)": [intervals.interval_text(lo, hi, signed=True)
                                 for lo, hi in zip(data["delta_low"], data["delta_high"])],
    })
    notes = ["final greedy pass@1 on the held-out problems at each run's last evaluation; mean ± std over seeds",
             intervals.pairing_note(data.rename(columns={"without": "reference"})),
             "the realized KL of the controlled runs: kl.md and figures/scale_trace; runs without control log none"]
    return Table("control", "Predicted-KL step control: accuracy with and without it", data, shown, notes)


def main(argv=None) -> int:
    from analysis.load import load_runs

    args = root_cli("python -m analysis.control", __doc__, argv)
    print(table(load_runs(args.root)).markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
