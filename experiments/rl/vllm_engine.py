"""A vLLM rollout engine that follows the trainer through weight-sync payloads (docs/design.md §3.3, §7).

``rollout.engine=vllm``. The engine keeps a CPU *shadow* copy of the policy with a
:class:`~logra_core.sync.SyncReceiver` on it. A payload is applied and verified on the shadow, bit for
bit as in the ``hf`` engine; then the tensors it touched are pushed into vLLM as full tensors by
``collective_rpc("reload_weights")``. On the CPU build vLLM repacks every linear weight for oneDNN
(the parameter becomes a ``(0,)`` tensor), so nothing can be edited in place and a low-rank update
W ← W + L A reaches the engine as the rebuilt W of the touched layers. Two rules the CPU build imposes
(README, "vLLM engine"):

* a layer is reloaded whole: q/k/v (``qkv_proj``), gate/up (``gate_up_proj``), a weight and its
  bias travel together, or what was not sent is left as uninitialized memory;
* a tied LM head keeps its own packed copy of the embedding: after the embedding is reloaded the head
  is repacked (``quant_method.process_weights_after_loading``), and the prefix cache is reset after
  every push, since cached keys/values came from the old weights.

The engine runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor, eager mode), so tensors and callables reach the worker by reference. vLLM is imported
only when the engine is built: this module imports without it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch

from experiments.rl.rollout import RolloutConfig, RolloutEngine, Rollouts, _as_list, _pad, copy_policy, register_engine
from logra_core.sync import SyncPayload, SyncReceiver

KV_CACHE_BYTES = 1 << 30  # the engine's KV cache on CPU; VLLM_CPU_KVCACHE_SPACE (GiB) overrides
MAX_MODEL_LEN = 4096  # prompt + completion tokens per sequence (capped by the model's own limit)
# torch threads while vLLM samples: vLLM serves with 1 (idle OpenMP workers spin after each parallel
# region). Measured here, SmolLM2 fp32, 8 × 24 tokens on 2 cores beside a busy trainer: 3–4 s with 1
# thread, 31–32 s with 2.
SAMPLING_THREADS = 1


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM sampling on a policy copy that only sync payloads update (see the module docstring)."""

    holds_copy = True

    def __init__(self, cfg: RolloutConfig, model, tokenizer, factory: Optional[Callable] = None):
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise ValueError(f"rollout.engine=vllm needs a plain HF model (got {type(model).__name__}; "
                             "LoRA adapters would go through vLLM's LoRA path, not implemented)")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.shadow = copy_policy(model, factory)  # FSDP2: a skeleton the first full sync fills
        self.receiver = SyncReceiver(self.shadow)
        self.params = dict(self.shadow.named_parameters())
        self.eos = _as_list(model.generation_config.eos_token_id)
        self.dir = Path(tempfile.mkdtemp(prefix="logra-vllm-"))  # removed by close, or at exit at the latest
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        _write_model_dir(self.shadow, tokenizer, self.dir)
        self.llm = _start_llm(self.dir, self.shadow)
        self.fused, self.tied_head = self.llm.collective_rpc(_layout)[0]
        self.embedding = next(n for n, p in self.params.items() if p is self.shadow.get_input_embeddings().weight)
        # the reloader warns about every layer a partial push leaves alone (and the tied head, rebuilt
        # below); what vLLM computes with is checked by reading it back (tests/test_vllm_engine.py)
        for part in ("inplace", "layerwise"):
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{part}").setLevel(logging.ERROR)
        self.push_s = 0.0  # seconds spent in the last push into vLLM

    # ---- sync ------------------------------------------------------------------------------------
    @property
    def last_error(self) -> str:
        return self.receiver.last_error

    def receive(self, payload: SyncPayload) -> bool:
        """Apply and verify ``payload`` on the shadow, then push the touched tensors into vLLM."""
        if not self.receiver.receive(payload):
            return False  # the shadow may be half-updated: the full payload that follows pushes all
        self.push(payload.touched())
        return True

    @torch.no_grad()
    def push(self, names: list[str]) -> None:
        """Reload the shadow's ``names`` into vLLM, each with the rest of its fused group."""
        t0 = time.perf_counter()
        send = list(dict.fromkeys(m for n in names for m in self.fused.get(n, (n,)) if m in self.params))
        weights = [(n, self.params[n].detach()) for n in send]
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights))
        if self.tied_head and self.embedding in send:
            self.llm.collective_rpc(_repack_head, args=(self.tied_head,))
        self.llm.reset_prefix_cache()
        self.push_s = time.perf_counter() - t0

    def resident_tensors(self) -> list[torch.Tensor]:
        return [*self.shadow.parameters(), *self.receiver.tensors.masters.values()]

    def state_dict(self, tied: bool = False) -> dict[str, torch.Tensor]:
        """The weights vLLM computes with, read back, by HF parameter name (a linear layer's weight by
        running its packed kernel on an identity matrix). ``tied``: add the tied LM head as read back
        from its own packed copy, under the head's name."""
        vocab = self.params[self.embedding].shape[0]
        weights = self.llm.collective_rpc(_read_weights, args=(vocab,))[0]
        out = {n: weights[n] for n in self.params}
        if tied and self.tied_head:
            out[self.tied_head + ".weight"] = weights[self.tied_head + ".weight"]
        return out

    # ---- sampling --------------------------------------------------------------------------------
    def generate(self, prompts: list[str], n: int = 1, greedy: bool = False, max_new_tokens: int = 0) -> Rollouts:
        """``n`` completions per prompt, group-major, with the sampler's log-prob of each sampled token
        (vLLM ``processed_logprobs``: after temperature and top-p, as :class:`HFGenerateEngine`). vLLM
        schedules the batch itself (``rollout.batch_size`` is not used)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

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
            core = getattr(llm.llm_engine, "engine_core", None)  # the in-process engine core and its worker
            if core is not None:
                core.shutdown()
            del llm
            gc.collect()
        self._remove_dir()


def _write_model_dir(model, tokenizer, path: Path) -> None:
    """The shadow's weights (safetensors), config and tokenizer files, as vLLM loads a model folder;
    any leftover ``quantization_config`` (a de-quantized GGUF) removed, which vLLM would obey."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:
        (path / "config.json").write_text(json.dumps(config, indent=2))


