"""Fault tolerance of a run: non-finite updates skipped, preemption signals, OOM messages.

Non-finite guard. Before an update lands the trainer asks for the first tensor holding a NaN or
an Inf among, in this order: each micro-batch's loss, the accumulated state the method is about to
step from (:meth:`baselines.base.Method.nonfinite`: every ``.grad``; LoGRA's m × r sketches and its
small dense gradients; galore_layerwise reports what its backward hooks saw) and, with step
control, the proposed update Δ. If there is one, the update is skipped: no optimizer step, no
weight sync, the accumulated gradients/sketches are dropped (:meth:`Method.discard`), so weights,
optimizer moments, sketch state and the rollout engine stay bit for bit as they were. The step is
logged with ``step/skipped`` = 1 and the tensor's name goes to ``<run_dir>/skips.jsonl``. After
``guard.max_consecutive_skips`` skipped steps in a row the trainer saves a checkpoint (its weights
are those of the last good update) and raises :class:`NonFiniteError`. With several ranks the
decision is all-reduced, so every rank skips or steps together.

Two limits, stated rather than hidden: a non-finite *update* from finite gradients (a moment
overflow) is caught only with step control, where Δ exists before it is applied, and by then the
optimizer's moments have advanced; galore_layerwise steps each parameter inside backward, so a
NaN gradient found in one layer leaves the layers whose hooks ran before it stepped (it never
steps a parameter from a non-finite gradient, and a non-finite loss steps nothing).

Preemption: :class:`PreemptionSignals` turns SIGTERM / SIGUSR1 (what SLURM and submitit send)
into a flag the trainer reads at the next step boundary, where it checkpoints and raises
:class:`Preempted` (``python -m experiments.train`` exits with :data:`PREEMPTED_EXIT` = 143).

Out of memory: :func:`oom_context` re-raises ``torch.OutOfMemoryError`` with the phase it happened
in and the memory planner's estimate for the run (:mod:`experiments.memory.planner`).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from baselines.base import first_nonfinite

PREEMPTED_EXIT = 143  # exit code of ``python -m experiments.train`` after Preempted (128 + SIGTERM)


@dataclass
class GuardConfig:
    max_consecutive_skips: int = 3  # stop (NonFiniteError, after a checkpoint) when this many steps in a row were skipped for a NaN/Inf; 0 = never stop

    def __post_init__(self):
        if self.max_consecutive_skips < 0:
            raise ValueError(f"guard.max_consecutive_skips must be >= 0, got {self.max_consecutive_skips}")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps were skipped for non-finite losses, gradients or updates."""


class Preempted(Exception):
    """The run was told to stop (SIGTERM/SIGUSR1) and stopped at a checkpoint; rerun with resume=true."""


# ---- non-finite checks ---------------------------------------------------------------------------
def update_nonfinite(update) -> Optional[str]:
    """First non-finite factor or tensor of a proposed :class:`logra_core.update.Update`."""
    named = [(f"update {k} ({side})", t) for k, (d, a) in update.lowrank.items() for side, t in (("D", d), ("A", a))]
    named += [(f"update {k}", t) for k, t in update.dense.items()]
    return first_nonfinite(named)


# ---- preemption ----------------------------------------------------------------------------------
class PreemptionSignals:
    """While open (main thread only), SIGTERM and SIGUSR1 set :attr:`received` (the signal's name)
    instead of killing the process; the previous handlers come back on exit."""

    NAMES = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: Optional[str] = None
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            print(f"[preempt] {name} received: checkpointing at the end of this step, then exiting", flush=True)
        self.received = name

    def __enter__(self) -> "PreemptionSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.NAMES:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old.clear()


# ---- out of memory -------------------------------------------------------------------------------
@contextmanager
def oom_context(phase: str, estimate: Callable[[], str]):
    """Re-raise ``torch.OutOfMemoryError`` raised inside as one that names ``phase`` and
    ``estimate()`` (the planner's figure), chained to the allocator's own error."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if getattr(e, "logra_phase", None):  # already explained by an inner phase
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        err = torch.OutOfMemoryError(f"out of memory in the {phase!r} phase. {estimate()}\nallocator: {first}")
        err.logra_phase = phase
        raise err from e


def planner_estimate(cfg, model_config: Optional[dict], world_size: int, device: torch.device) -> str:
    """One line: the planner's per-GPU prediction for this run and its largest categories, or why
    there is none. Shapes come from the loaded model's config (no download); the sequence length
    assumes 256 prompt tokens + ``rollout.max_new_tokens``."""
    try:
        from experiments.memory import planner

        if model_config is None:
            raise ValueError("the model has no HF config")
        from baselines import METHODS

        method_opts = {"rank": 256, **METHODS[cfg.method].plan_options(getattr(cfg, cfg.method))}
        capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * 2**30
        zero = cfg.dist.deepspeed_config if cfg.dist.deepspeed_config in ("zero2", "zero3") else "zero2"
        sharding = {"fsdp2": "fsdp", "deepspeed": zero}.get(cfg.dist.strategy, "none") if world_size > 1 else "none"
        seq_len = 256 + cfg.rollout.max_new_tokens
        rows = cfg.train.prompts_per_step * cfg.train.group_size // world_size
        opts = {"gradient_checkpointing": cfg.model.gradient_checkpointing, "master_weights": False,
                "logprob_chunk": cfg.train.logprob_chunk, "completion_len": cfg.rollout.max_new_tokens,
                "micro_batches": max(1, -(-rows // cfg.train.micro_batch_size))}
        p = planner.plan({**model_config, "name": cfg.model.name}, cfg.method, gpus=world_size,
                         gpu_mem_gb=capacity / 2**30, micro_batch=cfg.train.micro_batch_size, seq_len=seq_len,
                         sharding=sharding, rollout="colocated" if cfg.rollout.engine == "vllm" else "none",
                         dtype=cfg.model.dtype, device="cuda" if device.type == "cuda" else "cpu", **method_opts, **opts)
    except Exception as e:  # noqa: BLE001  (the message must not fail in turn)
        return f"The memory planner could not estimate this run ({type(e).__name__}: {e})."
    gib = 2**30
    top = sorted(p.categories.items(), key=lambda kv: -kv[1])[:3]
    return (f"Planner estimate for this run (experiments.memory.planner, micro_batch={cfg.train.micro_batch_size}, "
            f"seq_len~{seq_len}, {sharding} over {world_size} GPU(s)): {p.total_bytes / gib:.2f} GiB per GPU of "
            f"{p.capacity_bytes / gib:.1f} GiB{'' if device.type == 'cuda' else ' (no CUDA device: 80 GiB assumed)'} "
            f"({'fits' if p.fits else 'DOES NOT FIT'}); largest: "
            + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in top)
            + ". Lower train.micro_batch_size / train.logprob_chunk, or enable model.gradient_checkpointing.")
