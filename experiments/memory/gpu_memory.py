"""Real CUDA peaks of one training step, dense AdamW vs LoGRA, for random-initialized architectures
in bf16, beside the planner's prediction. Needs a CUDA GPU (not run in this repository's CI).

    python -m experiments.memory.gpu_memory [models=qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b] [methods=dense,logra]
        [micro_batch=1] [seq_len=1024] [rank=256] [out=results/gpu/memory.csv]   (--help: the keys)

Each (model, method) runs in its own process: build the architecture from the planner's preset with
random weights in bf16 on the GPU, activation checkpointing on, one forward/backward of a random
token batch + one optimizer step of the method as the harness builds it (any registered method:
``Method.setup`` with its config's defaults and ``rank`` in its ``rank_key`` field; dense: torch
AdamW with fp32 masters and moments (``dense.precision=mixed``); LoGRA: sketches, row moments, fp32
masters), two updates, ``torch.cuda.max_memory_allocated`` over them. The planner is asked
for the same setting (the method's own options from its config, ``rollout=none other_gb=0``) so both
count the same things. Writes one CSV row per run with the GPU name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.common import provenance
from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError


@dataclass
class GPUMemoryArgs:
    models: str = "qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b"  # planner presets, comma-separated
    methods: str = "dense,logra"  # dense and/or logra (names only: the knobs are the keys here)
    micro_batch: int = 1  # sequences per forward/backward
    seq_len: int = 1024  # tokens per sequence
    rank: int = 256  # LoGRA sketch rank
    out: str = "results/gpu/memory.csv"  # the CSV written (one row per model x method)


KEYS = {k: str(v) for k, v in asdict(GPUMemoryArgs()).items()}


def child(model: str, method: str, a: dict) -> dict:
    import torch
    import transformers

    from experiments.memory.planner import load_model_config, plan

    if not torch.cuda.is_available():
        raise SystemExit("experiments.memory.gpu_memory needs a CUDA GPU")
    dev = torch.device("cuda")
    _, cfg = load_model_config(model)
    hf = {k: v for k, v in cfg.items() if k not in ("source", "model_type")}
    arch = transformers.Gemma2Config if model.startswith("gemma") else transformers.Qwen2Config
    torch.manual_seed(0)
    with torch.device(dev):
        net = transformers.AutoModelForCausalLM.from_config(arch(**hf), dtype=torch.bfloat16)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as the harness
    net.config.use_cache = False
    from baselines import METHODS

    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r}; registered: {', '.join(sorted(METHODS))}")
    cls = METHODS[method]
    runner = cls(cls.config_cls(**({cls.rank_key: int(a["rank"])} if cls.rank_key else {})))
    net = runner.setup(net)
    mb, sl = int(a["micro_batch"]), int(a["seq_len"])
    ids = torch.randint(0, cfg["vocab_size"], (mb, sl), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(2):  # the second step's peak has the optimizer state
        runner.zero_grad()
        runner.backward(net(input_ids=ids, labels=ids).loss)
        runner.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev)
    # the HF loss (labels=ids): full logits over every position, one micro-batch per update, the method's
    # own precision (its config's defaults)
    p = plan(model, method, micro_batch=mb, seq_len=sl, completion_len=sl, micro_batches=1, logprob_chunk=0,
             **{"rank": int(a["rank"]), **cls.plan_options(runner.cfg)}, dtype="bf16", rollout="none", other_gb=0.0,
             gradient_checkpointing=True, device="cuda", step_control=False, phases=("fwd_bwd", "optimizer"))
    return {"gpu": torch.cuda.get_device_name(dev), "model": model, "method": method, "micro_batch": mb, "seq_len": sl,
            "rank": int(a["rank"]), "peak_bytes": peak, "planner_bytes": p.total_bytes, "planner_peak_at": p.peak_at,
            "planner_over_measured": p.total_bytes / peak}


def write_csv(rows: list[dict], out) -> Path:
    """One row per (model, method) run, the columns of the first row (gpu, model, method, ..., planner_over_measured)."""
    return provenance.write_csv(Path(out), rows)


def summary(r: dict) -> str:
    return (f"{r['gpu']} {r['model']:<14} {r['method']:<6} measured {r['peak_bytes'] / 2**30:7.2f} GiB  "
            f"planner {r['planner_bytes'] / 2**30:7.2f} GiB  ({r['planner_over_measured']:.3f}x)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    is_child = argv[:1] == ["--child"]
    try:
        args, _, _ = parse(GPUMemoryArgs, argv[3:] if is_child else argv, doc=__doc__)
        methods = [m.method for m in parse_methods(args.methods, known=("dense", "logra"))]
    except ConfigError as e:
        return fail(e, "experiments.memory.gpu_memory")
    a = {k: str(v) for k, v in asdict(args).items()}
    if is_child:
        print("RESULT " + json.dumps(child(argv[1], argv[2], a)))
        return 0
    rows = []
    for model in a["models"].split(","):
        for method in methods:
            proc = subprocess.run([sys.executable, "-m", "experiments.memory.gpu_memory", "--child", model, method, *argv],
                                  capture_output=True, text=True)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{model} {method}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(lines[-1][7:]))
            print(summary(rows[-1]), flush=True)
    if rows:
        write_csv(rows, a["out"])
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
