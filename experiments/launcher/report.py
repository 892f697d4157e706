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
    try:
        p = plan(models.get(cfg.model.name, cfg.model.name), cfg.method, **kwargs)
    except Exception as e:  # noqa: BLE001  (a dry run reports, it does not stop)
        return f"memory plan failed: {type(e).__name__}: {e}"
    gib = 2**30
    cats = ", ".join(f"{k} {v / gib:.1f}" for k, v in p.categories.items())
    verdict = "fits" if p.fits else "DOES NOT FIT"
    line = f"planned {p.total_bytes / gib:.1f} / {p.capacity_bytes / gib:.0f} GiB per GPU, {verdict} ({cats} GiB)"
    if kwargs.get("sharding") == "fsdp" and gpus > 1:
        line += fsdp2_note(run, p, models.get(cfg.model.name, cfg.model.name), kwargs, gpus)
    return line


def fsdp2_note(run: Run, p, model, kwargs: dict, gpus: int) -> str:
    """What the planner's fsdp sharding does not model for a dist.strategy=fsdp2 job (docs/distributed.md):
    an engine copy per rank holds the whole weights (tensor_parallel_size=1), and step control predicts
    on the weights gathered whole (FSDP2.predict_kl), after backward's activations are freed."""
    from experiments.memory.planner import DTYPE_BYTES, load_model_config, shapes

    gib, cfg = 2**30, run.cfg
    weights = shapes(load_model_config(model)[1]).total * DTYPE_BYTES[kwargs["dtype"]]
    notes, fits = [], p.fits
    share = p.categories.get("rollout", 0)
    if cfg.rollout.engine != "shared" and share:
        ok = weights < share  # vLLM's weights and its KV cache share the reserve
        notes.append(f"engine copy {weights / gib:.1f} GiB in the {share / gib:.1f} GiB rollout share"
                     + (f" ({(share - weights) / gib:.1f} GiB left for the KV cache)" if ok
                        else ": DOES NOT FIT at tensor_parallel_size=1"))
        fits &= ok
    control = cfg.get("step_control", {}).get("enabled")
    from baselines import METHODS

    if METHODS[cfg.method].step_control_default if control is None else control:
        at_predict = p.total_bytes - p.categories.get("activations", 0) + weights - weights // gpus
        ok = at_predict <= p.capacity_bytes
        notes.append(f"step control gathers the weights: {at_predict / gib:.1f} GiB at the prediction"
                     + ("" if ok else " DOES NOT FIT"))
        fits &= ok
    return f"; fsdp2: {'; '.join(notes)} -> {'fits' if fits else 'DOES NOT FIT'}" if notes else ""


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
