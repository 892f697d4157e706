"""Per-problem evaluation outcomes, aligned seed by seed and problem by problem for a paired comparison.

The trainer appends one line per evaluation to ``<run_dir>/eval_outcomes.jsonl`` (written by
``experiments.rl.run_dir.RunDirectory.append_eval_outcomes``)::

    {"step": 30, "problem_ids": ["arith/test/417", ...], "correct": "0110..."}

the held-out problems by their task uid (their place in the task's unshuffled split: the same
problem has the same id in every method's and every seed's run, whatever order the run's seed put
it in) and character i ``1`` where problem i was answered correctly. The last line of a step wins,
as in ``metrics.jsonl``.

Two cells (task × method variant, e.g. logra and dense) can be compared pairwise when every run of
both has the outcomes of its final evaluation, agreeing with its logged count, each seed occurs
once per cell, both cells ran the same seeds, the two runs of a seed evaluated the same problems,
and every seed evaluated as many. Then :func:`pair` gives, per seed s, the vector
d_s = x^a_s − x^b_s ∈ {−1, 0, 1}^n over the problems in id order (x the 0/1 outcome), the input of
``bootstrap.paired_difference``; otherwise it says why not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = "eval_outcomes.jsonl"  # the trainer's name for it (experiments/rl/run_dir.py EVAL_OUTCOMES)


def read_step(run_dir: str | Path, step: int) -> dict[str, int] | None:
    """``{problem id: 0 or 1}`` of the run's evaluation at ``step``, or None when the file or that
    step's line is absent. A line cut by a crash mid-write is ignored; a malformed one is an error."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return None
    found = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step") != step:
            continue
        ids, correct = record.get("problem_ids"), record.get("correct")
        if not isinstance(ids, list) or not isinstance(correct, str) or len(ids) != len(correct) \
                or set(correct) - {"0", "1"} or len(set(ids)) != len(ids):
            raise ValueError(f"{path}:{n}: expected distinct problem_ids and a 0/1 string 'correct' of the same length")
        found = {str(i): int(c) for i, c in zip(ids, correct)}
    return found


@dataclass(frozen=True)
class RunOutcomes:
    """One run of a cell: its seed, its name (for messages) and its final evaluation's outcomes
    (None where absent or not agreeing with the logged count)."""

    seed: int
    run: str
    outcomes: dict[str, int] | None
    why_not: str = ""  # why ``outcomes`` is None


def final_outcomes(run: str, run_dir: str | Path, seed: int, step: int, correct: int, problems: int) -> RunOutcomes:
    """The run's outcomes at its final evaluation ``step``, checked against its logged ``correct`` of
    ``problems`` (``eval/accuracy`` · ``eval/num_problems``)."""
    found = read_step(run_dir, step)
    if found is None:
        return RunOutcomes(seed, run, None, f"{run} has no {FILE} line for its final evaluation (step {step})")
    if len(found) != problems or sum(found.values()) != correct:
        return RunOutcomes(seed, run, None, f"{run}: {FILE} at step {step} has {sum(found.values())} of {len(found)} "
                                            f"correct, its metrics {correct} of {problems}")
    return RunOutcomes(seed, run, found)


def pair(a: list[RunOutcomes], b: list[RunOutcomes]) -> tuple[np.ndarray | None, str]:
    """The per-seed differences d_s = x^a_s − x^b_s (rows: the seeds in sorted order; columns: each
    seed's problems in id order), or None and why the cells cannot be paired (module docstring)."""
    for runs in (a, b):
        missing = [r.why_not for r in runs if r.outcomes is None]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            return None, missing[0] + more
        seeds = [r.seed for r in runs]
        if len(set(seeds)) != len(seeds):
            return None, f"a seed occurs twice among {', '.join(r.run for r in runs)}"
    by_a, by_b = {r.seed: r for r in a}, {r.seed: r for r in b}
    if set(by_a) != set(by_b):
        return None, f"the cells ran different seeds ({sorted(by_a)} and {sorted(by_b)})"
    rows = []
    for seed in sorted(by_a):
        xa, xb = by_a[seed].outcomes, by_b[seed].outcomes
        if set(xa) != set(xb):
            return None, f"{by_a[seed].run} and {by_b[seed].run} (seed {seed}) evaluated different problems"
        ids = sorted(xa)
        rows.append(np.array([xa[i] - xb[i] for i in ids], dtype=np.int8))
    if len({len(r) for r in rows}) != 1:
        return None, "the seeds evaluated different numbers of problems"
    return np.stack(rows), ""
