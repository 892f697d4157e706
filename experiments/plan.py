"""Does it fit? ``python -m experiments.plan model=<preset|HF name|config.json> methods=<name,...> [key=value ...]``

Prints the predicted per-GPU bytes by category, where the peak is (and the other candidate peaks),
every term alive there with its assumption, and the verdict (experiments/memory/planner.py).
``methods=dense,logra`` plans several methods side by side; ``--list`` shows the presets.

Example:
    python -m experiments.plan model=gemma-2-27b methods=dense,logra gpus=8 gpu_mem_gb=80 micro_batch=4 \\
        seq_len=1536 completion_len=1024 micro_batches=16 rank=256 sharding=fsdp
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError
from experiments.memory.planner import plan, presets


@dataclass
class PlanArgs:
    model: str = ""  # a planner preset (--list), an HF hub name or a config.json path (required)
    methods: str = "dense,logra"  # the methods to plan, comma-separated (the planner's knobs are the keys below)
    gpus: int = 1  # GPUs the run is sharded / replicated over
    gpu_mem_gb: float = 80.0  # memory of one GPU, GB
    micro_batch: int = 1  # sequences per forward/backward
    seq_len: int = 1024  # prompt + completion tokens of a sequence (padded)
    rank: int = 256  # LoGRA sketch rank, GaLore rank, or LoRA r
    sharding: str = "none"  # none | fsdp | zero2 | zero3
    rollout: str = "colocated"  # colocated (a vLLM engine shares the GPU) | none | a share of the GPU
    dtype: str = "bf16"  # bf16 | fp16 | fp32 parameters
    completion_len: Optional[int] = None  # tokens per sequence through the LM head; default: seq_len
    micro_batches: Optional[int] = None  # micro-batches per update; default 2 (earlier gradients alive in the last backward)
    logprob_chunk: Optional[int] = None  # the harness' train.logprob_chunk; default 256; 0 = full logits
    gradient_checkpointing: Optional[bool] = None  # activation checkpointing; default true
    master_weights: Optional[bool] = None  # fp32 master + moments for bf16/fp16; default true (false: the harness' plain AdamW)
    embeddings: Optional[bool] = None  # logra sketches the embedding and a tied head; default false
    padded: Optional[bool] = None  # prompts of different lengths (a padding mask); default true
    attention: Optional[str] = None  # sdpa | eager; default eager for Gemma-2, else sdpa
    rollout_share: Optional[float] = None  # fraction of the GPU a colocated vLLM engine reserves; default 0.3
    other_gb: Optional[float] = None  # CUDA context and allocator slack, GB; default 1.0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, _, flags = parse(PlanArgs, argv, doc=__doc__, flags=("--list",))
        if "--list" in flags:
            print("\n".join(presets()))
            return 0
        if not args.model:
            raise ConfigError("model=... is required (a preset, --list shows them)")
        specs = parse_methods(args.methods)
        if any(s.overrides for s in specs):
            raise ConfigError("plan takes the planner's knobs as its own keys (rank=, embeddings=, ...), "
                              "not as run-config overrides after the method name")
    except ConfigError as e:
        return fail(e, "experiments.plan")
    kwargs = {k: v for k, v in vars(args).items() if v is not None and k not in ("model", "methods")}
    try:
        plans = [plan(args.model, s.method, **kwargs) for s in specs]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print("\n\n".join(p.table() for p in plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
