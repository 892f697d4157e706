"""Tensor-accounting memory profiler (issue 7, first part): live tensor bytes per phase, and at the
peak the split into parameters, gradients, optimizer state and activations/other.

    prof = MemoryProfiler(model, optimizer_state=lambda: method_state_tensors)
    with prof:                          # a TorchDispatchMode: sees every tensor an op creates
        with prof.phase("fwd_bwd"): ...
        with prof.phase("optimizer"): ...
    prof.record()  # {"mem/fwd_bwd/peak_bytes": ..., "mem/params_bytes": ..., ...}

Accounting: a storage counts from its first sight (created by an op under the mode, or registered
up front: the model's parameters, existing grads and optimizer state) until it is freed (a weak
finalizer on the storage). At every new peak, the live storages are classified by identity:
params = the model's parameters, grads = their ``.grad``, optimizer = tensors returned by
``optimizer_state()`` (moments, sketches, bases, masters), everything else = activations/other.
Categories therefore add up to the peak exactly. NOT yet wired into the trainer (issue 7 open).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PHASES = ("rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync")


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse/meta/wrapper tensors have none
        return None


class MemoryProfiler(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module, optimizer_state: Callable[[], Iterable[torch.Tensor]] = lambda: ()):
        super().__init__()
        self.model, self.optimizer_state = model, optimizer_state
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.current = 0
        self.peak = 0
        self.peak_split: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self._phase: str | None = None

    # --- accounting
    def _see(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is None or st.device.type == "meta":
            return
        key = id(st)
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        weakref.finalize(st, self._free, key)
        if self._phase is not None:
            self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), self.current)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_split = self._split()

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _ids(self, tensors) -> set[int]:
        out = set()
        for t in tensors:
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
                out.add(id(st))
        return out

    def _split(self) -> dict[str, int]:
        params = list(self.model.parameters())
        cats = {"params": self._ids(params), "grads": self._ids(p.grad for p in params if p.grad is not None),
                "optimizer": self._ids(self.optimizer_state())}
        split = {k: 0 for k in ("params", "grads", "optimizer", "activations")}
        for key, n in self.live.items():
            name = next((c for c, ids in cats.items() if key in ids), "activations")
            split[name] += n
        return split

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t)

    def __enter__(self):
        params = list(self.model.parameters())
        self.register(params)
        self.register(p.grad for p in params if p.grad is not None)
        self.register(self.optimizer_state())
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out

    @contextmanager
    def phase(self, name: str):
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        prev, self._phase = self._phase, name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)
        try:
            yield
        finally:
            self._phase = prev

    def record(self) -> dict[str, float]:
        rec = {f"mem/{p}/peak_bytes": float(v) for p, v in self.phase_peaks.items()}
        rec.update({f"mem/{k}_bytes": float(v) for k, v in self.peak_split.items()})
        rec["mem/tensor_peak_bytes"] = float(self.peak)
        return rec
