"""The seed study: logra against dense on fresh seeds, decided by a stopping rule fixed in advance.

    python -m analysis.seeds results/cpu        # prints and writes <root>/tables/seed_study.md

The runs are ``experiments/sweeps/cpu_seeds.yaml``'s: the cpu profile's dense and logra cells (logra at
today's defaults) on seeds that no learning-rate selection used. A run of the root belongs to the study
when its method is one of the sweep's, its seed one of the sweep's grid, and its config agrees with
the sweep's config for that method on every key that defines an experiment (``analysis.load``; seeds,
paths and bookkeeping aside; step control's keys other than
``enabled`` only for a run that ran step control; ``rollout.vllm.*`` only where the study samples
with vLLM; a key the run lacks is a disagreement). The same match, on the root's runs with seeds below the study's, gives the
cells the coverage study fits its model to (``analysis/coverage.py``): the study's data never chose
its own interval.

``RULE`` is the stopping rule as the sweep's header states it; :func:`looks` implements it: a seed
counts when both its runs are done and agree with their logged counts (``analysis/outcomes.py``); the
look after k seeds takes the k lowest such seeds, Δ = mean over them and the 500 problems of
x_logra − x_dense, with the crossed t-interval (``analysis/crossed.py``) at ``LEVEL``; the first look
whose interval clears the margin decides, later seeds are not looked at.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis import crossed, intervals, outcomes
from analysis.cli import root_cli
from analysis.load import defines_experiment, flatten, per_run
from analysis.render import Absent, Table, fmt

SWEEP = "cpu_seeds"  # experiments/sweeps/cpu_seeds.yaml
REFERENCE, METHOD = "dense", "logra"
LOOKS = (5, 10, 15, 20)  # fresh seeds at each look
ALPHA = 0.05  # the family-wise error over all looks
LEVEL = 1 - ALPHA / len(LOOKS)  # Bonferroni: each look's interval at 1 − α/K
MARGIN = intervals.MARGIN  # Δ ≥ −5 points counts as equal accuracy
VERDICTS = {"equal": "equal within 5 points", "gap": "a gap beyond 5 points",
            "undecided": f"undecided at {LOOKS[-1]} seeds",
            "continue": "undecided after {n} fresh {seeds}; the study continues"}
RULE = (f"looks after {', '.join(map(str, LOOKS[:-1]))} and {LOOKS[-1]} fresh seeds (a seed counts when both its "
        f"{REFERENCE} and {METHOD} runs are done); at each look Δ = {METHOD} − {REFERENCE} in pass@1 points with the "
        f"crossed t-interval (analysis/crossed.py, the coverage study's choice) at level 1 − {ALPHA:g}/{len(LOOKS)} = "
        f"{100 * LEVEL:.2f} % (Bonferroni over the {len(LOOKS)} looks); stop as \"{VERDICTS['equal']}\" when the "
        f"lower end is above −{100 * MARGIN:g}, as \"{VERDICTS['gap']}\" when the upper end is below −{100 * MARGIN:g}, "
        f"else go on; at {LOOKS[-1]} seeds \"{VERDICTS['undecided']}\"")


@functools.lru_cache(maxsize=None)
def study_configs(sweep: str = SWEEP) -> tuple[dict[str, dict], list[int]]:
    """Per method of the sweep, its resolved config flattened (the grid's first seed), and the grid's seeds
    (cached: building a config takes seconds; do not mutate what it returns)."""
    from omegaconf import OmegaConf

    from experiments.config import build_config
    from experiments.launcher.sweep import dotlist_value, load_sweep

    s = load_sweep(sweep)
    base = [f"config={s.config}"] if s.config else []
    base += [f"{k}={dotlist_value(v)}" for k, v in flatten(s.base).items()]
    seeds = [int(v) for v in s.grid["seed"]]
    configs = {}
    for method in s.grid["method"]:
        axes = [f"{k}={dotlist_value(v[0])}" for k, v in s.grid.items() if k not in ("seed", "method")]
        cfg = build_config(base + axes + [f"method={method}", f"seed={seeds[0]}"])
        configs[str(method)] = flatten(OmegaConf.to_container(cfg, resolve=True))
    return configs, seeds


def outside(runs: pd.DataFrame, sweep: str = SWEEP) -> pd.DataFrame:
    """``runs`` less the study's: a run of one of its methods on one of its fresh seeds. Those are read by
    the stopping rule alone (tables/seed_study.md): pooled into a root's other accuracy tables, their
    intervals would be looked at after every published seed, at a nominal level, beside the seeds that
    chose the rates."""
    if runs.empty:
        return runs
    configs, grid = study_configs(sweep)
    return runs[~(runs["seed"].astype(int).isin(grid) & runs["method"].astype(str).isin(list(configs)))]


def disagreements(run_config: dict, study: dict, ran_step_control: bool) -> list[str]:
    """The experiment-defining keys on which a run's flattened config differs from the study's (module
    docstring)."""
    idle = not ran_step_control  # then step control's settings change nothing the run computes, but whether it is on
    engine = f"rollout.{study.get('rollout.engine')}."  # only the engine that samples has settings that count
    keys = [k for k in study if defines_experiment(k)
            and not (idle and k.startswith("step_control.") and k != "step_control.enabled")
            and not (k.startswith("rollout.vllm.") and not k.startswith(engine))]
    return [k for k in keys if k not in run_config or run_config[k] != study[k]]


def membership(runs: pd.DataFrame, sweep: str = SWEEP) -> pd.DataFrame:
    """One row per run of a study method: ``run``, ``method``, ``seed``, ``done``, ``fresh`` (a seed of
    the study's grid), ``matches`` (its config agrees with the study's) and ``differs`` (the keys where not)."""
    configs, grid = study_configs(sweep)
    columns = ["run", "method", "seed", "done", "fresh", "matches", "differs"]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    controlled = (runs.groupby("run")["kl/predicted"].apply(lambda v: v.notna().any()) if "kl/predicted" in runs
                  else pd.Series(dtype=bool))
    rows = []
    for run, r in per_run(runs).iterrows():
        if str(r["method"]) not in configs:
            continue
        raw = flatten(yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text()) or {})
        differs = disagreements(raw, configs[str(r["method"])], bool(controlled.get(run, False)))
        rows.append({"run": run, "method": str(r["method"]), "seed": int(r["seed"]), "done": bool(r["done"]),
                     "fresh": int(r["seed"]) in grid, "matches": not differs, "differs": ", ".join(differs)})
    return pd.DataFrame(rows, columns=columns)


def paired_outcomes(runs: pd.DataFrame, members: pd.DataFrame) -> tuple[dict[int, np.ndarray], list[str], dict]:
    """Per seed whose METHOD and REFERENCE runs (both done, both matching) pair up problem by problem:
    d = x_METHOD − x_REFERENCE over the problems in id order; why the other seeds do not count; and the
    counted seeds' final pass@1 (seed → (REFERENCE's, METHOD's))."""
    from analysis.accuracy import per_run_accuracy

    per = per_run_accuracy(runs)
    dirs = per_run(runs)["run_dir"]
    ok = members[members["matches"] & members["done"]]
    out, why, problems, ends = {}, [], None, {}
    for seed, of_seed in ok.groupby("seed"):
        by_method = {m: g["run"].tolist() for m, g in of_seed.groupby("method")}
        if sorted(by_method) != sorted((REFERENCE, METHOD)) or any(len(v) != 1 for v in by_method.values()):
            why.append(f"seed {seed}: not one done {REFERENCE} and one done {METHOD} run")
            continue
        both = []
        for method in (METHOD, REFERENCE):
            run = by_method[method][0]
            r = per.loc[run]
            n = int(r["problems"])
            both.append(outcomes.final_outcomes(run, dirs[run], int(seed), int(r["end_step"]), round(r["end"] * n), n))
        d, why_not = outcomes.pair([both[0]], [both[1]])
        ids = sorted(both[0].outcomes) if both[0].outcomes is not None else None
        if d is None:
            why.append(f"seed {seed}: {why_not}")
        elif problems is not None and ids != problems:
            why.append(f"seed {seed}: evaluated other problems than seed {min(out)}")
        else:
            problems = ids if problems is None else problems  # every counted seed: the same problems, in id order
            out[int(seed)] = d[0]
            ends[int(seed)] = tuple(float(per.loc[by_method[m][0], "end"]) for m in (REFERENCE, METHOD))
    return out, why, ends


@dataclass(frozen=True)
class Look:
    """One look of the rule: after ``n`` seeds (``seeds``), Δ's interval and the decision."""

    n: int
    seeds: tuple[int, ...]
    delta: crossed.Interval
    decision: str  # a key of VERDICTS


def decide(delta: crossed.Interval, last: bool) -> str:
    """The rule at one look (``RULE``)."""
    if delta.low > -MARGIN:
        return "equal"
    if delta.high < -MARGIN:
        return "gap"
    return "undecided" if last else "continue"


def looks(diffs: dict[int, np.ndarray]) -> list[Look]:
    """Every look the counted seeds reach, up to the deciding one (module docstring)."""
    order = sorted(diffs)
    done = []
    for i, k in enumerate(LOOKS):
        if len(order) < k:
            break
        seeds = tuple(order[:k])
        delta = crossed.interval(np.stack([diffs[s] for s in seeds]), level=LEVEL)
        done.append(Look(k, seeds, delta, decide(delta, i == len(LOOKS) - 1)))
        if done[-1].decision != "continue":
            break
    return done


def state(runs: pd.DataFrame, sweep: str = SWEEP) -> dict:
    """The study as it stands: ``members``, the counted seeds' ``diffs``, their ``finals`` (seed →
    (REFERENCE's, METHOD's final pass@1)), ``excluded`` (why not counted), the ``looks`` taken, and the
    ``verdict`` line (VERDICTS)."""
    members = membership(runs, sweep)
    fresh = members[members["fresh"]] if not members.empty else members
    diffs, excluded, finals = paired_outcomes(runs, fresh) if not fresh.empty else ({}, [], {})
    excluded += [f"{r.run}: config differs from the study's in {r.differs}" for r in fresh.itertuples() if not r.matches]
    taken = looks(diffs)
    if taken and taken[-1].decision != "continue":
        verdict = VERDICTS[taken[-1].decision]
    else:
        verdict = VERDICTS["continue"].format(n=len(diffs), seeds="seed" if len(diffs) == 1 else "seeds")
    return {"members": members, "diffs": diffs, "finals": finals, "excluded": excluded, "looks": taken,
            "verdict": verdict}


def pp_interval(i: crossed.Interval) -> str:
    return f"[{fmt(100 * i.low, 1, signed=True)}, {fmt(100 * i.high, 1, signed=True)}]"


def table(runs: pd.DataFrame, sweep: str = SWEEP) -> Table:
    st = state(runs, sweep)
    matching = st["members"][st["members"]["matches"]] if not st["members"].empty else st["members"]
    if set(matching["method"]) != {REFERENCE, METHOD}:
        raise Absent(f"no {REFERENCE} and {METHOD} runs of the seed study's configuration (experiments/sweeps/{sweep}.yaml)")
    data = pd.DataFrame([{"look": i + 1, "seeds": lk.n, "seed_list": " ".join(map(str, lk.seeds)),
                          "delta": lk.delta.estimate, "low": lk.delta.low, "high": lk.delta.high,
                          "decision": lk.decision} for i, lk in enumerate(st["looks"])],
                        columns=["look", "seeds", "seed_list", "delta", "low", "high", "decision"])
    shown = pd.DataFrame({
        "look": [f"{r.look} of {len(LOOKS)}" for r in data.itertuples()], "fresh seeds": data["seeds"],
        f"Δ {METHOD} − {REFERENCE} (pp)": [fmt(100 * d, 1, signed=True) for d in data["delta"]],
        f"{100 * LEVEL:.2f} % interval (pp)": [pp_interval(lk.delta) for lk in st["looks"]],
        "decision": [VERDICTS[d].format(n=n) if d != "continue" else "go on" for d, n in zip(data["decision"], data["seeds"])]})
    counted = sorted(st["diffs"])
    notes = [f"verdict: {st['verdict']}", f"rule (fixed before the runs, experiments/sweeps/{sweep}.yaml): {RULE}",
             f"seeds counted so far: {len(counted)} ({' '.join(map(str, counted)) or 'none'}); next look at "
             f"{next((k for k in LOOKS if k > len(counted)), LOOKS[-1])} seeds" if data.empty
             or data["decision"].iloc[-1] == "continue" else
             f"seeds counted: {len(counted)}; decided at look {len(data)}: later seeds are not looked at"]
    if counted:  # each seed's own numbers: what the looks are made of (no interval between looks)
        notes.append(f"per counted seed, final pass@1 {REFERENCE} / {METHOD} and Δ (pp): " + "; ".join(
            f"{s}: {st['finals'][s][0]:.3f} / {st['finals'][s][1]:.3f} "
            f"({fmt(100 * float(st['diffs'][s].mean()), 1, signed=True)})" for s in counted))
    notes += [f"not counted: {w}" for w in st["excluded"]]
    return Table("seed_study", f"Seed study: {METHOD} − {REFERENCE} on fresh seeds, by the stopping rule", data, shown,
                 notes)


def headline(runs: pd.DataFrame, sweep: str = SWEEP) -> list[str]:
    """The study's verdict in a line (for tables/summary.md), or none where the root has no study runs."""
    try:
        t = table(runs, sweep)
    except Absent:
        return []
    return [f"seed study ({METHOD} − {REFERENCE} on fresh seeds, tables/seed_study.md): {t.notes[0].removeprefix('verdict: ')}"]


def main(argv=None) -> int:
    from analysis.load import load_runs

    args = root_cli("python -m analysis.seeds", __doc__, argv)
    try:
        t = table(load_runs(args.root))
    except Absent as why:
        print(f"[analysis] {why}")
        return 0
    t.write(args.root / "tables")
    print(t.markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
