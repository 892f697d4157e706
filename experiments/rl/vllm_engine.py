"""A vLLM rollout engine that follows the trainer through weight-sync payloads (docs/design.md §3.3, §7;
docs/distributed.md, "vLLM engine").

``rollout.engine=vllm``, settings in ``rollout.vllm.*`` (:class:`~experiments.rl.vllm_config.VLLMConfig`).
One engine per trainer process, colocated with the trainer:

* **start** (:func:`start_llm`): under torchrun on CUDA the ``external_launcher`` executor (vLLM's one
  worker in this process, on ``cuda:LOCAL_RANK`` — as TRL's colocate mode and verl's hybrid engine run
  it), tensor_parallel_size 1; ``gpu_memory_utilization`` (vLLM's start-up check) and the KV budget
  (``kv_cache_memory_bytes``) from the config, by default what the engine needs as built
  (:func:`~experiments.rl.vllm_config.engine_bytes`, the planner's terms); this rank's seed; CUDA graphs
  on where weights are updated in place. Elsewhere (vLLM's CPU build, one process) the in-process
  ``uni`` executor, eager. vLLM is imported only here: this module imports without it.
* **weights** (:mod:`experiments.rl.vllm_weights`): ``inplace`` applies each payload to vLLM's own
  parameters through views (no shadow copy, no reload); ``reload`` (the CPU build, which repacks weights)
  replays it on a shadow copy and reloads the touched layers.
* **sleep** (``rollout.vllm.sleep``, vLLM's sleep mode, CUDA only): when the trainer is done sampling
  (the end of :meth:`sampling`: a step's rollouts, an evaluation) the engine sleeps — level 1 offloads
  its weights to host memory and drops the KV cache, level 2 drops both. A
  payload wakes the weights first (they return to the same addresses, so views and CUDA graphs stay
  valid) and is applied there; ``generate`` then wakes the KV cache (verl's order: weights, sync, KV).
  After level 2 the weights are garbage until a full payload arrives: :attr:`needs_full` asks the sender
  for one, so every step is a full-weight sync (the low-rank saving is lost; level 1 keeps it).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from experiments.rl.rollout import RolloutConfig, RolloutEngine, Rollouts, _as_list, _pad, register_engine
from experiments.rl.vllm_config import (MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, engine_bytes, engine_seed, executor,
                                        utilization, validate, weight_path)
from experiments.rl.vllm_weights import WEIGHT_PATHS
from logra_core.sync import SyncPayload, drain

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU build's KV cache unless rollout.vllm.kv_cache_gb or VLLM_CPU_KVCACHE_SPACE (GiB)
# torch threads while vLLM samples on CPU: vLLM serves with 1 (idle OpenMP workers spin after each parallel
# region). Measured here, SmolLM2 fp32, 8 × 24 tokens on 2 cores beside a busy trainer: 3–4 s with 1
# thread, 31–32 s with 2.
SAMPLING_THREADS = 1
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
_KEPT: list = []  # closed external_launcher engines, alive until the process exits (VLLMEngine.close)


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM sampling on weights that only sync payloads update (see the module docstring)."""

    holds_copy = True

    def __init__(self, cfg: RolloutConfig, model, tokenizer, factory: Optional[Callable] = None):
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise ValueError(f"rollout.engine=vllm needs a plain HF model (got {type(model).__name__}; "
                             "LoRA adapters would go through vLLM's LoRA path, not implemented)")
        validate(cfg.vllm)
        self.cfg, self.tokenizer, self.vcfg = cfg, tokenizer, cfg.vllm
        device = next(model.parameters()).device
        cuda = _is_cuda(device)
        if self.vcfg.sleep and not cuda:
            raise ValueError("rollout.vllm.sleep needs vLLM's CUDA build (its sleep mode maps CUDA memory); use 0 on CPU")
        self.weights = WEIGHT_PATHS[weight_path(self.vcfg, cuda)](model, factory)
        self.eos = _as_list(model.generation_config.eos_token_id)
        self.dir = Path(tempfile.mkdtemp(prefix="logra-vllm-"))  # removed by close, or at exit at the latest
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        _write_model_dir(getattr(self.weights, "shadow", model), tokenizer, self.dir, self.weights.writes_weights)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        world = torch.distributed.get_world_size() if distributed else 1
        self.executor = executor(self.vcfg, cuda, distributed)
        self.llm = start_llm(self.dir, cfg, model, device, rank, world, distributed, load_format=self.weights.load_format,
                             total_memory=_total_memory(device), cuda=cuda)
        self.weights.attach(self.llm)
        self.tied_head = self.weights.tied_head
        self.asleep: set[str] = set()
        self.discarded = False  # sleep level 2 dropped the weights: only a full payload restores them
        self.stale_cache = False  # the prefix cache holds keys/values of older weights
        self.sleep()

    # ---- sleep mode ----------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory until it is needed (rollout.vllm.sleep; 0: stay resident)."""
        level = self.vcfg.sleep
        if level and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = {"weights", "kv_cache"}
            self.discarded = self.discarded or level == 2

    @contextmanager
    def sampling(self):
        """Around a step's rollouts or an evaluation (the trainer's): asleep again when it ends."""
        try:
            yield self
        finally:
            self.sleep()

    def wake(self, *tags: str) -> None:
        todo = [t for t in tags if t in self.asleep]
        if todo:
            torch.cuda.empty_cache()  # vLLM's pool maps memory outside torch's cache (TRL does the same)
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)

    @property
    def needs_full(self) -> bool:
        """Whether only a full payload can bring the engine up to date (sleep level 2 dropped its weights)."""
        return self.discarded

    # ---- sync ------------------------------------------------------------------------------------
    @property
    def last_error(self) -> str:
        return self.weights.last_error

    def receive(self, payload: SyncPayload) -> bool:
        """Apply and verify ``payload`` on the weights (woken first)."""
        self.wake("weights")
        if self.discarded and not payload.full:
            self.weights.receiver.last_error = "sleep level 2 discarded the weights: a full payload is needed"
            drain(payload)  # read and dropped, as a sharded sender's ranks gather them together
            return False
        ok = self.weights.receive(payload, self.llm)
        self.discarded = self.discarded and not (ok and payload.full)
        self.stale_cache = True
        return ok

    @property
    def push_s(self) -> float:
        return getattr(self.weights, "push_s", 0.0)

    def resident_tensors(self) -> list[torch.Tensor]:
        return self.weights.buffers() if "weights" in self.asleep else self.weights.resident()

    def state_dict(self, tied: bool = False) -> dict[str, torch.Tensor]:
        """The weights vLLM computes with, by HF parameter name (``tied``: the tied head's too)."""
        self.wake("weights")
        return self.weights.state_dict(self.llm, tied)

    # ---- sampling --------------------------------------------------------------------------------
    def generate(self, prompts: list[str], n: int = 1, greedy: bool = False, max_new_tokens: int = 0) -> Rollouts:
        """``n`` completions per prompt, group-major, with the sampler's log-prob of each sampled token
        (vLLM ``processed_logprobs``: after temperature and top-p, as :class:`HFGenerateEngine`). vLLM
        schedules the batch itself (at most ``rollout.vllm.max_num_seqs`` sequences at once)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.discarded:
            raise RuntimeError("the engine's weights were discarded (sleep level 2) and no full sync followed")
        self.wake("weights", "kv_cache")
        if self.stale_cache:
            self.llm.reset_prefix_cache()  # cached keys/values came from older weights
            self.stale_cache = False
        tok = self.tokenizer
        expanded = [p for p in prompts for _ in range(n)]
        enc = tok(expanded, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        params = SamplingParams(
            n=1 if greedy else n, temperature=0.0 if greedy else self.cfg.temperature,
            top_p=1.0 if greedy else self.cfg.top_p, max_tokens=max_new_tokens or self.cfg.max_new_tokens,
            logprobs=0, stop_token_ids=self.eos, detokenize=False,
        )
        # vLLM decodes greedily one sample per request: a greedy group is n requests of its prompt
        rows = range(len(expanded)) if greedy else range(0, len(expanded), n)
        requests = [TokensPrompt(prompt_token_ids=enc.input_ids[i][enc.attention_mask[i].bool()].tolist())
                    for i in rows]
        threads = torch.get_num_threads()
        torch.set_num_threads(SAMPLING_THREADS)
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            torch.set_num_threads(threads)
        ids, logprobs = [], []
        for out in outputs:
            for sample in out.outputs:  # the n samples of one prompt, in order
                tokens = list(sample.token_ids)
                ids.append(torch.tensor(tokens, dtype=torch.long).view(1, -1))
                logprobs.append(torch.tensor([sample.logprobs[k][t].logprob for k, t in enumerate(tokens)],
                                             dtype=torch.float32).view(1, -1))
        completion = _pad(ids, tok.pad_token_id, left=False)
        lengths = torch.tensor([x.shape[1] for x in ids])
        inside = torch.arange(completion.shape[1]) < lengths[:, None]
        is_eos = torch.isin(completion, torch.tensor(self.eos)) & inside
        # mask: tokens up to and including the first EOS (vLLM stops there)
        mask = (inside & ((is_eos.long().cumsum(1) - is_eos.long()) == 0)).long()
        completion = completion.masked_fill(mask == 0, tok.pad_token_id)
        return Rollouts(
            prompt_ids=enc.input_ids, prompt_mask=enc.attention_mask, completion_ids=completion,
            completion_mask=mask, sampler_logprobs=_pad(logprobs, 0.0, left=False) * mask,
            texts=tok.batch_decode(completion, skip_special_tokens=True), truncated=~is_eos.any(dim=1),
        )

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            if self.executor == "external_launcher":
                _release_groups(llm)
                return self._remove_dir()
            core = getattr(llm.llm_engine, "engine_core", None)  # the in-process engine core and its worker
            if core is not None:
                core.shutdown()
            del llm
            gc.collect()
        self._remove_dir()


def _release_groups(llm) -> None:
    """Close an ``external_launcher`` engine without ending the trainer's torch.distributed: vLLM's teardown
    (``shutdown``, or its finalizer) destroys the default process group, which there is the trainer's own
    (seen on the CPU build). vLLM's own groups (its tensor/pipeline-parallel groups and its world group)
    are destroyed here; the engine is kept until the process exits, when the default group is gone."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    world = getattr(parallel_state, "_WORLD", None)
    if world is not None:
        world.destroy()
        parallel_state._WORLD = None
    _KEPT.append(llm)


