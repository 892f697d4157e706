"""The vLLM engine's settings (``rollout.vllm.*``), how they become vLLM's ``LLM(...)`` arguments on each
rank, and the bytes the engine allocates on a GPU (docs/distributed.md, "vLLM engine"; the memory
planner counts the same terms, experiments/memory/phases.py).

Colocated with the trainer under torchrun, one engine per rank (TRL's ``vllm_mode="colocate"``, verl's
hybrid engine): the ``external_launcher`` executor runs vLLM's one worker in the trainer's process on
``cuda:LOCAL_RANK`` (the ``uni`` executor would take local rank 0: every rank's engine on cuda:0);
vLLM's start-up check needs ``free memory ≥ gpu_memory_utilization × total``, so the engine is handed
its share; the KV cache is sized explicitly (``kv_cache_memory_bytes``); each rank samples with its own
seed. Pure Python: importable without vLLM or a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

EXECUTORS = ("auto", "uni", "external_launcher")
WEIGHT_PATHS = ("auto", "inplace", "reload")
SLEEP_LEVELS = (0, 1, 2)
MAX_MODEL_LEN = 4096  # prompt + completion tokens per sequence unless set (capped by the model's limit)
MAX_NUM_BATCHED_TOKENS = 4096  # tokens per scheduler step (TRL's colocate value: bounds the profiling run)
CUDA_GRAPH_POOL_BYTES = 1 << 30  # assumed: vLLM's captured graphs' private pool (its logs show ~0.3-1 GiB at 7B)
CUDA_OVERHEAD_BYTES = 1 << 29  # assumed: what vLLM's start allocates outside torch (cuBLAS workspaces, NCCL)
SEED_STRIDE = 1_000_003  # the trainer's per-rank seed stride (experiments/rl/trainer.py)


@dataclass
class VLLMConfig:
    executor: str = "auto"  # auto: external_launcher where torch.distributed runs on CUDA (torchrun: one engine per rank on cuda:LOCAL_RANK), else uni (in process; the CPU build); or name one
    weights: str = "auto"  # how payloads reach vLLM's weights: inplace (views into vLLM's own fused parameters; CUDA build) | reload (a shadow copy + reload_weights; the CPU build, which repacks weights); auto: inplace on CUDA, reload on CPU
    gpu_memory_utilization: float = 0.0  # vLLM's share of the GPU (its start-up check: free memory must cover it); 0 = what the engine needs as built (engine_bytes) / the GPU's memory
    kv_cache_gb: float = 0.0  # KV-cache budget per GPU (vLLM kv_cache_memory_bytes); 0 = max_num_seqs x max_model_len tokens
    max_num_seqs: int = 0  # sequences decoded at once; 0 = rollout.batch_size
    max_model_len: int = 0  # prompt + completion tokens per sequence; 0 = min(4096, the model's limit)
    cuda_graphs: bool = True  # capture CUDA graphs (enforce_eager=False) where weights are updated in place (their addresses never change); the reload path runs eager
    sleep: int = 0  # vLLM sleep mode outside rollouts: 0 stays resident; 1 offloads the weights to host memory and drops the KV cache (woken intact: low-rank payloads still apply); 2 drops both (every wake needs a full payload)
    seed: Optional[int] = None  # sampling seed: None = the trainer's seed of this rank (torch.initial_seed(): seed + 1_000_003 x rank); else seed + 1_000_003 x rank


def validate(cfg: VLLMConfig) -> None:
    if cfg.executor not in EXECUTORS:
        raise ValueError(f"rollout.vllm.executor must be one of {EXECUTORS}, got {cfg.executor!r}")
    if cfg.weights not in WEIGHT_PATHS:
        raise ValueError(f"rollout.vllm.weights must be one of {WEIGHT_PATHS}, got {cfg.weights!r}")
    if cfg.sleep not in SLEEP_LEVELS:
        raise ValueError(f"rollout.vllm.sleep must be one of {SLEEP_LEVELS}, got {cfg.sleep!r}")
    if not 0.0 <= cfg.gpu_memory_utilization < 1.0:
        raise ValueError(f"rollout.vllm.gpu_memory_utilization must be in [0, 1), got {cfg.gpu_memory_utilization}")


def kv_bytes(tokens: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache of ``tokens`` tokens: a key and a value of kv_heads x head_dim per layer and token."""
    return tokens * layers * 2 * kv_heads * head_dim * dtype_bytes


def engine_bytes(*, params: int, layers: int, kv_heads: int, head_dim: int, vocab: int, hidden: int, inter: int,
                 dtype_bytes: int, max_num_seqs: int, max_model_len: int, kv_cache_bytes: int = 0,
                 cuda_graphs: bool = True, tp: int = 1) -> dict[str, int]:
    """What one GPU's engine allocates while it samples, by term (bytes):

    * ``weights``: the policy in the weight dtype, /tp (tensor_parallel_size; 1 until TP groups are wired);
    * ``kv``: the KV budget (``kv_cache_bytes``, else max_num_seqs x max_model_len tokens);
    * ``graphs``: the CUDA graphs' pool (:data:`CUDA_GRAPH_POOL_BYTES`, assumed), kept while asleep;
    * ``workspace``: a decode step's fp32 logits and their softmax for max_num_seqs rows, and one layer's
      prefill working set for :data:`MAX_NUM_BATCHED_TOKENS` tokens ((2 ffn + 4 h) per token).
    """
    kv = kv_cache_bytes or kv_bytes(max_num_seqs * max_model_len, layers, kv_heads, head_dim, dtype_bytes)
    return {"weights": params * dtype_bytes // tp, "kv": kv, "graphs": CUDA_GRAPH_POOL_BYTES if cuda_graphs else 0,
            "workspace": 2 * max_num_seqs * vocab * 4 + MAX_NUM_BATCHED_TOKENS * (2 * inter + 4 * hidden) * dtype_bytes // tp}


def utilization(needed: int, total: int) -> float:
    """The gpu_memory_utilization covering ``needed`` bytes (plus vLLM's non-torch start-up
    allocations) of a GPU of ``total`` bytes, rounded up to 0.01."""
    return min(0.99, math.ceil(100 * (needed + CUDA_OVERHEAD_BYTES) / total) / 100)


def engine_seed(cfg: VLLMConfig, rank: int, trainer_seed: int) -> int:
    """This rank's sampling seed: ``trainer_seed`` (the rank's torch seed) unless rollout.vllm.seed is set;
    taken mod 2³² (vLLM seeds numpy's generator with it)."""
    return (trainer_seed if cfg.seed is None else cfg.seed + SEED_STRIDE * rank) % 2**32


def executor(cfg: VLLMConfig, cuda: bool, distributed: bool) -> str:
    if cfg.executor != "auto":
        return cfg.executor
    return "external_launcher" if cuda and distributed else "uni"


def weight_path(cfg: VLLMConfig, cuda: bool) -> str:
    if cfg.weights != "auto":
        return cfg.weights
    return "inplace" if cuda else "reload"
