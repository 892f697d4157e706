"""Tensor-accounting memory profiler: live tensor bytes per phase, and at the
peak the split into parameters, gradients, optimizer state and activations/other.

    prof = MemoryProfiler(model, optimizer_state=lambda: method_state_tensors)
    with prof:                          # a TorchDispatchMode: sees every tensor an op creates
        with prof.phase("fwd_bwd"): ...
        with prof.phase("optimizer"): ...
    prof.record()  # {"mem/fwd_bwd/peak_bytes": ..., "mem/params_bytes": ..., ...}

Accounting: a storage counts from its first sight (created or read by an op under the mode, or
registered up front: the model's parameters, existing grads and optimizer state) until it is freed (a
weak finalizer on the storage), at its current size: a storage resized in place
(``UntypedStorage.resize_``, how FSDP2 frees and re-allocates its gathered parameters) is followed.
A wrapper tensor (a DTensor) counts as its local shard. At every new peak, the live storages are classified by identity:
params = the model's parameters, grads = their ``.grad``, optimizer = tensors returned by
``optimizer_state()`` (moments, sketches, bases, masters), everything else = activations/other.
Categories therefore add up to the peak exactly. The trainer opens one per step with
``log.memory_profile=true`` (:class:`StepProfiler`); ``trace=True`` also lists every storage alive at
the peak with the op that made it (``python -m experiments.memory_table trace=1``).
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

PHASES = ("init", "init_reference", "rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync")


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse/meta/wrapper tensors have none
        return None


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s data: ``t`` itself, or the inner tensors of a wrapper subclass (a
    DTensor's local shard), whose own storage would report the global size."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [x for v in inner if isinstance(v, torch.Tensor) for x in _plain(v)]
    return [t]


class MemoryProfiler(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module, optimizer_state: Callable[[], Iterable[torch.Tensor]] = lambda: (),
                 trace: bool = False):
        super().__init__()
        self.model, self.optimizer_state = model, optimizer_state
        # trace=True: remember which op made each storage (and its shape), and at the peak list every live
        # storage as (category, op, shape, dtype, bytes) in ``peak_tensors`` (slower; for finding the peak)
        self.trace = trace
        self.meta: dict[int, tuple] = {}
        self.peak_tensors: list[tuple] = []
        self.phase_tensors: dict[str, list[tuple]] = {}  # trace=True: (op, shape, dtype, bytes) alive at each phase's peak
        self._op = "registered"
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.current = 0
        self.peak = 0
        self.peak_split: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self.phase_starts: dict[str, int] = {}  # live bytes when the phase was first entered
        self._phase: str | None = None
        self.peak_phase: str | None = None  # the phase during which the peak was reached

    # --- accounting
    def _see(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor: count its local shard, not the global size
            for inner in _plain(t):
                self._see(inner)
            return
        st = _storage(t)
        if st is None or st.device.type == "meta":
            return
        key = id(st)
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        if self.trace:
            self.meta[key] = (self._op, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        weakref.finalize(st, self._free, key)
        if self._phase is not None:
            if self.trace and self.current > self.phase_peaks.get(self._phase, 0):
                self.phase_tensors[self._phase] = [(*self.meta.get(k, ("?", (), "?")), n) for k, n in self._snapshot()]
            self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), self.current)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self._phase
            self.peak_split = self._split()

    def _snapshot(self) -> list[tuple[int, int]]:
        """The live storages as a list. A storage's finalizer may run during the copy itself (a collection
        the copy's allocation triggers) and pop from ``live``; then the copy is taken again."""
        while True:
            try:
                return list(self.live.items())
            except RuntimeError:  # dictionary changed size during iteration
                continue

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self.meta.pop(key, None)

    def _ids(self, tensors) -> set[int]:
        out = set()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                out.update(id(st) for x in _plain(t) if (st := _storage(x)) is not None)
        return out

    def _split(self) -> dict[str, int]:
        params = self._params  # fixed for the profile's life; their .grad and the optimizer state are read afresh
        cats = {"params": self._param_ids, "grads": self._ids(p.grad for p in params if p.grad is not None),
                "optimizer": self._ids(self.optimizer_state())}
        split = {k: 0 for k in ("params", "grads", "optimizer", "activations")}
        listed = []
        for key, n in self._snapshot():
            name = next((c for c, ids in cats.items() if key in ids), "activations")
            split[name] += n
            if self.trace:
                listed.append((name, *self.meta.get(key, ("?", (), "?")), n))
        if self.trace:
            self.peak_tensors = listed
        return split

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t)

    def _resized(self, storage, nbytes: int) -> None:
        key = id(storage)
        if key in self.live:
            self.current += nbytes - self.live[key]
            self.live[key] = nbytes
            if nbytes and self._phase is not None:
                self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), self.current)
            if self.current > self.peak:
                self.peak, self.peak_phase = self.current, self._phase
                self.peak_split = self._split()

    def __enter__(self):
        params = self._params = list(self.model.parameters())
        self._param_ids = self._ids(params)
        self.register(params)
        self.register(p.grad for p in params if p.grad is not None)
        self.register(self.optimizer_state())
        original, profiler = torch.UntypedStorage.resize_, self
        self._original_resize = original

        def resize_(storage, nbytes):
            out = original(storage, nbytes)
            profiler._resized(storage, int(nbytes))
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _tensor_args(args, kwargs):  # made outside the mode (a file's mapped tensor, a buffer)
            self._see(t)
        out = func(*args, **(kwargs or {}))
        if self.trace:
            self._op = str(getattr(func, "__name__", func))
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no pytree walk
            self._see(out)
            return out
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
        self.phase_starts.setdefault(name, self.current)
        try:
            yield
        finally:
            self._phase = prev

    def record(self) -> dict[str, float]:
        rec = {f"mem/{p}/peak_bytes": float(v) for p, v in self.phase_peaks.items()}
        rec.update({f"mem/{p}/start_bytes": float(v) for p, v in self.phase_starts.items()})
        rec.update({f"mem/{k}_bytes": float(v) for k, v in self.peak_split.items()})
        rec["mem/tensor_peak_bytes"] = float(self.peak)
        return rec


