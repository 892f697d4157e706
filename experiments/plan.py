"""Does it fit? ``python -m experiments.plan model=<preset|HF name|config.json> methods=<name,...> [key=value ...]``

Prints the predicted per-GPU bytes by category, where the peak is (and the other candidate peaks),
every term alive there with its assumption, and the verdict (experiments/memory/planner.py).
``methods=dense,logra`` plans several methods side by side, each entry optionally with its own keys after
``:`` (``methods="dense,dense:precision=bf16,logra:master=stochastic embeddings=true"``); ``--list`` shows
the presets. ``vllm.<key>=`` is the colocated engine's ``rollout.vllm.<key>`` (the paper profile's:
``vllm.sleep=1 vllm.kv_cache_gb=12 vllm.max_num_seqs=64 vllm.max_model_len=1536``), as the dry run passes it.

Example:
    python -m experiments.plan model=gemma-2-27b methods=dense,logra gpus=8 gpu_mem_gb=80 micro_batch=4 \\
        seq_len=1536 completion_len=1024 micro_batches=16 rank=256 sharding=fsdp

Precision (docs/precision.md): ``precision=`` is the baselines' AdamW (mixed: fp32 master + moments; bf16),
``master=`` and ``dense_precision=`` are logra's; a method ignores the others' keys.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError
from experiments.memory.planner import plan, presets
from experiments.rl.vllm_config import VLLMConfig


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
    master_weights: Optional[bool] = None  # AdamW's precision where the next keys are unset: true = mixed (default), false = bf16
    precision: Optional[str] = None  # dense / galore / lora AdamW on a bf16 model: mixed (fp32 master + moments; default) | bf16
    master: Optional[str] = None  # logra's sketched bf16 weights: fp32 (fp32 master, default) | kahan (bf16 compensation) | stochastic | none
    dense_precision: Optional[str] = None  # logra's AdamW of the unsketched tensors: mixed (default) | bf16
    embeddings: Optional[bool] = None  # logra sketches the embedding and a tied head; default false
    padded: Optional[bool] = None  # prompts of different lengths (a padding mask); default true
    attention: Optional[str] = None  # sdpa | eager; default eager for Gemma-2, else sdpa
    rollout_share: Optional[float] = None  # gpu_memory_utilization handed to a colocated vLLM engine; default: what it needs as built
    other_gb: Optional[float] = None  # CUDA context and allocator reserve, GB (an assumption); default 1.0 on cuda, 0 on cpu
    engine: Optional[str] = None  # the rollout engine: vllm (colocated, default with rollout=colocated) | hf (a copy per GPU) | shared | none
    device: Optional[str] = None  # cuda (default: foreach AdamW, the CUDA reserve) | cpu (single-tensor AdamW, no reserve)
    step_control: Optional[bool] = None  # plan the KL-prediction phase; default: the method's (on for logra)
    probe_seqs: Optional[int] = None  # sequences the KL probe reads per GPU; default: a quarter of the rows, at least 12
    reference_model: Optional[bool] = None  # a frozen reference model for a KL penalty (train.kl_coef > 0); default false
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the colocated vLLM engine as built: rollout.vllm.* (vllm.sleep=1 vllm.kv_cache_gb=12 ...); defaults the engine's (max_num_seqs=0: the rows per GPU)
    out: str = ""  # also write one CSV row per entry here (GiB per GPU by category, total, peak, verdict); "" = print only


def entry_args(spec, argv: list[str]) -> PlanArgs:
    """The keys for one ``methods=`` entry: the command line's, then the entry's own after ``:``
    (``dense:precision=bf16``; a run-config spelling ``dense:dense.precision=bf16`` or ``lora:lora.r=8``
    means the same key)."""
    from baselines import METHODS

    own = []
    for o in spec.overrides:
        key, _, value = o.partition("=")
        key = key.removeprefix(f"{spec.method}.")
        if key == getattr(METHODS.get(spec.method), "rank_key", None):
            key = "rank"
        own.append(f"{key}={value}")
    return parse(PlanArgs, [a for a in argv if not a.startswith("-")] + own, doc=__doc__)[0]


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
        entries = [(s, entry_args(s, argv)) for s in specs]
    except ConfigError as e:
        return fail(e, "experiments.plan")
    plans = []
    try:
        for s, a in entries:
            kwargs = {k: v for k, v in vars(a).items() if v is not None and k not in ("model", "methods", "out")}
            kwargs["vllm"] = asdict(a.vllm)  # rollout.vllm.* as a dict, as the dry run passes it
            p = plan(args.model, s.method, **kwargs)
            p.method = s.label
            plans.append(p)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print("\n\n".join(p.table() for p in plans))
    if args.out:
        write_csv(plans, args.out)
    return 0


def write_csv(plans, path) -> None:
    """One row per plan: GiB per GPU by category, weights + grads + optimizer, the total, where the peak is."""
    from pathlib import Path

    from experiments.common.provenance import write_csv as write_rows

    from experiments.memory.phases import PHASES

    gib = 2**30
    rows = []
    for p in plans:
        c, phases = p.categories, p.phase_bytes()
        rows.append({"model": p.model, "method": p.method, **{k: round(v / gib, 3) for k, v in c.items()},
                     "weights_grads_optimizer": round((c["params"] + c["grads"] + c["optimizer"]) / gib, 3),
                     "total": round(p.total_bytes / gib, 3), "capacity": round(p.capacity_bytes / gib, 1),
                     "fits": p.fits, "peak_at": p.peak_at, "peak_phase": p.peak_phase,
                     **{f"phase_{name}": round(phases[name] / gib, 3) if name in phases else "" for name in PHASES},
                     "engine_needs": round(sum(t.nbytes for t in p.engine) / gib, 3) if p.engine else "",
                     "engine_fits": p.engine_fits if p.engine else ""})
    write_rows(Path(path), rows)


if __name__ == "__main__":
    sys.exit(main())
