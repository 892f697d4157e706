"""Rollout engines: sample completions (with the sampler's per-token log-probs) from a policy.

An engine is found by name in :data:`ENGINES` (``rollout.engine``). This module has ``shared``:
HF ``generate`` on the trainer's own module (no weight sync needed). Engines that hold their own
copy of the policy and receive weight updates (``hf``, ``hf_process``, ``vllm``) plug in behind the
same interface (docs/design.md §3.3, §7).

Layout of a batch (:class:`Rollouts`): the prompts are left-padded to a common width P and the
completions right-padded to a common width C, so ``torch.cat([prompt_ids, completion_ids], 1)``
is a ready model input whose completions occupy the last C columns.
"""

from __future__ import annotations

import copy
import importlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

from experiments.rl.vllm_config import VLLMConfig


@dataclass
class RolloutConfig:
    engine: str = "shared"  # shared (the trainer's own module) | hf (an in-process copy) | hf_process (a worker process) | vllm (in-process vLLM); copies are synced after each step
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass (Holtzman et al., 2020); 1 = off
    max_new_tokens: int = 64  # completion budget; longer completions are truncated (no EOS)
    batch_size: int = 64  # sequences per generate call (vllm: sequences decoded at once unless rollout.vllm.max_num_seqs)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout.engine=vllm: executor, memory share, KV budget, sleep, seed (experiments/rl/vllm_config.py)


