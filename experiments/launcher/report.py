"""What the launcher prints and leaves behind: the plan (``--dry-run``), the planner's memory
prediction per job, the final summary, and ``<root>/summary.csv`` (one row per run)."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path
from typing import Optional

from experiments.launcher.outcomes import Outcome
from experiments.launcher.slurm import render_sbatch
from experiments.launcher.torchrun import torchrun_command
from experiments.common.config import flatten
from experiments.launcher.sweep import Run, Sweep, dotlist_value

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def plan_memory(run: Run, sweep: Sweep, launcher: dict) -> str:
    """One line: the planner's per-GPU prediction for this job (experiments.memory.planner)."""
    try:
        from experiments.memory.planner import plan
    except ImportError as e:
        return f"memory plan unavailable: experiments.memory.planner cannot be imported ({e})"
    cfg, opts = run.cfg, dict(sweep.planner)
    models = opts.pop("models", {}) or {}
    from baselines import METHODS

    method_opts = METHODS[cfg.method].plan_options(cfg[cfg.method])  # e.g. rank from logra.rank / lora.r
    gpus = int(launcher.get("gpus_per_node") or 1) * int(launcher.get("nodes") or 1)
    kwargs = {"gpus": gpus, "micro_batch": int(cfg.train.micro_batch_size), "rank": int(opts.pop("rank", 256)),
              "dtype": DTYPES.get(cfg.model.dtype, cfg.model.dtype), **opts, **method_opts}
    kwargs.setdefault("seq_len", 1024)
    strategy = cfg.get("dist", {}).get("strategy", "ddp") if gpus > 1 else "ddp"  # the job's own sharding
    kwargs.setdefault("sharding", {"fsdp2": "fsdp", "deepspeed": "zero2"}.get(strategy, "none"))
    # the job's own shapes: completion tokens through the LM head, micro-batches per update, head chunk, checkpointing
    kwargs.setdefault("completion_len", min(int(cfg.rollout.max_new_tokens), int(kwargs["seq_len"])))
    per_gpu = int(cfg.train.prompts_per_step) * int(cfg.train.group_size) / gpus
    kwargs.setdefault("micro_batches", max(1, -(-int(per_gpu) // int(cfg.train.micro_batch_size))))
    kwargs.setdefault("logprob_chunk", int(cfg.train.logprob_chunk))
    kwargs.setdefault("gradient_checkpointing", bool(cfg.model.gradient_checkpointing))
    kwargs.setdefault("engine", {"vllm": "vllm", "hf": "hf", "hf_process": "none"}.get(cfg.rollout.engine, "shared"))
    kwargs.setdefault("reference_model", float(cfg.train.kl_coef) > 0)  # a frozen copy for the KL penalty
    if cfg.rollout.engine == "vllm":  # the engine as the job builds it (rollout.vllm.*)
        vllm = dict(cfg.rollout.vllm)
        vllm["max_num_seqs"] = vllm["max_num_seqs"] or int(cfg.rollout.batch_size)
        kwargs.setdefault("vllm", vllm)
    control = cfg.get("step_control", {}).get("enabled")
    kwargs.setdefault("step_control", METHODS[cfg.method].step_control_default if control is None else bool(control))
    try:
        p = plan(models.get(cfg.model.name, cfg.model.name), cfg.method, **kwargs)
    except Exception as e:  # noqa: BLE001  (a dry run reports, it does not stop)
        return f"memory plan failed: {type(e).__name__}: {e}"
    return plan_line(p)


def plan_line(p) -> str:
    """The plan in one line: the peak phase, every phase's GiB per GPU, and the engine as built."""
    gib = 2**30
    verdict = "fits" if p.fits else "DOES NOT FIT"
    phases = ", ".join(f"{name} {v / gib:.1f}" + ("" if v <= p.capacity_bytes else " (DOES NOT FIT)")
                       for name, v in p.phase_bytes().items())
    line = (f"planned peak {p.total_bytes / gib:.1f} / {p.capacity_bytes / gib:.0f} GiB per GPU in {p.peak_phase}, "
            f"{verdict}; per phase (GiB): {phases}")
    if p.engine:
        need = sum(t.nbytes for t in p.engine)
        line += (f"; rollout engine as built {need / gib:.1f} GiB in its {p.engine_share / gib:.1f} GiB share: "
                 + ("fits" if p.engine_fits else "DOES NOT FIT") + " ("
                 + ", ".join(f"{t.name} {t.nbytes / gib:.1f}" for t in p.engine) + ")")
    return line


def print_plan(sweep: Sweep, runs: list[Run], launcher: dict, show_memory: bool) -> None:
    name = launcher.get("name", "local")
    todo = [r for r in runs if not r.done]
    print(f"sweep {sweep.name} ({sweep.path}): {len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} to run; "
          f"launcher {name}; root {sweep.root}")
    base = [f"config={sweep.config}"] if sweep.config else []
    base += [f"{k}={dotlist_value(v)}" for k, v in flatten(sweep.base).items()]
    print("every run: " + " ".join(shlex.quote(b) for b in base))
    gpus, nodes = int(launcher.get("gpus_per_node") or 1), int(launcher.get("nodes") or 1)
    for run in runs:
        state = "done -> skip" if run.done else ("resume" if run.started else "new")
        print(f"  [{state:>12}] {run.run_dir}")
        print("                 " + " ".join(shlex.quote(f"{k}={dotlist_value(v)}") for k, v in run.settings.items()))
        if show_memory:
            print("                 " + plan_memory(run, sweep, launcher))
    if (gpus > 1 or nodes > 1) and runs:
        first = runs[0]
        print(f"\neach job runs {gpus} GPUs x {nodes} node(s) through torchrun, e.g. {first.label}:")
        print("    " + " ".join(shlex.quote(c) if not c.startswith("--rdzv_endpoint") else c
                                for c in torchrun_command(first.overrides + [f"out_dir={first.run_dir}", "resume=true"], gpus, nodes)))
    if name == "slurm" and todo:
        print(f"\nsbatch script of the first job to run ({todo[0].label}):")
        print("    " + render_sbatch(todo[0], launcher).replace("\n", "\n    "))
    for step in sweep.after:
        print(f"then: {step.get('name', step['module'])}: python -m {step['module']} {' '.join(after_args(step, sweep))}")


def after_args(step: dict, sweep: Sweep) -> list[str]:
    return [str(a).format(root=sweep.root) for a in step.get("args", [])]


def print_summary(outcomes: list[Outcome], skipped: list[Run]) -> None:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    if skipped:
        counts["skipped"] = len(skipped)
    print("summary: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    for o in outcomes:
        if o.status in ("failed", "preempted"):
            print(f"  {o.status}: {o.run.label}: {o.detail}\n    log: {o.log}")
    if any(o.status in ("failed", "preempted") for o in outcomes):
        print("rerun the same command to run only the incomplete runs (they resume from their checkpoints)")


def write_summary_csv(root: Path, runs: list[Run], outcomes: list[Outcome]) -> Optional[Path]:
    """``<root>/summary.csv``: a row per run (status, dir, and analysis.summary's fields when it ran)."""
    from analysis.summary import COLUMNS, summarize

    status = {o.run.run_dir: o.status for o in outcomes}
    rows = []
    for run in runs:
        row = {"name": run.name, "hash": run.key, "status": "done" if run.done else status.get(run.run_dir, "not run"),
               "run_dir": str(run.run_dir)}
        try:
            row.update(summarize(run.run_dir))
        except (OSError, KeyError, ValueError):
            pass
        rows.append(row)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "summary.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["name", "hash", "status", "run_dir"] + [c for c in COLUMNS if c != "run"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path
