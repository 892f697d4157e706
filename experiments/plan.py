"""Does it fit? ``python -m experiments.plan model=<preset|HF name|config.json> method=<...> [gpus=8]
[gpu_mem_gb=80] [micro_batch=1] [seq_len=1024] [rank=256] [sharding=none|fsdp|zero2|zero3]
[rollout=colocated|none|<share>] [dtype=bf16] [completion_len=...] [micro_batches=2] [logprob_chunk=256]
[gradient_checkpointing=true] [master_weights=true|false] [embeddings=false] [padded=true] [attention=sdpa|eager]
[rollout_share=0.3] [other_gb=1.0]``

Prints the predicted per-GPU bytes by category, where the peak is (and the other candidate peaks),
every term alive there with its assumption, and the verdict (experiments/memory/planner.py).
``method=dense,logra`` plans several methods; ``--list`` shows the presets.
"""

from __future__ import annotations

import sys

from experiments.memory.planner import plan, presets

INTS = {"gpus", "micro_batch", "seq_len", "rank", "logprob_chunk", "completion_len", "micro_batches"}
FLOATS = {"gpu_mem_gb", "rollout_share", "other_gb"}
BOOLS = {"gradient_checkpointing", "master_weights", "embeddings", "padded"}


def parse(argv: list[str]) -> dict:
    args = {}
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq:
            raise SystemExit(f"expected key=value, got {a!r} (see --help)")
        if key in INTS:
            args[key] = int(value)
        elif key in FLOATS:
            args[key] = float(value)
        elif key in BOOLS:
            if value.lower() not in ("true", "false"):
                raise SystemExit(f"{key} must be true or false, got {value!r}")
            args[key] = value.lower() == "true"
        else:
            args[key] = value
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    if "--list" in argv:
        print("\n".join(presets()))
        return 0
    args = parse(argv)
    if "model" not in args or "method" not in args:
        raise SystemExit("model=... and method=... are required (see --help)")
    model, methods = args.pop("model"), args.pop("method").split(",")
    try:
        plans = [plan(model, m, **args) for m in methods]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print("\n\n".join(p.table() for p in plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