def _start_llm(path: Path, model):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process: tensors pass by reference
    from vllm import LLM

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    max_len = min(MAX_MODEL_LEN, getattr(model.config, "max_position_embeddings", MAX_MODEL_LEN))
    kv_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    kv_bytes = int(kv_gib) << 30 if kv_gib else KV_CACHE_BYTES
    # vLLM drops torch to one thread "for serving" and stubs out torch.set_num_threads for the thread
    # binding of its worker processes, which the in-process (uni) executor never does: in the
    # trainer's process both are undone, and the trainer keeps its threads
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        return LLM(model=str(path), tokenizer=str(path), dtype=dtype, enforce_eager=True, seed=0,
                   distributed_executor_backend="uni", logprobs_mode="processed_logprobs",
                   max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, generation_config="vllm")
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


# ---- run inside the vLLM worker (collective_rpc passes the worker first) ----------------------------
def _layout(worker) -> tuple[dict[str, tuple[str, ...]], str]:
    """HF tensor name -> the HF names of every tensor of its vLLM layer, reloaded together (a layer is
    re-processed once all of its tensors have arrived: q/k/v, gate/up, a weight with its bias); and
    the tied LM head's module name ("" if none)."""
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {})
    groups = {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part in packed[leaf]] if leaf in packed else [name]
        group = tuple(f"{part}.{p}" for p, _ in module.named_parameters(recurse=False) for part in parts)
        groups.update({n: group for n in group})
    tied = ""
    if getattr(model.config, "tie_word_embeddings", False):
        tied = next((n for n, m in model.named_modules() if type(m).__name__ == "ParallelLMHead"), "")
    return groups, tied


def _repack_head(worker, head: str) -> None:
    """Rebuild the tied head's packed copy from the (reloaded) embedding it shares its weight with."""
    layer = worker.model_runner.get_model().get_submodule(head)
    layer.quant_method.process_weights_after_loading(layer)


@torch.no_grad()
def _read_weights(worker, vocab: int) -> dict[str, torch.Tensor]:
    """Every weight as the kernels use it: a linear (or LM head) by its packed kernel applied to the
    identity without bias, x = I → y = I Wᵀ = Wᵀ (exact: each output sums one product w·1 and zeros),
    split into the HF tensors of a fused layer; an embedding's first ``vocab`` rows (vLLM pads the
    vocabulary); the rest (norms, biases) as stored."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        if isinstance(module, LinearBase):
            width = getattr(module, "input_size_per_partition", module.input_size)
            eye = torch.eye(width, dtype=worker.model_config.dtype)
            weight = module.quant_method.apply(module, eye).t()
            if leaf in packed:
                for suffix, t in (("weight", weight), ("bias", getattr(module, "bias", None))):
                    if t is not None:
                        parts = t.split(list(module.output_sizes), dim=0)
                        out.update({f"{prefix}.{p}.{suffix}": w.contiguous()
                                    for p, w in zip(packed[leaf], parts, strict=True)})
            else:
                out[name + ".weight"] = weight.contiguous()
        elif isinstance(module, ParallelLMHead):
            eye = torch.eye(module.embedding_dim, dtype=worker.model_config.dtype)
            out[name + ".weight"] = module.quant_method.apply(module, eye).t()[:vocab].contiguous()
        elif isinstance(module, VocabParallelEmbedding):
            out[name + ".weight"] = module.weight[:vocab].clone()
    for name, p in model.named_parameters():  # the rest, a tied weight under its first name
        out.setdefault(name, p.detach().clone())
    return out
