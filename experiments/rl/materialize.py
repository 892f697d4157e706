"""Models built without their whole weights anywhere: a skeleton, then each tensor's own rows.

A model is built in two steps (docs/distributed.md, "Loading"):

1. **skeleton** — the architecture from its config with every parameter on the ``meta`` device (no
   memory; buffers such as RoPE's inverse frequencies are real), weights tied as the config says;
2. **materialize** — parameters allocated where they will live (``to_empty``), each filled with the
   rows it holds from a :class:`WeightSource`, a block of about :data:`READ_ELEMENTS` at a time. One
   process holds every row; under FSDP2 the skeleton is sharded first, so each rank allocates and
   reads only its own rows.

Sources:

* :class:`SafetensorsSource` — a folder of ``*.safetensors`` files (a local model, a hub snapshot, the
  embedded SmolLM2's cached conversion): a parameter's rows are read by ``safe_open(...).get_slice``
  from the memory-mapped file, so no process reads more than its rows.
* :class:`RandomInit` — the random initialization of ``tiny-llama`` and the ``random:`` presets,
  keyed so that any rows can be drawn alone: element e of parameter P is

      σ · randn from a CPU generator seeded by SplitMix64(init seed, CRC-32(P), ⌊e / 2¹⁶⌋), element e mod 2¹⁶,

  σ = the config's ``initializer_range`` (HF's init for linear
  and embedding weights; an embedding's padding row is zero); biases are zero and other parameters
  (norms) take the value HF's ``_init_weights`` gives their module (ones; zeros for Gemma-2's). The
  rows of one rank equal the same rows of the whole tensor, bit for bit.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from logra_core.distributed import local, local_rows

RANDOM_BLOCK = 1 << 16  # elements of one keyed block of the random initialization
READ_ELEMENTS = 1 << 18  # elements read from a source at once (the load's transient: a few MB, never a whole tensor)


class WeightSource:
    """Where a model's weights come from: the rows of a parameter by name."""

    def bind(self, model: nn.Module) -> None:
        """Called once with the skeleton (before sharding), e.g. to learn which module holds what."""

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def read(self, name: str, rows: Optional[slice], like: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (all when None) of parameter ``name``, shaped as ``like`` (this rank's part), in
        any dtype and on any device (the caller copies it into place)."""
        raise NotImplementedError


class SafetensorsSource(WeightSource):
    """The ``*.safetensors`` files of a folder; a tensor's rows read from the memory-mapped file."""

    def __init__(self, folder):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            files = {self.folder / f for f in json.loads(index.read_text())["weight_map"].values()}
        else:
            files = set(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.folder}")
        self.handles = [safe_open(str(f), "pt") for f in sorted(files)]
        self.where = {key: h for h in self.handles for key in h.keys()}

    def has(self, name: str) -> bool:
        return name in self.where

    def read(self, name, rows, like):
        piece = self.where[name].get_slice(name)
        return piece[rows] if rows is not None else piece[:]


def keyed_normal(start: int, count: int, seed: int, salt: int, std: float) -> torch.Tensor:
    """Elements ``start`` … ``start + count − 1`` of a keyed N(0, std²) sequence (module docstring), fp32 on
    the CPU: block b of :data:`RANDOM_BLOCK` elements is ``torch.randn`` from a CPU generator seeded by
    SplitMix64(seed, salt, b), so any range is drawn from the blocks it overlaps alone."""
    out = torch.empty(count, dtype=torch.float32)
    first, last = start // RANDOM_BLOCK, (start + count - 1) // RANDOM_BLOCK if count else -1
    g = torch.Generator()
    for b in range(first, last + 1):
        g.manual_seed(_splitmix64((seed * 0x9E3779B1 + salt) * 0x100000001B3 + b) & ((1 << 63) - 1))
        block = torch.randn(RANDOM_BLOCK, generator=g)
        lo, hi = max(start, b * RANDOM_BLOCK), min(start + count, (b + 1) * RANDOM_BLOCK)
        out[lo - start : hi - start] = block[lo - b * RANDOM_BLOCK : hi - b * RANDOM_BLOCK]
    return out.mul_(std)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


class RandomInit(WeightSource):
    """A seeded random initialization any rows of which can be drawn alone (module docstring)."""

    def __init__(self, seed: int, std: float):
        self.seed, self.std = int(seed), float(std)
        self.kind: dict[str, tuple] = {}

    def bind(self, model: nn.Module) -> None:
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = f"{mname}.{pname}" if mname else pname
                if name in self.kind:
                    continue
                if p.dim() >= 2 and isinstance(module, (nn.Linear, nn.Embedding)):
                    pad = module.padding_idx if isinstance(module, nn.Embedding) else None
                    self.kind[name] = ("normal", pad)
                elif pname == "bias":
                    self.kind[name] = ("zeros",)
                else:  # a norm's weight: what HF's init gives its module, drawn on a small CPU copy
                    self.kind[name] = ("module", _initialized_value(model, module, pname))

    def has(self, name: str) -> bool:
        return name in self.kind

    def read(self, name, rows, like):
        kind = self.kind[name]
        if kind[0] == "zeros":
            return torch.zeros(like.shape)
        if kind[0] == "module":
            return kind[1][rows] if rows is not None else kind[1]
        per_row = like[0].numel() if like.dim() > 1 else 1
        first = rows.start if rows is not None else 0
        values = keyed_normal(first * per_row, like.numel(), self.seed, zlib.crc32(name.encode()), self.std).view(like.shape)
        pad = kind[1]
        if pad is not None and first <= pad < first + like.shape[0]:
            values[pad - first].zero_()
        return values


def _initialized_value(model: nn.Module, module: nn.Module, pname: str) -> torch.Tensor:
    import copy

    if any(p.dim() >= 2 for p in module.parameters(recurse=False)):
        raise ValueError(f"no random initializer for {type(module).__name__}.{pname} beside a matrix parameter")
    small = copy.deepcopy(module).to_empty(device="cpu")
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ValueError(f"no random initializer for {type(module).__name__}.{pname} (not an HF model)")
    with torch.random.fork_rng():
        init(small)
    return getattr(small, pname).detach().clone()


def skeleton(config, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """The model of ``config`` with every parameter on the meta device, tied as the config says: no
    memory for weights (nothing is allocated, not even a tensor at a time), nothing initialized.
    Buffers (RoPE's inverse frequencies: computed, not stored) come real from a one-layer donor model
    of the same config, whose parameters are meta as well."""
    import copy

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), torch.random.fork_rng():  # draws nothing from the caller's RNG
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()
    donor_config = copy.deepcopy(config)
    donor_config.num_hidden_layers, donor_config.vocab_size = 1, 8
    with init_empty_weights(include_buffers=False), torch.random.fork_rng():
        donor = AutoModelForCausalLM.from_config(donor_config, dtype=dtype, attn_implementation=attn_implementation)
    values = dict(donor.named_buffers())
    for name, b in list(model.named_buffers()):
        if name not in values:
            raise ValueError(f"skeleton: no value for the buffer {name!r} (a per-layer buffer the one-layer donor lacks)")
        owner, _, bname = name.rpartition(".")
        model.get_submodule(owner)._buffers[bname] = values[name]
    return model


@torch.no_grad()
def materialize(model: nn.Module, source: Optional[WeightSource], device) -> nn.Module:
    """Allocate ``model``'s parameters on ``device`` — for a sharded model (DTensors) only this rank's
    rows — and fill each from ``source`` (None: leave them uninitialized, e.g. an engine copy that its
    first full sync fills). Buffers keep their values; ties survive."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    ties = _ties(model)
    for (mname, pname), _ in ties:  # one allocation per shared parameter: its second holders re-tied after
        model.get_submodule(mname)._parameters[pname] = None
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, bname = name.rpartition(".")
        getattr(model.get_submodule(owner), bname).copy_(value)
    _retie(model, ties)
    if source is None:
        return model
    missing = [n for n, _ in model.named_parameters() if not source.has(n)]
    if missing:
        raise ValueError(f"the weight source has no {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                         f"({len(missing)} parameter(s)): a parameter added before materializing (an adapter) "
                         "has no initializer here")
    for name, p in model.named_parameters():
        part, rows = local(p), local_rows(p)
        first = rows.start if rows is not None else 0
        per_row = part[0].numel() if part.dim() > 1 and part.shape[0] else 1
        step = max(1, READ_ELEMENTS // per_row)
        for i in range(0, part.shape[0] if part.dim() else 1, step):  # a few MB read at a time
            block = part[i : i + step] if part.dim() else part
            block.copy_(source.read(name, slice(first + i, first + i + block.shape[0]) if part.dim() else None, block))
    return model


def _ties(model: nn.Module) -> list[tuple[str, str]]:
    """(module path, parameter name) of every second holder of a shared parameter, with the first's."""
    first, out = {}, []
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            key = id(p)
            if key in first:
                out.append(((mname, pname), first[key]))
            else:
                first[key] = (mname, pname)
    return out


def _retie(model: nn.Module, ties) -> None:
    for (mname, pname), (fmod, fname) in ties:
        model.get_submodule(mname)._parameters[pname] = getattr(model.get_submodule(fmod), fname)
