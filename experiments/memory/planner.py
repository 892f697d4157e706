"""Memory planner: predicted per-GPU bytes of one GRPO training step, by category, and whether it fits.

    from experiments.memory.planner import plan
    p = plan("gemma-2-27b", "logra", gpus=8, gpu_mem_gb=80, sharding="fsdp", seq_len=1536)
    print(p.table())

``model`` is a preset name (``experiments/memory/presets/<name>.json``: shapes copied from the public
HF ``config.json``; no weights), an HF config name or local path (read with ``AutoConfig``), or a
config dict with the same keys. The arithmetic is from shapes only; every assumption it makes is
listed in ``Plan.assumptions`` and printed by ``table()``.

Status: the parameter, gradient and optimizer-state terms follow the methods' code
(``baselines/``, ``logra_core/optimizer.py``); the activation term is a first-order formula that has
NOT yet been calibrated against the profiler (issue 7 leaves that open).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PRESET_DIR = Path(__file__).with_name("presets")
METHODS = ("dense", "logra", "galore", "galore_layerwise", "lora")
SHARDINGS = ("none", "fsdp", "zero2", "zero3")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "bfloat16": 2, "float16": 2, "float32": 4}
CATEGORIES = ("params", "grads", "optimizer", "activations", "rollout", "other")
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_model_config(model) -> tuple[str, dict]:
    """(name, config dict) from a preset name, an HF config name/path, or a dict."""
    if isinstance(model, dict):
        cfg, name = dict(model), str(model.get("name", "custom"))
    elif (PRESET_DIR / f"{model}.json").is_file():
        cfg, name = json.loads((PRESET_DIR / f"{model}.json").read_text()), model
    elif Path(str(model)).is_file():
        cfg, name = json.loads(Path(model).read_text()), str(model)
    elif "/" in str(model):
        try:
            from transformers import AutoConfig
            cfg, name = AutoConfig.from_pretrained(str(model)).to_dict(), str(model)
        except Exception as e:  # noqa: BLE001  (any failure means: not a model we know)
            raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(presets())}), "
                             f"a config.json path, or a loadable HF config ({type(e).__name__}: {e})") from None
    else:
        raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(presets())}), a config.json path, "
                         "or an HF name (org/name)")
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"model config {name!r} lacks {missing}")
    return name, cfg


@dataclass
class Shapes:
    """Parameter counts of a decoder-only transformer from its config."""
    proj: list[tuple[int, int]]  # (out, in) of every attention/MLP projection (the sketched ones)
    embed: int
    head: int  # 0 when tied
    norms: int
    biases: int
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int

    @property
    def n_proj(self) -> int:
        return sum(m * n for m, n in self.proj)

    @property
    def n_rest(self) -> int:
        return self.embed + self.head + self.norms + self.biases

    @property
    def total(self) -> int:
        return self.n_proj + self.n_rest


def shapes(cfg: dict) -> Shapes:
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    ff = cfg["intermediate_size"]
    layer = [(nh * hd, h), (kv * hd, h), (kv * hd, h), (h, nh * hd), (ff, h), (ff, h), (h, ff)]
    bias = (nh * hd + 2 * kv * hd) if cfg.get("attention_bias") else 0
    norms_per_layer = 4 if "gemma" in str(cfg.get("model_type", "")) or cfg.get("source", "").startswith("google/gemma") else 2
    tied = cfg.get("tie_word_embeddings", True)
    return Shapes(proj=layer * L, embed=V * h, head=0 if tied else V * h, norms=L * norms_per_layer * h + h,
                  biases=L * bias, hidden=h, layers=L, vocab=V, heads=nh, kv_heads=kv, head_dim=hd, inter=ff)


@dataclass
class Plan:
    model: str
    method: str
    categories: dict[str, int]
    capacity_bytes: int
    assumptions: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return int(sum(self.categories.values()))

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    def table(self) -> str:
        gib = 2**30
        s = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        lines = [f"{self.model} / {self.method}: {s}", f"  {'category':<12} {'GiB per GPU':>12}"]
        lines += [f"  {k:<12} {v / gib:>12.2f}" for k, v in self.categories.items()]
        lines.append(f"  {'total':<12} {self.total_bytes / gib:>12.2f}  of {self.capacity_bytes / gib:.1f} GiB -> "
                     + ("fits" if self.fits else "DOES NOT FIT"))
        lines.append("  assumptions:")
        lines += [f"    - {a}" for a in self.assumptions]
        return "\n".join(lines)


def plan(model, method, *, gpus=1, gpu_mem_gb=80.0, micro_batch=1, seq_len=1024, rank=256, sharding="none",
         rollout="colocated", dtype="bf16", **opts) -> Plan:
    """Predicted per-GPU bytes by category (see the module docstring).

    opts: ``gradient_checkpointing`` (default True), ``master_weights`` (default: True for bf16/fp16
    dense/galore/lora AdamW, i.e. fp32 master + fp32 moments; the harness' plain torch AdamW on bf16
    weights keeps bf16 moments and no master: pass False), ``rollout_share`` (fraction of the GPU a
    colocated vLLM engine reserves, default 0.3), ``embeddings`` (logra sketches the embedding too),
    ``logits_chunk`` (tokens whose fp32 logits are alive at once, default all), ``other_gb`` (CUDA
    context and allocator slack, default 1.0).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(SHARDINGS)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if int(gpus) < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    known = {"gradient_checkpointing", "master_weights", "rollout_share", "embeddings", "logits_chunk", "other_gb"}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown planner option(s) {unknown}; known: {sorted(known)}")
    name, cfg = load_model_config(model)
    s = shapes(cfg)
    b = DTYPE_BYTES[dtype]
    low = b < 4
    gpus = int(gpus)
    ckpt = bool(opts.get("gradient_checkpointing", True))
    master = bool(opts.get("master_weights", low))
    A: list[str] = [f"{s.total / 1e9:.3f} B parameters ({s.n_proj / 1e9:.3f} B in attention/MLP projections), "
                    f"weights in {dtype} ({b} B each)"]
    shard_p = gpus if sharding in ("fsdp", "zero3") else 1
    shard_g = gpus if sharding in ("fsdp", "zero2", "zero3") else 1
    shard_o = gpus if sharding != "none" else 1
    A.append(f"sharding {sharding} over {gpus} GPU(s): params /{shard_p}, grads /{shard_g}, optimizer state /{shard_o}")

    params = s.total * b
    grads = 0
    optim = 0
    adam_per = (4 + 8) if master else 2 * b  # per AdamW-trained element
    A.append("AdamW state per trained element: " + ("fp32 master + two fp32 moments (12 B)" if master
                                                    else f"two moments in the weight dtype ({2 * b} B)"))
    if method == "dense":
        grads = s.total * b
        optim = s.total * adam_per
    elif method in ("galore", "galore_layerwise"):
        r_of = [min(rank, m, n) for m, n in s.proj]
        proj_mats = sum(min(m, n) * r for (m, n), r in zip(s.proj, r_of)) * 4
        moments = sum(max(m, n) * r for (m, n), r in zip(s.proj, r_of)) * 2 * 4
        optim = proj_mats + moments + s.n_rest * adam_per + (s.n_proj * 4 if master else 0)
        if method == "galore":
            grads = s.total * b
        else:
            grads = max(max(m * n for m, n in s.proj), s.embed) * b
            A.append("galore_layerwise: one parameter's gradient alive at a time (one micro-batch per update)")
        A.append(f"galore: rank min({rank}, m, n) per projection, fp32 projector (min side x r) and moments (max side x r)")
    elif method == "lora":
        adapters = sum(rank * (m + n) for m, n in s.proj)
        params += adapters * 4
        grads = adapters * 4
        optim = adapters * 8
        A.append(f"lora: rank {rank} adapters on every projection, fp32, AdamW (two fp32 moments); base frozen")
    else:  # logra
        emb = bool(opts.get("embeddings", False))
        rows = sum(m for m, _ in s.proj) + (s.vocab if emb else 0)
        sketches = rows * rank * 4
        row_moments = rows * 4
        rest = s.n_rest - (s.embed if emb else 0)
        masters = (s.n_proj + (s.embed if emb else 0)) * 4 if low else 0
        grads = rest * b
        optim = sketches + row_moments + masters + rest * adam_per
        A.append(f"logra: fp32 m x r sketch (r={rank}) + fp32 row second moment per sketched weight; no dense gradient "
                 f"for them; {'fp32 masters of the sketched weights (logra_core keeps one for low-precision weights)' if low else 'no masters (fp32 weights)'}; "
                 f"embedding {'sketched' if emb else 'trained by AdamW with a dense gradient'}")
    params, grads, optim = params // shard_p, grads // shard_g, optim // shard_o

    tokens = int(micro_batch) * int(seq_len)
    h, L = s.hidden, s.layers
    if ckpt:
        # per layer the checkpointed input (tokens x h) + one layer recomputed in full
        layer_full = tokens * b * (10 * h + 2 * s.heads * s.head_dim + 3 * s.inter)
        acts = L * tokens * h * b + layer_full
        A.append("activation checkpointing: one tokens x h input kept per layer, one layer's activations recomputed "
                 "(~(10h + 2·heads·head_dim + 3·ffn) elements per token, flash/SDPA attention: no s x s scores)")
    else:
        acts = L * tokens * b * (10 * h + 2 * s.heads * s.head_dim + 3 * s.inter)
        A.append("no activation checkpointing: ~(10h + 2·heads·head_dim + 3·ffn) elements per token per layer")
    chunk = int(opts.get("logits_chunk", 0) or tokens)
    logits = min(chunk, tokens) * s.vocab * 4 * 2
    acts += logits
    A.append(f"logits: fp32 logits + their gradient for {min(chunk, tokens)} tokens at once "
             f"(micro_batch {micro_batch} x seq_len {seq_len})")
    A.append("activation formula NOT calibrated against the profiler yet (issue 7 open)")

    capacity = int(float(gpu_mem_gb) * 2**30)
    if rollout in ("none", None, False, "external"):
        roll = 0
        A.append("rollout: no colocated engine on this GPU")
    else:
        share = float(rollout) if isinstance(rollout, (int, float)) or str(rollout).replace(".", "", 1).isdigit() \
            else float(opts.get("rollout_share", 0.3))
        if not 0.0 <= share < 1.0:
            raise ValueError(f"rollout share must be in [0, 1), got {share}")
        roll = int(share * capacity)
        A.append(f"rollout: a colocated vLLM engine reserves {share:.2f} of the GPU (gpu_memory_utilization), "
                 "its own weights and KV cache inside that share")
    other = int(float(opts.get("other_gb", 1.0)) * 2**30)
    A.append(f"other: {other / 2**30:.1f} GiB for the CUDA context and allocator slack")
    cats = {"params": int(params), "grads": int(grads), "optimizer": int(optim), "activations": int(acts),
            "rollout": roll, "other": other}
    settings = {"gpus": gpus, "gpu_mem_gb": gpu_mem_gb, "micro_batch": micro_batch, "seq_len": seq_len, "rank": rank,
                "sharding": sharding, "rollout": rollout, "dtype": dtype}
    return Plan(name, method, cats, capacity, A, settings)
