"""Time of one GRPO step per method, by phase, methods interleaved in one process.

    python -m experiments.time_table [out=results/time_table] [methods=<list>] [model=smollm2-135m-instruct]
        [repeats=5] [warmup=1] [profile=quick] [phases=all|rollout] [run-config key=value ...]

Every method is built once (a :class:`~experiments.rl.trainer.GRPOTrainer` each, all alive in this
process), then timed step after step in interleaved order — a warm-up step per method first (not
timed), then ``repeats`` rounds, the order rotated every round (A B C, B C A, C A B, ...: :func:`rotation`) so
that a slow drift of the machine falls on every method alike and no method steps twice in a row. The phases are the trainer's own
(``GRPOTrainer._phase``, timed by wrapping it; on CUDA with a device synchronisation at each edge):

    rollout       sampling the group completions on the engine (``rollout.engine``)
    old_logprobs  the no-grad pass for π_old (only with ``train.ppo_epochs > 1``)
    fwd_bwd       forward + backward over every micro-batch (and the gradient reduction)
    optimizer     the update (clipping, moments, applying it) — without kl_predict
    kl_predict    step control's KL prediction (inside the optimizer phase in the trainer; shown apart)
    sync          sending the update to the engine's copy of the policy
    step          the whole step, wall clock from the rollout's start to the end of the update

``phases=rollout`` times the rollout alone, round after round (no update: every method generates with
its initial weights, so the methods sample the same tokens and only their operators could differ) —
many cheap rounds for the one ratio whose spread the whole-step tables cannot resolve. Besides
× dense (median over median), every phase has the ratio paired by round (a method's time over
dense's in the same round; median and quartiles over the rounds).

A phase a method does not run is 0 (e.g. kl_predict without step control, sync with the ``shared``
engine, old_logprobs with one PPO epoch). The reward computation (math-verify in worker processes,
the same for every method) is not part of the timed step.

What is fixed so that every repeat times a comparable step: the prompts (the first
``prompts_per_step`` problems of the task's train split), the completion length (every completion
runs to ``rollout.max_new_tokens``: EOS is suppressed through ``generation_config.min_new_tokens``,
since otherwise generation time follows the policy's answer length), the sampling seed (reset before
each rollout), and the training batch (``experiments.memory.step_bench.fixed_rollouts``: the same
prompts, each ``group_size`` times in group-major order like the rollout's, with seeded random
completions of that length and fixed advantages spread over [−1, 1], so every row trains). Weights and optimizer state are *not* reset between repeats: each repeat is the
method's next real update on the same batch (a fresh projection A for logra, advanced moments), and
none of the phases' costs depends on the values. ``step_control.measure_realized`` is forced off (it is
a diagnostic forward pass, not part of the method).

Shapes default to the quick profile's (``profile=quick``: the ``base`` of experiments/sweeps/quick.yaml
— 4 prompts × 4 samples, 40 new tokens, one micro-batch of 16, the ``hf`` engine); ``profile=none``
starts from the run-config defaults; any ``key=value`` after that overrides every method. A method
name may carry overrides after a colon (``logra:step_control.enabled=false``, space-separated).

Writes ``<out>/time.csv`` (one row per method and phase: median, quartiles, min, max over the repeats,
× dense of the median), ``<out>/time.json`` (command, git sha, torch version, threads, device,
settings, every repeat's seconds) and ``<out>/time.png``/``.pdf`` (stacked bars of the phase
medians); prints the table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

PHASES = ["rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync"]
COLUMNS = ["method", "model", "device", "phase", "median_s", "q25_s", "q75_s", "min_s", "max_s", "repeats", "x_dense",
           "x_dense_paired", "x_dense_paired_q25", "x_dense_paired_q75", "git_sha"]
STEP_KINDS = ("all", "rollout")
DEFAULT_METHODS = ("dense,galore,lora,logra:step_control.enabled=false,logra:step_control.enabled=true,"
                   "logra:step_control.enabled=true logra.embeddings=true")
@dataclass
class TimeTableArgs:
    out: str = "results/time_table"  # output folder: time.csv, time.json, time.png/.pdf
    methods: str = DEFAULT_METHODS  # methods, each with optional overrides: logra:step_control.enabled=false
    model: str = "smollm2-135m-instruct"  # model.name of every run
    repeats: int = 5  # timed rounds (the order rotated every round)
    warmup: int = 1  # untimed steps per method first
    profile: str = "quick"  # the sweep whose base gives the step's shapes (none: the run config's defaults)
    phases: str = "all"  # all: whole steps | rollout: only the rollout phase each round (no update: many cheap rounds for one ratio)


KEYS = {k: str(v) for k, v in asdict(TimeTableArgs()).items()}
# Keys of a sweep's base that do not shape one step (how long a run is, evaluation, checkpoints, logging),
# and the model (the ``model=`` key of this tool).
NOT_SHAPE = ("model.name", "train.steps", "eval.", "checkpoint.", "log.", "step_control.measure_realized")


def profile_overrides(profile: str) -> list[str]:
    """The ``base`` of ``experiments/sweeps/<profile>.yaml`` as ``key=value`` overrides (shape keys only)."""
    if profile in ("", "none"):
        return []
    import yaml

    from experiments.launcher.sweep import flatten

    path = Path(__file__).resolve().parent / "sweeps" / f"{profile}.yaml"
    if not path.exists():
        raise SystemExit(f"profile={profile!r}: no {path}")
    base = flatten((yaml.safe_load(path.read_text()) or {}).get("base") or {})
    return [f"{k}={json.dumps(v) if isinstance(v, (list, dict, bool)) else v}" for k, v in base.items()
            if not any(k == n or (n.endswith(".") and k.startswith(n)) for n in NOT_SHAPE)]


class StepTimer:
    """Times one method's GRPO steps by phase, through the trainer's own phases."""

    def __init__(self, spec: str, args: dict, tmp: str):
        from experiments.config import build_config
        from experiments.memory.step_bench import fixed_rollouts
        from experiments.rl.trainer import GRPOTrainer

        method, _, extra = spec.partition(":")
        self.spec = spec
        cfg = build_config([f"method={method}", f"model={args['model']}", f"out_dir={tmp}/{len(list(Path(tmp).iterdir()))}",
                            *args["overrides"], *[e for e in extra.split() if e],
                            "step_control.measure_realized=false", "log.progress=false", "eval.every=0"])
        self.trainer = tr = GRPOTrainer(cfg)
        tc = tr.cfg.train
        model = getattr(tr.engine, "model", None)
        if model is None:
            raise SystemExit(f"{spec}: rollout.engine={tr.cfg.rollout.engine} has no in-process model whose "
                             "generation length can be fixed; use shared or hf")
        model.generation_config.min_new_tokens = tr.cfg.rollout.max_new_tokens  # every completion is full length
        self.prompts = tr._prompts(tr.train_problems[: tc.prompts_per_step])
        n = tc.prompts_per_step * tc.group_size
        self.batch = fixed_rollouts(tr.tokenizer, n, tr.cfg.rollout.max_new_tokens, group=tc.group_size)
        self.advantages, self.keep = torch.linspace(-1.0, 1.0, n), torch.ones(n, dtype=torch.bool)
        self.times: dict[str, float] = {}
        original = tr._phase

        @contextmanager
        def timed(name: str):
            self._sync()
            t0 = time.perf_counter()
            with original(name):
                yield
            self._sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

        tr._phase = timed  # the trainer calls self._phase(...): every phase of _optimize is timed
        tr.sync(full=True)

    def _sync(self) -> None:
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)

    def step(self, seed: int, update: bool = True) -> dict[str, float]:
        """One step (rollout on the fixed prompts, then the update on the fixed batch): seconds per phase.
        ``update=False``: the rollout only (every other phase 0)."""
        tr = self.trainer
        self.times = {}
        torch.manual_seed(seed)
        self._sync()
        t0 = time.perf_counter()
        with tr._phase("rollout"), tr.dist.full_weights(tr.model):
            tr.dist.generate(tr.engine, self.prompts, tr.cfg.train.group_size, tr.step)
        if update:
            tr._optimize(self.batch, self.advantages, self.keep)
        self._sync()
        total = time.perf_counter() - t0
        tr.step += 1
        out = {p: self.times.get(p, 0.0) for p in PHASES}
        out["optimizer"] -= out["kl_predict"]  # the trainer nests kl_predict inside the optimizer phase
        out["step"] = total
        return out

    def close(self) -> None:
        self.trainer.close()


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def summarize(samples: dict[str, list[dict]], model: str, device: str, sha: str) -> list[dict]:
    """One row per method and phase: median, quartiles, min, max over the repeats, × dense (median over
    median), and the ratio paired by round (this method's time over dense's in the same round: median
    and quartiles over the rounds; the rounds' drift of the host falls on both sides of each ratio)."""
    rows = []
    for spec, reps in samples.items():
        for phase in PHASES + ["step"]:
            v = [r[phase] for r in reps]
            rows.append({"method": spec, "model": model, "device": device, "phase": phase,
                         "median_s": statistics.median(v), "q25_s": _quantile(v, 0.25), "q75_s": _quantile(v, 0.75),
                         "min_s": min(v), "max_s": max(v), "repeats": len(v), "git_sha": sha})
    dense = {r["phase"]: r["median_s"] for r in rows if r["method"] == "dense"}
    for r in rows:
        ref = dense.get(r["phase"])
        r["x_dense"] = r["median_s"] / ref if ref else float("nan")
        pairs = [a[r["phase"]] / b[r["phase"]] for a, b in zip(samples[r["method"]], samples.get("dense", []))
                 if b[r["phase"]] > 0]
        r["x_dense_paired"], r["x_dense_paired_q25"], r["x_dense_paired_q75"] = (
            (statistics.median(pairs), _quantile(pairs, 0.25), _quantile(pairs, 0.75)) if pairs else (float("nan"),) * 3)
    return rows


def figure(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.render import save_png_pdf

    methods = list(dict.fromkeys(r["method"] for r in rows))
    med = {(r["method"], r["phase"]): r["median_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(1.4 * len(methods) + 2, 4))
    bottom = [0.0] * len(methods)
    for phase in PHASES:
        vals = [med[(m, phase)] for m in methods]
        if any(vals):
            ax.bar(methods, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(methods, [med[(m, "step")] for m in methods], marker="_", s=400, color="k", label="whole step", zorder=3)
    ax.set_ylabel("seconds (median over repeats)")
    ax.set_title(f"one GRPO step by phase, {rows[0]['model']} ({rows[0]['device']})")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=7)
    save_png_pdf(fig, out / "time.png", dpi=None)  # and its .pdf; closes the figure


def print_table(rows: list[dict]) -> None:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["phase"]): r for r in rows}
    cols = PHASES + ["step"]
    print(f"{'seconds (median)':<58}" + "".join(f"{p:>13}" for p in cols))
    for m in methods:
        print(f"{m:<58}" + "".join(f"{by[(m, p)]['median_s']:>13.3f}" for p in cols))
    print(f"{'× dense (median / median)':<58}")
    for m in methods:
        print(f"{m:<58}" + "".join(f"{by[(m, p)]['x_dense']:>13.3f}" for p in cols))
    print(f"{'× dense paired by round: median [q25, q75]':<58}")
    for m in methods:
        print(f"{m:<58}" + "".join(f"{_paired(by[(m, p)]):>17}" for p in cols))


def _paired(row: dict) -> str:
    if row["x_dense_paired"] != row["x_dense_paired"]:  # nan: no pairs
        return "nan"
    return f"{row['x_dense_paired']:.3f}[{row['x_dense_paired_q25']:.2f},{row['x_dense_paired_q75']:.2f}]"


def rotation(items: list, r: int) -> list:
    """Round r's order: the list rotated by r (A B C, B C A, C A B, ...). Over n rounds every method
    takes every position once, and no method ever steps twice in a row across a round boundary —
    which the earlier A…F, F…A order did for the first and last method (the two fastest rollouts of
    the first committed table: a method stepping right after itself may find its memory warm)."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from baselines import METHODS
    from experiments.common.cli import fail, parse_methods, parse_tool
    from experiments.common.config import ConfigError
    from experiments.config import run_keys

    try:
        args, overrides = parse_tool(TimeTableArgs, argv, __doc__, run_keys)
        parse_methods(args["methods"], known=METHODS)
    except ConfigError as e:
        return fail(e, "experiments.time_table")
    args["overrides"] = profile_overrides(args["profile"]) + overrides
    from experiments.common.provenance import git_sha, write_results

    sha = git_sha()  # the code this run imports: read before it runs

    specs = [m.strip() for m in args["methods"].split(",") if m.strip()]
    repeats, warmup = int(args["repeats"]), int(args["warmup"])
    if repeats < 1 or warmup < 0:
        raise SystemExit("repeats must be >= 1 and warmup >= 0")
    if args["phases"] not in STEP_KINDS:
        raise SystemExit(f"phases={args['phases']!r}: one of {', '.join(STEP_KINDS)}")
    update = args["phases"] == "all"
    samples: dict[str, list[dict]] = {s: [] for s in specs}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        timers = []
        for s in specs:
            timers.append(StepTimer(s, args, tmp))
            stack.callback(timers[-1].close)
        device = str(timers[0].trainer.device)
        for w in range(warmup):
            for t in timers:
                t.step(seed=w, update=update)
        for r in range(repeats):
            for t in rotation(timers, r):
                samples[t.spec].append(t.step(seed=1000 + r, update=update))  # the same seed for every method in a round
                print(f"[time_table] round {r + 1}/{repeats} {t.spec}: step {samples[t.spec][-1]['step']:.3f} s", flush=True)
    rows = summarize(samples, args["model"], device, sha)
    out = Path(args["out"])
    meta = {"command": "python -m experiments.time_table " + " ".join(argv), "git_sha": sha, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": device,
            "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
            "settings": args, "phases": PHASES + ["step"], "samples": samples}
    write_results(out, "time", rows, meta, COLUMNS)
    figure(rows, out)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