def _tensor_args(args, kwargs):
    """The tensors among an op's arguments. An ATen schema nests at most one level (``Tensor[]``,
    ``Tensor?[]``), so one level is walked without pytree, which cost more than the op on small tensors."""
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    yield t
                elif isinstance(t, (list, tuple, dict)):  # not an ATen schema, but whatever the caller passed
                    yield from (x for x in tree_flatten(t)[0] if isinstance(x, torch.Tensor))
        elif isinstance(a, dict):
            yield from (x for x in tree_flatten(a)[0] if isinstance(x, torch.Tensor))


def optimizer_tensors(method, model) -> list[torch.Tensor]:
    """Every tensor of the method's optimizer state (and LoGRA sketches held on the modules)."""
    out: list[torch.Tensor] = []

    def walk(v, depth=0):
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, depth)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x, depth)
        elif depth < 1 and hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module):
            walk(vars(v), depth + 1)  # e.g. a GaLoreProjector's ortho_matrix

    opts = list(getattr(method, "optimizers", {}).values()) or [method.optimizer]
    for opt in opts:
        walk(dict(opt.state))
    masters = getattr(method, "master_weights", None)  # fp32 masters of a bf16 model (baselines/precision.py)
    if masters is not None:
        out += list(masters.master_of.values())
    for state in _sketch_states(model):
        if torch.is_tensor(getattr(state, "sketch", None)):
            out.append(state.sketch)
    return out


_SKETCH_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _sketch_states(model) -> list:
    """The modules' ``sketch_state`` objects (LoGRA's sketched layers), found once per model: the
    profiler asks at every new peak, and a walk over every module each time cost seconds a step."""
    try:
        return _SKETCH_STATES[model]
    except KeyError:
        states = [s for m in model.modules() if (s := getattr(m, "sketch_state", None)) is not None]
        _SKETCH_STATES[model] = states
        return states
    except TypeError:  # not weak-referenceable
        return [s for m in model.modules() if (s := getattr(m, "sketch_state", None)) is not None]


