"""README's headline rows that come from training runs: equal accuracy (the seed study and the cpu
profile's seeds), bf16 learning, the step budget, and predicted-KL step control.

What each reads (run directories through ``analysis.load``):

- accuracy: ``results/cpu`` — the seed study (``analysis/seeds.py``: its verdict and looks), the runs with
  seeds below the study's for every variant's mean ± std and Δ with its interval (``analysis/intervals.py``),
  and ``results/cpu/tables/coverage.csv`` (the chosen interval's least coverage of Δ at 95 %, over seed
  counts and scenarios);
- bf16: ``results/bf16`` runs (``intervals.cells``) and ``results/bf16/weight_motion.csv`` (changed,
  moved_ulp_p50 of the dense runs);
- steps: the largest step of ``results/cpu``'s runs;
- control: ``results/cpu`` runs below the study's seeds (``analysis/kl.py`` per step, ``analysis/control.py``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pandas as pd

from analysis import control, crossed, intervals, kl, names, provenance, seeds
from analysis.coverage_table import USED
from analysis.load import load_runs, per_run
from analysis.readme_rows import Row
from analysis.render import mean_std

EARLY_STEPS = 10  # "the first steps", where a small probe reads the KL worst (docs/speed.md)


@functools.lru_cache(maxsize=None)
def _runs(root: str) -> pd.DataFrame:
    return load_runs(root)


def pp(value: float, signed: bool = True) -> str:
    return f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"


def span(low: float, high: float) -> str:
    return "no interval (one seed)" if math.isnan(low) else f"[{pp(low)}, {pp(high)}]"


def _versions(runs: pd.DataFrame, label: str = "runs") -> dict[str, list[str]]:
    return {label: provenance.versions(per_run(runs)["git_sha"])}


def early_runs(repo: Path) -> pd.DataFrame:
    """results/cpu's runs outside the seed study (the cpu profile's own seeds)."""
    return seeds.outside(_runs(str(repo / "results/cpu")))


def _coverage_floor(repo: Path) -> float:
    rows = pd.read_csv(repo / "results/cpu/tables/coverage.csv")
    pick = rows[(rows["quantity"] == "difference") & (rows["level"] == 0.95) & (rows["interval"] == USED[crossed.DF])]
    return float(pick["coverage"].min())


def accuracy(repo: Path) -> Row:
    runs = _runs(str(repo / "results/cpu"))
    state = seeds.state(runs)
    _, grid = seeds.study_configs()
    early = early_runs(repo)
    data = intervals.table(early).data.set_index("variant")
    named = {v: n for (_, v), n in names.variant_names(early).items()}
    study = state["members"]
    pair = per_run(early).loc[study[study["matches"] & (study["seed"] < min(grid))]["run"]]
    ref, mine = (pair[pair["method"] == m]["variant"].iloc[0] for m in (seeds.REFERENCE, seeds.METHOD))
    level = f"{100 * seeds.LEVEL:.2f} %"
    looks = state["looks"]
    if looks and looks[-1].decision != "continue":
        last = looks[-1]
        said = (f"**{state['verdict']}**: LoGRA − dense AdamW {pp(last.delta.estimate)} points, {level} interval "
                f"{span(last.delta.low, last.delta.high)} over {last.n} fresh seeds (look {len(looks)} of {len(seeds.LOOKS)} "
                "of the pre-registered rule, results/cpu/tables/seed_study.md)")
    else:
        said = (f"**{state['verdict']}** (the pre-registered seed study on fresh seeds {grid[0]}–{grid[-1]}, looks at "
                f"{'/'.join(map(str, seeds.LOOKS))} seeds: results/cpu/tables/seed_study.md)")
        if looks:
            said += (f"; look {len(looks)} ({looks[-1].n} seeds): Δ {pp(looks[-1].delta.estimate)} points, {level} interval "
                     f"{span(looks[-1].delta.low, looks[-1].delta.high)}")
    r, m = data.loc[ref], data.loc[mine]
    seeds_early = sorted(per_run(early)["seed"].astype(int).unique())
    said += (f". On the cpu profile's seeds {seeds_early[0]}–{seeds_early[-1]} (seed 0 also chose the rates): pass@1 after "
             f"{int(early['step'].max())} steps dense AdamW {mean_std(100 * r.end_mean, 100 * r.end_std)} %, LoGRA "
             f"{mean_std(100 * m.end_mean, 100 * m.end_std)} %; Δ {pp(m.delta)} points, 95 % interval "
             f"{span(m.delta_low, m.delta_high)}")
    others = [v for v in data.index if v not in (ref, mine) and pd.notna(data.loc[v, "delta"])]
    above = sum(data.loc[v, "verdict"] == "yes" for v in [mine, *others])
    three = (early.get("task.digits", pd.Series(dtype=float)) == 3).any()
    scale = (f"fp32, SmolLM2, {data['problems'].iloc[0]} held-out problems; intervals: t over seeds × problems "
             f"(analysis/crossed.py; covers Δ in ≥ {100 * _coverage_floor(repo):.1f} % of simulated data sets at 3–20 seeds, "
             "results/cpu/tables/coverage.md); the other variants on the same seeds: "
             + "; ".join(f"{named[v]} {mean_std(100 * data.loc[v, 'end_mean'], 100 * data.loc[v, 'end_std'])} % (Δ "
                         f"{pp(data.loc[v, 'delta'])} {span(data.loc[v, 'delta_low'], data.loc[v, 'delta_high'])})"
                         for v in others)
             + f"; intervals above −5 points: {above} of {1 + len(others)}; rates: dense AdamW, LoGRA, GaLore and LoRA "
               "from results/lr (one seed each), LoGRA without step control and with sketched embeddings from "
               "results/logra_vs_dense" + ("" if three else "; three-digit cells not run"))
    fresh = per_run(runs).loc[study[study["fresh"]]["run"]] if study["fresh"].any() else early.iloc[:0]
    versions = {f"{named[v]} runs (seeds {seeds_early[0]}–{seeds_early[-1]})": provenance.versions(
        per_run(early)[per_run(early)["variant"] == v]["git_sha"]) for v in [ref, mine, *others]}
    if len(fresh):
        versions["seed study runs"] = provenance.versions(fresh["git_sha"])
    return Row("equal task performance to dense Adam (the condition of the memory claim)", said, scale, ["cpu", "lr", "logra_vs_dense"], versions)


def bf16(repo: Path) -> Row:
    runs = _runs(str(repo / "results/bf16"))
    cells = intervals.cells(runs)
    motion = pd.read_csv(repo / "results/bf16/weight_motion.csv")
    first = per_run(runs).drop_duplicates("variant").set_index("variant")
    dense = next(v for v in first.index if first.loc[v, "method"] == seeds.REFERENCE)
    logra = sorted((v for v in first.index if first.loc[v, "method"] == seeds.METHOD),
                   key=lambda v: list(names.MASTERS).index(str(first.loc[v, "logra.master"])))
    best = max(logra, key=lambda v: cells[(first.loc[v, "task_label"], v)]["interval"].estimate)

    def said(v):
        c = cells[(first.loc[v, "task_label"], v)]
        text = f"{mean_std(100 * c['interval'].estimate, 100 * c['end_std'])} % ({names.MASTERS[str(first.loc[v, 'logra.master'])]}"
        text += (", no fp32 state" if str(first.loc[v, "logra.master"]) == "stochastic" else "")
        text += (f", {c['seeds']} seed)" if c["seeds"] == 1 else ")")
        return f"**{text}**" if v == best else text

    d = cells[(first.loc[dense, "task_label"], dense)]
    dense_dirs = {Path(r).name for r in per_run(runs).index[per_run(runs)["method"] == seeds.REFERENCE]}
    moved = motion[motion["run"].isin(dense_dirs)]  # this folder's bf16 runs (the file also holds fp32 ones)
    steps = int(runs["step"].max())
    return Row(
        "… in bf16, as GPU runs train",
        f"pass@1 after {steps} steps at the fp32 best rates: dense AdamW with mixed precision "
        f"{mean_std(100 * d['interval'].estimate, 100 * d['end_std'])} %; LoGRA " + ", ".join(said(v) for v in logra),
        f"{d['seeds']} seeds; dense with mixed precision changed only {100 * moved['changed'].mean():.0f} % of its bf16 "
        f"weights in {steps} steps (its fp32 masters moved a median {moved['moved_ulp_p50'].mean():.2f} of a bf16 "
        "spacing, weight_motion.csv), so this gap says bf16 handicaps dense at this rate and budget, not that LoGRA "
        "beats dense", ["bf16"], _versions(runs))


def steps(repo: Path) -> Row:
    runs = _runs(str(repo / "results/cpu"))
    return Row("trained stably for over 1,100 RL steps", f"not measured: runs here are {int(runs['step'].max())} steps",
               "—", [], {})


def step_control(repo: Path) -> Row:
    early = early_runs(repo)
    named = {v: n for (_, v), n in names.variant_names(early).items()}
    by_name = {n: v for v, n in named.items()}
    floor, plain = by_name["LoGRA"], by_name["LoGRA, no probe floor"]
    table = kl.table(early).data.set_index("variant")
    steps_ = kl.controlled_steps(early)
    kappa = float(table.loc[floor, "target_kl"])

    def misses(v):
        s = steps_[(steps_["variant"] == v) & (steps_["step/scale"] < 1)]
        off = s[(s["kl/realized"] / kappa - 1).abs() > kl.TOLERANCE]
        return int((off["step"] <= EARLY_STEPS).sum()), len(off)

    ctrl = control.table(early).data.set_index("variant")
    total = int(early["step"].max())
    config = per_run(early)[per_run(early)["variant"] == floor].iloc[0]
    (mf, nf), (mp, np_) = misses(floor), misses(plain)
    within = all(ctrl.loc[v, "delta_low"] <= 0 <= ctrl.loc[v, "delta_high"] for v in (floor, plain))
    seeds_n = int(table.loc[floor, "seeds"])
    return Row(
        "(method) predicted-KL step control keeps each step's KL near κ",
        f"κ = {kappa:g}: realized KL of the whole batch within ±{100 * kl.TOLERANCE:.0f} % of κ on "
        f"**{100 * table.loc[floor, 'on_target_frac']:.0f} %** of the shrunk steps with the probe floor (today's default; "
        f"median {table.loc[floor, 'realized_median']:.3g}; {seeds_n} seeds at lr {float(config['logra.lr']):g}), "
        f"{100 * table.loc[plain, 'on_target_frac']:.0f} % without it (median {table.loc[plain, 'realized_median']:.3g}); "
        f"of the misses, {mf} of {nf} with the floor and {mp} of {np_} without fall in steps 1–{EARLY_STEPS} "
        f"({EARLY_STEPS} of the {total} steps); pass@1 with control {pp(ctrl.loc[floor, 'with_mean'], False)} ± "
        f"{pp(ctrl.loc[floor, 'with_std'], False)} % (with the floor), {pp(ctrl.loc[plain, 'with_mean'], False)} ± "
        f"{pp(ctrl.loc[plain, 'with_std'], False)} % (without), without control {pp(ctrl.loc[plain, 'without_mean'], False)} ± "
        f"{pp(ctrl.loc[plain, 'without_std'], False)} %; Δ with − without {pp(ctrl.loc[floor, 'delta'])} points "
        f"{span(ctrl.loc[floor, 'delta_low'], ctrl.loc[floor, 'delta_high'])} (with the floor), {pp(ctrl.loc[plain, 'delta'])} "
        f"{span(ctrl.loc[plain, 'delta_low'], ctrl.loc[plain, 'delta_high'])} (without)",
        f"the prediction reads a probe of {100 * float(config['step_control.probe_fraction']):.0f} % of the trained rows, "
        f"at least {int(config['step_control.probe_min'])}, at most {int(config['step_control.probe_seqs'])}; "
        f"{seeds_n} seeds each, paired: control's gain is "
        + ("within noise (both intervals hold 0)" if within else "outside noise in at least one interval"),
        ["cpu", "step_control"], _versions(early[early["variant"].isin([floor, plain, ctrl.loc[plain, "without"]])]))