@dataclass
class Rollouts:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded
    completion_mask: torch.Tensor  # [B, C] 1 up to and including EOS
    sampler_logprobs: torch.Tensor  # [B, C] log-prob of each sampled token under the sampler (0 where masked)
    texts: list[str]  # decoded completions, special tokens removed
    truncated: torch.Tensor  # [B] bool, True where the budget ran out before EOS

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @staticmethod
    def cat(parts: list["Rollouts"], pad: int) -> "Rollouts":
        """The rows of ``parts`` in order, padded to common widths (prompts left, completions right)."""
        return Rollouts(
            prompt_ids=_pad([p.prompt_ids for p in parts], pad, left=True),
            prompt_mask=_pad([p.prompt_mask for p in parts], 0, left=True),
            completion_ids=_pad([p.completion_ids for p in parts], pad, left=False),
            completion_mask=_pad([p.completion_mask for p in parts], 0, left=False),
            sampler_logprobs=_pad([p.sampler_logprobs for p in parts], 0.0, left=False),
            texts=[t for p in parts for t in p.texts],
            truncated=torch.cat([p.truncated for p in parts]),
        )

    def select(self, idx: torch.Tensor) -> "Rollouts":
        """The rows ``idx``, with all-padding columns trimmed."""
        idx = idx.long()
        pm, cm = self.prompt_mask[idx], self.completion_mask[idx]
        p0 = int((pm.sum(0) > 0).long().argmax()) if pm.numel() else 0  # first non-pad prompt column
        c1 = int((cm.sum(0) > 0).sum())  # completions are right-padded, so columns [0, c1) hold tokens
        c1 = max(c1, 1)
        return Rollouts(
            self.prompt_ids[idx][:, p0:], pm[:, p0:], self.completion_ids[idx][:, :c1], cm[:, :c1],
            self.sampler_logprobs[idx][:, :c1], [self.texts[i] for i in idx.tolist()], self.truncated[idx],
        )

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) of prompt + completion, [B, P + C]."""
        ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1)
        return ids, mask


class _SamplerLogprobs(LogitsProcessor):
    """Applies temperature and top-p itself and records log p of every sampled token.

    HF calls a logits processor once per generated token with the ids generated so far, so the
    token sampled from the previous call's distribution is ``input_ids[:, -1]``: gathering there
    keeps one [B, V] distribution alive instead of all C of them (``output_scores`` would hold
    C × B × V floats). Returning the log-probs as scores is exact: softmax(log_softmax(x)) = softmax(x).
    """

    def __init__(self, temperature: float, top_p: float):
        self.temperature, self.top_p = temperature, top_p
        self.prev: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.logprobs.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = scores.float()
        if self.temperature > 0:
            scores = scores / self.temperature
        if 0 < self.top_p < 1:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) > self.top_p  # keep the smallest prefix reaching top_p
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        self.prev = F.log_softmax(scores, dim=-1)
        return self.prev

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.logprobs.append(self.prev.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
        return torch.stack(self.logprobs, dim=1) if self.logprobs else torch.zeros(len(last_tokens), 0)


class RolloutEngine:
    """Interface. ``generate`` samples ``n`` completions per prompt, group-major."""

    holds_copy = False  # True for engines with their own copy of the policy, kept equal by weight sync
    last_error = ""  # why the last ``receive`` failed
    needs_full = False  # True while only a full payload can update the copy (vLLM after sleep level 2)

    def generate(self, prompts: list[str], n: int = 1, greedy: bool = False, max_new_tokens: int = 0) -> Rollouts:
        raise NotImplementedError

    def receive(self, payload) -> bool:
        """Apply a weight-sync payload (:mod:`logra_core.sync`) to the engine's copy; False = a full
        payload is needed (a version gap or a checksum mismatch)."""
        raise NotImplementedError(f"{type(self).__name__} holds no copy of the policy to sync")

    def sampling(self):
        """Context around a batch of ``generate`` calls (a step's rollouts, an evaluation): an engine may
        free memory when it ends (vLLM's sleep mode)."""
        return nullcontext()

    def close(self) -> None:
        """Release what the engine holds (a worker process)."""

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors the engine keeps in the trainer's process between steps (its copy of the policy,
        the receiver's buffers), for the memory profiler; none for the trainer's own module."""
        return []


ENGINES: dict[str, Callable[..., RolloutEngine]] = {}
# The modules whose engines register themselves (``@register_engine``) when imported; build_engine
# imports them, so a new engine is its module plus one line here.
ENGINE_MODULES = ("experiments.rl.sync_engines", "experiments.rl.vllm_engine")


def register_engine(name: str):
    def wrap(cls):
        ENGINES[name] = cls
        return cls

    return wrap


def copy_policy(model, factory=None):
    """An engine's own copy of the policy, eval mode, no gradients: a deep copy of ``model``, or,
    when ``model`` is sharded (FSDP2: its parameters are DTensor shards, which a copy would keep
    sharded), a fresh skeleton from ``factory`` allocated on the model's device and not filled: its
    weights arrive with the first full sync (every tensor, gathered one at a time)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        if factory is None:
            raise ValueError("an engine copy of a sharded (FSDP2) policy needs a factory that builds its skeleton")
        copy_, _ = factory(weights=False, device=next(model.parameters()).device)
        return copy_.eval().requires_grad_(False)
    return copy.deepcopy(model).eval().requires_grad_(False)


def build_engine(cfg: RolloutConfig, model, tokenizer, factory=None) -> RolloutEngine:
    """The engine ``cfg.engine`` for the trainer's ``model``; ``factory`` builds the policy skeleton
    where an engine lives in another process."""
    for module in ENGINE_MODULES:
        importlib.import_module(module)
    if cfg.engine not in ENGINES:
        raise ValueError(f"unknown rollout.engine {cfg.engine!r}; registered: {sorted(ENGINES)}")
    return ENGINES[cfg.engine](cfg, model, tokenizer, factory=factory)


def _pad(rows: list[torch.Tensor], value, left: bool) -> torch.Tensor:
    width = max(r.shape[-1] for r in rows)
    return torch.cat([F.pad(r, (width - r.shape[-1], 0) if left else (0, width - r.shape[-1]), value=value) for r in rows])


@register_engine("shared")
class HFGenerateEngine(RolloutEngine):
    """Batched HF ``generate`` on a model (here the trainer's own module: nothing to sync)."""

    def __init__(self, cfg: RolloutConfig, model, tokenizer, factory=None):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int = 1, greedy: bool = False, max_new_tokens: int = 0) -> Rollouts:
        expanded = [p for p in prompts for _ in range(n)]
        parts = [
            self._generate_batch(expanded[i : i + self.cfg.batch_size], greedy, max_new_tokens or self.cfg.max_new_tokens)
            for i in range(0, len(expanded), self.cfg.batch_size)
        ]
        return Rollouts.cat(parts, self.tokenizer.pad_token_id)

    def _generate_batch(self, prompts: list[str], greedy: bool, max_new_tokens: int) -> Rollouts:
        tok, model = self.tokenizer, self.model
        device = next(model.parameters()).device
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        temperature = 0.0 if greedy else self.cfg.temperature
        recorder = _SamplerLogprobs(temperature, 1.0 if greedy else self.cfg.top_p)
        # warping happens in the recorder; HF's own warpers stay off
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        was_training = model.training
        model.eval()
        try:
            seqs = model.generate(
                **enc,
                **sampling,
                max_new_tokens=max_new_tokens,
                logits_processor=LogitsProcessorList([recorder]),
                pad_token_id=tok.pad_token_id,
                use_cache=True,
            )
        finally:
            model.train(was_training)
        completion = seqs[:, enc.input_ids.shape[1] :]
        logprobs = recorder.finish(completion[:, -1])
        eos = torch.tensor(_as_list(model.generation_config.eos_token_id), device=completion.device)
        is_eos = torch.isin(completion, eos)
        # mask: tokens up to and including the first EOS
        before_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0
        mask = before_eos.long()
        truncated = ~is_eos.any(dim=1)
        completion = completion.masked_fill(mask == 0, tok.pad_token_id)
        texts = tok.batch_decode(completion * mask + tok.pad_token_id * (1 - mask), skip_special_tokens=True)
        return Rollouts(
            enc.input_ids.cpu(), enc.attention_mask.cpu(), completion.cpu(), mask.cpu(),
            (logprobs * mask).float().cpu(), texts, truncated.cpu(),
        )


def _as_list(x) -> list[int]:
    return list(x) if isinstance(x, (list, tuple)) else [x]
