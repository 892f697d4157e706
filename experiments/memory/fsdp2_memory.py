"""Per-phase memory of a 2-rank fsdp2 GRPO run on CPU, measured on every rank, beside the planner.

    python -m experiments.memory.fsdp2_memory [model=random:smollm2-135m-instruct] [methods=logra,dense]
        [steps=2] [out=results/fsdp2_memory]        (--help: the keys)

Each method runs as ``torchrun --nproc_per_node=2 -m experiments.train`` with ``dist.strategy=fsdp2`` (gloo),
an ``hf`` rollout engine per rank, step control where the method has it, and ``log.memory_profile=true``:
every rank's tensor-accounting profiler (experiments/memory/profiler.py) records each phase's peak —
the load (``init``), ``rollout``, ``fwd_bwd``, ``kl_predict``, ``optimizer``, ``sync``. The engine copy and
the trainer's tensors are all tensors of the process, so the profiler counts both. The planner
(experiments/memory/planner.py) is asked for the same shapes: 2 GPUs, ``sharding=fsdp``, fp32,
``device=cpu`` (no CUDA reserve, single-tensor AdamW), ``engine=hf``. Writes ``memory.csv`` (a row per
method, phase and rank: measured, planned, ratio), ``memory.md`` and ``memory.json`` (command, git sha,
settings) into ``out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from baselines import METHODS
from experiments.common import provenance
from experiments.common.cli import fail, parse

PHASES = ("init", "rollout", "fwd_bwd", "kl_predict", "optimizer", "sync")


@dataclass
class FSDP2MemoryArgs:
    model: str = "random:smollm2-135m-instruct"  # a model the harness loads (a random preset: real shapes, no download)
    methods: str = "logra,dense"  # methods, comma-separated
    steps: int = 2  # GRPO steps profiled (every phase's peak is the largest over them)
    prompts: int = 2  # prompts per step (one prompt group per rank)
    group: int = 4  # samples per prompt
    new_tokens: int = 24  # completion tokens
    rank: int = 64  # the method's rank where it has one (LoGRA sketch rank)
    out: str = "results/fsdp2_memory"  # the folder written


def run_method(a: FSDP2MemoryArgs, method: str, root: Path) -> Path:
    run = root / method
    overrides = [f"model={a.model}", f"method={method}", "task=arith", "dist.strategy=fsdp2", "rollout.engine=hf",
                 f"train.steps={a.steps}", f"train.prompts_per_step={a.prompts}", f"train.group_size={a.group}",
                 f"train.micro_batch_size={a.group}", "train.skip_zero_advantage=false", "train.logprob_chunk=64",
                 f"rollout.max_new_tokens={a.new_tokens}", "eval.every=0", "checkpoint.every=0", "log.memory_profile=true",
                 "log.progress=false", "threads=1", f"out_dir={run}"]
    rank_key = METHODS[method].rank_key  # the method's rank, where it has one (logra's sketch rank)
    if rank_key:
        overrides += [f"{method}.{rank_key}={a.rank}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "experiments.train",
           *overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stdout + done.stderr).splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback" in line), 0)  # the first rank's error, not the peers' hang-ups
        raise SystemExit(f"{method}: torchrun failed ({done.returncode}):\n" + "\n".join(lines[first : first + 60]))
    return run


def measured(run: Path, rank: int) -> dict[str, float]:
    """Each phase's peak bytes on one rank, the largest over the profiled steps (the load: its own record)."""
    name = "memory_profile.jsonl" if rank == 0 else f"memory_profile_rank{rank}.jsonl"
    out: dict[str, float] = {}
    for line in (run / name).read_text().splitlines():
        rec = json.loads(line)
        for phase in PHASES:
            key = f"mem/{phase}/peak_bytes"
            if key in rec:
                out[phase] = max(out.get(phase, 0.0), rec[key])
    return out


def planned(a: FSDP2MemoryArgs, method: str, run: Path) -> dict[str, int]:
    """The planner's per-phase bytes for the run's own shapes (its config; its rollouts' padded length)."""
    from omegaconf import OmegaConf

    from baselines import METHODS
    from experiments.memory.planner import plan

    cfg = OmegaConf.load(run / "config.yaml")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seq_len = int(max(m["rollout/seq_len"] for m in metrics))
    preset = a.model.split(":", 1)[1] if a.model.startswith("random:") else a.model
    p = plan(preset, method, gpus=2, gpu_mem_gb=80, micro_batch=a.group, seq_len=seq_len, completion_len=a.new_tokens,
             micro_batches=1, sharding="fsdp", dtype="fp32", device="cpu", engine="hf", rollout="none", other_gb=0.0,
             logprob_chunk=64, gradient_checkpointing=False, probe_seqs=a.group,
             **{"rank": a.rank, **METHODS[method].plan_options(cfg[method])})
    return p.phase_bytes()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a, _, _ = parse(FSDP2MemoryArgs, argv, doc=__doc__)
    except Exception as e:  # noqa: BLE001
        fail(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sha = provenance.git_sha()  # of the code that runs, read before it runs and before its outputs land in the tree
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdp2_memory_") as tmp:
        for method in [m.strip() for m in a.methods.split(",") if m.strip()]:
            run = run_method(a, method, Path(tmp))
            plan_bytes = planned(a, method, run)
            for rank in (0, 1):
                got = measured(run, rank)
                for phase in PHASES:
                    if phase in got and phase in plan_bytes:
                        rows.append({"method": method, "phase": phase, "rank": rank, "measured_bytes": int(got[phase]),
                                     "planned_bytes": plan_bytes[phase], "ratio": round(plan_bytes[phase] / got[phase], 4)})
            print(f"{method}: " + ", ".join(f"{r['phase']}@{r['rank']} {r['ratio']}" for r in rows if r["method"] == method), flush=True)
    write(out, a, argv, rows, sha)
    return 0


def write(out: Path, a: FSDP2MemoryArgs, argv: list[str], rows: list[dict], sha: str) -> None:
    import csv

    with (out / "memory.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {"command": "python -m experiments.memory.fsdp2_memory " + " ".join(argv), "git_sha": sha,
            "settings": asdict(a), "torch_threads_per_rank": 1}
    (out / "memory.json").write_text(json.dumps(meta, indent=1) + "\n")
    mib = 2**20
    lines = [f"Per-phase tensor peaks per rank, 2 gloo ranks, fsdp2, {a.model} fp32 (git sha {sha}):", "",
             "| method | phase | rank | measured MiB | planned MiB | planned / measured |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['phase']} | {r['rank']} | {r['measured_bytes'] / mib:,.1f} | {r['planned_bytes'] / mib:,.1f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    (out / "memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