class StepProfiler:
    """The trainer's handle on a step's phases. With ``log.memory_profile=true``: a fresh
    :class:`MemoryProfiler` per step, phases named as in ``PHASES`` (a training step may open several
    ``step()`` blocks: they merge); on CUDA a phase's peak is also the allocator's
    (``max_memory_allocated``, reset at the phase's start). Disabled, the memory side is a no-op
    (the default: the accounting slows a step).

    Always, whether profiling memory or not, the phases in :data:`TIMED` are timed (wall clock; on
    CUDA with a device synchronisation at each edge, as ``experiments.time_table`` does): the runs'
    own phase timers, so a sweep shows a step's time by phase without a second pass
    (``analysis.steptime``). ``optimizer`` excludes the phases nested in it (:data:`NESTED`: the KL
    prediction, and ``kl_realized``, step_control.measure_realized's forwards — a diagnostic, timed
    only, its memory counted under ``optimizer``); the rollout and sync phases are the trainer's own
    ``time/rollout_s`` and ``time/sync_s``.
    ``record()`` gives the step's ``mem/*`` and ``time/<phase>_s`` keys; the ``mem/*`` ones are
    also appended to ``<run_dir>/memory_profile.jsonl``."""

    TIMED = ("old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "kl_realized")
    NESTED = ("kl_predict", "kl_realized")  # opened inside ``optimizer``, whose time excludes them

    def __init__(self, enabled: bool, model, state: Callable[[], Iterable[torch.Tensor]], device, path=None,
                 resident: Callable[[], Iterable[torch.Tensor]] = lambda: ()):
        self.enabled, self.model, self.state, self.device, self.path = enabled, model, state, device, path
        self.resident = resident  # tensors alive beside the trainer's (a rollout engine's copy), counted from the start
        self.prof: MemoryProfiler | None = None
        self.cuda_peaks: dict[str, int] = {}
        self.last: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    @contextmanager
    def step(self, index: int = 0):
        if not self.enabled:
            yield
            return
        trace = os.environ.get("LOGRA_MEMORY_TRACE", "") not in ("", "0")  # debugging: what is alive at each phase's peak
        self.prof, self.cuda_peaks = MemoryProfiler(self.model, self.state, trace=trace), {}
        with self.prof:
            self.prof.register(self.resident())
            yield
        if trace and self.path is not None:
            write_phase_trace(self.prof, Path(str(self.path) + ".trace.txt"), index)
        rec = self.prof.record()
        for name, peak in self.cuda_peaks.items():
            rec[f"mem/{name}/peak_bytes"] = float(peak)  # the allocator's figure on CUDA
        # several step() blocks in one training step: phases merge, the categories of the larger peak win
        if rec["mem/tensor_peak_bytes"] < self.last.get("mem/tensor_peak_bytes", -1.0):
            rec = {k: v for k, v in rec.items() if k.count("/") == 2}
        self.last.update(rec)
        self.index = index
        self.prof = None

    def _clock(self) -> float:
        if getattr(self.device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        timed = name in self.TIMED
        t0 = self._clock() if timed else 0.0
        try:
            with self._memory_phase(name):
                yield
        finally:
            if timed:
                self.seconds[name] = self.seconds.get(name, 0.0) + self._clock() - t0

    @contextmanager
    def _memory_phase(self, name: str):
        if self.prof is None or name not in PHASES:  # a timed-only phase: its memory is the enclosing phase's
            yield
            return
        cuda = getattr(self.device, "type", "cpu") == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.prof.phase(name):
            yield
        if cuda:
            self.cuda_peaks[name] = max(self.cuda_peaks.get(name, 0), torch.cuda.max_memory_allocated(self.device))

    def record(self) -> dict[str, float]:
        """The step's ``mem/*`` keys (appended to the profile file) and phase times, then reset for the next step."""
        out, self.last = self.last, {}
        if out:
            self.write({"step": getattr(self, "index", 0), **out})
        seconds, self.seconds = self.seconds, {}
        if "optimizer" in seconds:
            seconds["optimizer"] -= sum(seconds.get(name, 0.0) for name in self.NESTED)
        return {**out, **{f"time/{name}_s": value for name, value in seconds.items()}}

    def write(self, record: dict) -> None:
        """Append one record to the profile file (when there is one)."""
        if self.path is not None:
            import json
            from pathlib import Path

            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def write_phase_trace(prof: MemoryProfiler, path: Path, step: int = 0) -> None:
    """Append, per phase, the storages alive at its peak grouped by (creating op, shape, dtype), largest
    first (``LOGRA_MEMORY_TRACE=1``: for finding what a phase holds)."""
    from collections import Counter

    lines = []
    for phase, tensors in prof.phase_tensors.items():
        groups, nbytes = Counter(), Counter()
        for op, shape, dtype, n in tensors:
            groups[(op, shape, dtype)] += 1
            nbytes[(op, shape, dtype)] += n
        lines.append(f"step {step} phase {phase}: {sum(nbytes.values())} bytes")
        lines += [f"  {nbytes[k]:>12} {groups[k]:>5}x {k[0]:<40} {k[1]} {k[2]}" for k in sorted(nbytes, key=lambda k: -nbytes[k])[:40]]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