def _write_model_dir(model, tokenizer, path: Path, weights: bool) -> None:
    """Config and tokenizer files as vLLM loads a model folder, and the weights (safetensors) where vLLM
    loads them from there (``weights``; else it starts from dummy weights that the first sync fills);
    any leftover ``quantization_config`` (a de-quantized GGUF) removed, which vLLM would obey. Written by
    this rank for its own engine: HF's ``save_pretrained`` writes on rank 0 only under torch.distributed."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if weights:  # a tied head is the embedding's parameter: listed (and written) once
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    tokenizer.save_pretrained(path)


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _total_memory(device: torch.device) -> int:
    if not _is_cuda(device):
        return 0
    return torch.cuda.get_device_properties(device).total_memory


def _device_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def llm_kwargs(cfg: RolloutConfig, model, cuda: bool, rank: int, distributed: bool, load_format: str,
               total_memory: int, trainer_seed: int) -> dict:
    """vLLM's ``LLM(...)`` arguments for this rank (see the module docstring)."""
    v, mc = cfg.vllm, model.config
    dtype = next(model.parameters()).dtype
    max_len = min(v.max_model_len or MAX_MODEL_LEN, getattr(mc, "max_position_embeddings", MAX_MODEL_LEN))
    seqs = v.max_num_seqs or cfg.batch_size
    heads = mc.num_attention_heads
    kv_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    kv = int(v.kv_cache_gb * 2**30) or (0 if cuda else (int(kv_gib) << 30 if kv_gib else CPU_KV_CACHE_BYTES))
    terms = engine_bytes(params=sum(p.numel() for p in model.parameters()), layers=mc.num_hidden_layers,
                         kv_heads=getattr(mc, "num_key_value_heads", None) or heads,
                         head_dim=getattr(mc, "head_dim", None) or mc.hidden_size // heads, vocab=mc.vocab_size,
                         hidden=mc.hidden_size, inter=mc.intermediate_size, dtype_bytes=DTYPE_BYTES[dtype],
                         max_num_seqs=seqs, max_model_len=max_len, kv_cache_bytes=kv, cuda_graphs=cuda and v.cuda_graphs)
    inplace = weight_path(v, cuda) == "inplace"
    kwargs = dict(dtype=str(dtype).removeprefix("torch."), seed=engine_seed(v, rank, trainer_seed),
                  distributed_executor_backend=executor(v, cuda, distributed), tensor_parallel_size=1,
                  logprobs_mode="processed_logprobs", max_model_len=max_len, max_num_seqs=seqs,
                  kv_cache_memory_bytes=terms["kv"], generation_config="vllm", load_format=load_format,
                  enforce_eager=not (inplace and v.cuda_graphs and cuda))
    if cuda:
        kwargs.update(gpu_memory_utilization=v.gpu_memory_utilization or utilization(sum(terms.values()), total_memory),
                      enable_sleep_mode=v.sleep > 0, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    return kwargs


def start_llm(path: Path, cfg: RolloutConfig, model, device: torch.device, rank: int, world: int, distributed: bool,
              load_format: str = "auto", total_memory: int = 0, cuda: Optional[bool] = None):
    """vLLM's engine for this rank, in this process. ``external_launcher`` reads the rank from the
    environment (RANK, LOCAL_RANK = the trainer's device index, WORLD_SIZE; TRL sets the same)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process: tensors pass by reference
    from vllm import LLM

    cuda = _is_cuda(device) if cuda is None else cuda
    kwargs = llm_kwargs(cfg, model, cuda, rank, distributed, load_format, total_memory, torch.initial_seed())
    if kwargs["distributed_executor_backend"] == "external_launcher":
        local = _device_index(device) if device.type == "cuda" else os.environ.get("LOCAL_RANK", rank)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    # vLLM drops torch to one thread "for serving" and stubs out torch.set_num_threads for the thread
    # binding of its worker processes, which the in-process executors never do: in the trainer's
    # process both are undone, and the trainer keeps its threads
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        return LLM(model=str(path), tokenizer=str(path), **kwargs)
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
