"""Memory of one GRPO training step per method, each in a fresh process, by category.

    python -m experiments.memory_table [out=results/memory_table] [methods=dense,galore,galore_layerwise,lora,logra]
        [model=smollm2-135m-instruct] [seqs=8] [micro_batch=4] [completion_len=128] [steps=2] [trace=false] [pad=0]
        [run-config key=value ...]        (--help lists the keys)

Every method trains on the same fixed rollout batch (``experiments.memory.step_bench.fixed_rollouts``:
arith prompts, seeded random completions, fixed advantages) through the trainer's own code
(``accumulate_gradients`` then the method's ``step``), ``steps`` updates so that optimizer state
exists. Inside the child the tensor-accounting profiler (``experiments.memory.profiler``) records the
peak of live tensor bytes, the phase it happened in, and its split into params / grads / optimizer
state (moments, sketches, projectors, masters) / activations+other; the process's peak RSS is
reported beside it. A method may carry its own run-config overrides after a colon, space-separated
(``experiments.common.cli.parse_methods``): ``methods="dense:dense.precision=mixed,dense:dense.precision=bf16,
logra:logra.master=stochastic logra.embeddings=true"``. ``trace=1`` also writes ``<out>/trace_<method>.txt``:
every storage alive at the peak, grouped by the op that made it and its shape. ``pad=<n>``: every
other prompt gets n more tokens and the rest are left-padded (every micro-batch has a padding mask).

Writes ``<out>/memory.csv`` (columns below), ``<out>/memory.png`` and ``.pdf`` (stacked bars), and
``<out>/memory.json`` (command, git sha, settings, per-phase peaks); prints the table.
``planner_bytes`` is ``experiments.memory.planner.plan`` asked for the same model, method, dtype and
shapes (micro-batch, prompt + completion length, completion length, micro-batches per update, LM-head
chunk, checkpointing; one device, no engine, no CUDA slack); ``planner_ratio`` = planner / profiled
peak, ``planner_peak_at`` the planner's candidate peak.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
import os
import subprocess
import sys
from pathlib import Path

import torch

from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError
from experiments.common.provenance import git_sha, write_results

COLUMNS = ["method", "model", "peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
           "peak_rss_bytes", "planner_bytes", "planner_ratio", "planner_peak_at", "peak_phase", "seq_len", "git_sha"]


@dataclass
class MemoryTableArgs:
    out: str = "results/memory_table"  # output folder: memory.csv, memory.json, memory.png/.pdf
    methods: str = "dense,galore,galore_layerwise,lora,logra"  # methods, each with optional overrides: logra:logra.embeddings=true
    model: str = "smollm2-135m-instruct"  # model.name of every run
    seqs: int = 8  # sequences in the fixed rollout batch
    micro_batch: int = 4  # sequences per forward/backward
    completion_len: int = 128  # completion tokens per sequence
    steps: int = 2  # updates per method (the second has optimizer state)
    trace: bool = False  # also write trace_<method>.txt: every storage alive at the peak
    pad: int = 0  # n > 0: every other prompt n tokens longer, the rest left-padded (a padding mask)


KEYS = {k: str(v) for k, v in asdict(MemoryTableArgs()).items()}  # the settings as the child reads them


def child(spec: str, args: dict) -> dict:
    import tempfile

    from baselines import METHODS
    from experiments.config import build_config
    from experiments.memory.planner import plan
    from experiments.memory.profiler import MemoryProfiler, optimizer_tensors
    from experiments.memory.step_bench import fixed_rollouts
    from experiments.rl.metrics import peak_rss_bytes
    from experiments.rl.trainer import GRPOTrainer

    entry = parse_methods(spec)[0]
    method = entry.method
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config([f"model={args['model']}", f"out_dir={tmp}/run", "log.progress=false",
                            "eval.every=0", *args["overrides"], *entry.run_overrides()])
        trainer = GRPOTrainer(cfg)
        seqs, mb = int(args["seqs"]), int(args["micro_batch"])
        rollouts = fixed_rollouts(trainer.tokenizer, seqs, int(args["completion_len"]), pad=int(args.get("pad", 0)))
        advantages, rows = torch.linspace(-1.0, 1.0, seqs), torch.arange(seqs)
        prof = MemoryProfiler(trainer.model, lambda: optimizer_tensors(trainer.method, trainer.model),
                              trace=str(args["trace"]).lower() not in ("0", "false", ""))
        with prof:
            for _ in range(int(args["steps"])):
                trainer.method.zero_grad()
                with prof.phase("fwd_bwd"):
                    trainer.accumulate_gradients(rollouts, advantages, [rows[i: i + mb] for i in range(0, seqs, mb)])
                with prof.phase("optimizer"):
                    trainer.method.step()
        trainer.close()
        rec = prof.record()
        if prof.trace:
            _write_trace(prof, Path(args["out"]) / f"trace_{spec.replace(':', '_').replace('=', '_')}.txt")
        seq_len = rollouts.prompt_ids.shape[1] + rollouts.completion_ids.shape[1]
        try:
            p = plan(args["model"], method, micro_batch=mb, seq_len=seq_len, completion_len=rollouts.completion_ids.shape[1],
                     micro_batches=-(-seqs // mb), **{"rank": 64, **METHODS[method].plan_options(cfg[method])},
                     dtype={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[cfg.model.dtype], rollout="none",
                     other_gb=0.0, gradient_checkpointing=bool(cfg.model.gradient_checkpointing),
                     device="cpu", step_control=False, phases=("fwd_bwd", "optimizer"),  # what the child runs: no rollout, no control
                     logprob_chunk=int(cfg.train.logprob_chunk),
                     padded=bool((rollouts.prompt_mask == 0).any()))
            planned, planned_at, candidates = p.total_bytes, p.peak_at, p.candidates
        except ValueError:
            planned, planned_at, candidates = "", "", {}
    return {"method": spec, "model": args["model"], "peak_bytes": int(rec["mem/tensor_peak_bytes"]),
            **{f"{k}_bytes": int(rec[f"mem/{k}_bytes"]) for k in ("params", "grads", "optimizer", "activations")},
            "peak_rss_bytes": peak_rss_bytes(), "planner_bytes": planned,
            "planner_ratio": round(planned / rec["mem/tensor_peak_bytes"], 4) if planned != "" else "", "planner_peak_at": planned_at,
            "seq_len": seq_len, "peak_phase": prof.peak_phase, "planner_candidates": candidates,
            "phases": {k: v for k, v in rec.items() if k.count("/") == 2}}


def _write_trace(prof, path: Path) -> None:
    """The live storages at the peak, grouped by (category, creating op, shape, dtype), largest first."""
    from collections import Counter

    groups, nbytes = Counter(), Counter()
    for cat, op, shape, dtype, n in prof.peak_tensors:
        groups[(cat, op, shape, dtype)] += 1
        nbytes[(cat, op, shape, dtype)] += n
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"peak {prof.peak} bytes in phase {getattr(prof, 'peak_phase', None)}; split {prof.peak_split}"]
    lines += [f"{nbytes[k]:>12} {groups[k]:>5}x {k[0]:<11} {k[1]:<40} {k[2]} {k[3]}" for k in sorted(nbytes, key=lambda k: -nbytes[k])]
    path.write_text("\n".join(lines) + "\n")


def figure(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.render import save_png_pdf

    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
    bottom = [0.0] * len(rows)
    for cat in ("params", "grads", "optimizer", "activations"):
        vals = [r[f"{cat}_bytes"] / 2**20 for r in rows]
        ax.bar([r["method"] for r in rows], vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB at the step's peak (live tensors)")
    ax.set_title(f"one GRPO step, {rows[0]['model']}")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    save_png_pdf(fig, out / "memory.png", dpi=None)  # and its .pdf; closes the figure


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    child_spec = argv.pop(1) if argv and argv[0] == "--child" else None
    if child_spec is not None:
        argv.pop(0)
    from baselines import METHODS
    from experiments.config import run_keys

    try:
        parsed, overrides, _ = parse(MemoryTableArgs, argv, doc=__doc__, run_keys=run_keys)
        specs = parse_methods(parsed.methods, known=METHODS)
    except ConfigError as e:
        if "unknown method" in str(e):
            raise SystemExit(str(e)) from None
        return fail(e, "experiments.memory_table")
    args = {**{k: str(v) for k, v in asdict(parsed).items()}, "overrides": overrides}
    if child_spec is not None:
        print("RESULT " + json.dumps(child(child_spec, args)))
        return 0
    specs = [s.label for s in specs]
    from tqdm import tqdm

    rows, sha = [], git_sha()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for spec in tqdm(specs, desc="memory_table", unit="method"):
        proc = subprocess.run([sys.executable, "-m", "experiments.memory_table", "--child", spec, *argv],
                              capture_output=True, text=True, env=env)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{spec}: the child process failed (exit {proc.returncode})")
        rows.append({**json.loads(lines[-1][7:]), "git_sha": sha})
    out = Path(args["out"])
    write_results(out, "memory", rows, {"command": "python -m experiments.memory_table " + " ".join(argv),
                                        "git_sha": sha, "settings": args, "rows": rows}, COLUMNS)
    figure(rows, out)
    base = rows[0]["peak_bytes"]
    mib = 2**20
    print(f"{'method':<34}{'peak':>8}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'RSS':>8}{'planner':>9}"
          f"{'pl/meas':>8}{'/first':>8}  (MiB)")
    for r in rows:
        pl = f"{r['planner_bytes'] / mib:>9.1f}{r['planner_ratio']:>8.3f}" if r["planner_bytes"] != "" else f"{'-':>9}{'-':>8}"
        print(f"{r['method']:<34}{r['peak_bytes'] / mib:>8.1f}{r['params_bytes'] / mib:>8.1f}{r['grads_bytes'] / mib:>8.1f}"
              f"{r['optimizer_bytes'] / mib:>8.1f}{r['activations_bytes'] / mib:>8.1f}{r['peak_rss_bytes'] / mib:>8.1f}"
              f"{pl}{r['peak_bytes'] / base:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
