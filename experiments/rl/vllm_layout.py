"""Where each of the trainer's (HF) tensors lives inside vLLM's model (docs/distributed.md, "vLLM engine").

vLLM fuses projections that read the same input into one linear layer and shards layers
Megatron-style over tensor-parallel ranks (Shoeybi et al., 2019). For the decoder models the harness
trains (Llama, Qwen2, Gemma-2), with k tensor-parallel ranks and rank t:

* ``qkv_proj`` stacks this rank's rows of q, k, v (in that order): q_proj's global rows
  [t·q/k, (t+1)·q/k) are rows [0, q/k) of the fused weight, k_proj's follow at q/k, v_proj's at
  (q + kv)/k; a bias the same way. ``gate_up_proj`` stacks gate and up likewise
  (vLLM's ``packed_modules_mapping``; ``QKVParallelLinear``, ``MergedColumnParallelLinear``);
* ``o_proj`` and ``down_proj`` are row-parallel: rank t holds columns [t·n/k, (t+1)·n/k);
* the embedding (and an untied head) is vocabulary-parallel: the vocabulary is padded to a multiple
  of :data:`VOCAB_PADDING` (V_p) and rank t holds rows [t·V_p/k, (t+1)·V_p/k), of which the real
  ones (< V) are the HF tensor's; a tied head *is* the embedding's parameter, so updating the
  embedding in place updates the head;
* everything else (norms) is replicated whole.

:func:`layout` turns that into a :class:`Slot` per HF tensor: the vLLM parameter, the first row of the
view inside it, and the :class:`~logra_core.sync.Part` of the HF tensor the view holds. A receiver
built on those views (:class:`~logra_core.sync.PartReceiver`) applies payloads to vLLM's own weights in
place and digests them where they live, under the trainer's names. Pure shapes: no vLLM needed, and
``fuse`` builds the vLLM layout from HF tensors (what vLLM's loader does), for tests and checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logra_core.sync import Part

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


@dataclass(frozen=True)
class Slot:
    """HF tensor ``name`` lives in vLLM parameter ``target``, rows [row0, row0 + part rows) of it (all of
    its columns unless the part is a column block: then the target is that block)."""

    name: str
    target: str
    row0: int
    part: Part


def _split(name: str) -> tuple[str, str, str]:
    """'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn', 'q_proj', 'weight')."""
    module, _, suffix = name.rpartition(".")
    prefix, _, leaf = module.rpartition(".")
    return prefix, leaf, suffix


def _join(prefix: str, leaf: str, suffix: str) -> str:
    return f"{prefix}.{leaf}.{suffix}" if prefix else f"{leaf}.{suffix}"


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING) -> int:
    return -(-vocab // padding) * padding


def layout(shapes: dict[str, tuple], tp_rank: int = 0, tp_size: int = 1, packed: dict = PACKED,
           row_parallel: tuple = ROW_PARALLEL, vocab_parallel: tuple = VOCAB_PARALLEL,
           vocab_padding: int = VOCAB_PADDING) -> dict[str, Slot]:
    """A :class:`Slot` per HF tensor (``shapes``: name -> shape, a tied head absent as in
    ``named_parameters``) on tensor-parallel rank ``tp_rank`` of ``tp_size``; every rank has the same
    slots (a vocabulary shard of padding only holds 0 rows), so the ranks' digests line up."""
    fused_of = {leaf: (fused, parts) for fused, parts in packed.items() for leaf in parts}
    slots: dict[str, Slot] = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        prefix, leaf, suffix = _split(name)
        if leaf in fused_of:
            fused, parts = fused_of[leaf]
            row0 = 0
            for sibling in parts[: parts.index(leaf)]:
                sib = shapes.get(_join(prefix, sibling, suffix))
                if sib is None:
                    raise ValueError(f"{name}: its fused sibling {_join(prefix, sibling, suffix)} is missing")
                row0 += sib[0] // tp_size
            slots[name] = Slot(name, _join(prefix, fused, suffix), row0, Part.rows_of(shape, tp_rank, tp_size))
        elif leaf in row_parallel and len(shape) == 2:
            slots[name] = Slot(name, name, 0, Part.cols_of(shape, tp_rank, tp_size))
        elif leaf in vocab_parallel and len(shape) == 2:
            per = padded_vocab(shape[0], vocab_padding) // tp_size
            r0, r1 = min(tp_rank * per, shape[0]), min((tp_rank + 1) * per, shape[0])
            slots[name] = Slot(name, name, 0, Part(shape, r0, r1 - r0))  # no rows: a shard of padding only
        else:  # norms, a row-parallel layer's bias: replicated whole
            slots[name] = Slot(name, name, 0, Part(shape, replica=tp_size > 1))
    return slots


def target_shapes(slots: dict[str, Slot], shapes: dict[str, tuple], tp_size: int = 1,
                  vocab_padding: int = VOCAB_PADDING) -> dict[str, tuple]:
    """The shapes of vLLM's parameters implied by ``slots`` on one rank (padded vocabulary shards)."""
    out: dict[str, list] = {}
    for slot in slots.values():
        shape = tuple(shapes[slot.name])
        r0, r1 = slot.part.row_range
        c0, c1 = slot.part.col_range
        _, leaf, _ = _split(slot.name)
        if leaf in VOCAB_PARALLEL and len(shape) == 2:
            rows = padded_vocab(shape[0], vocab_padding) // tp_size
        else:
            rows = slot.row0 + (r1 - r0)
        if slot.target in out:
            out[slot.target][0] = max(out[slot.target][0], rows)
        else:
            out[slot.target] = [rows] + ([c1 - c0] if len(shape) > 1 else [])
    return {n: tuple(s) for n, s in out.items()}


def views(slots: dict[str, Slot], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each HF tensor's view into vLLM's ``params`` (by vLLM name): a block of rows of its target,
    checked against the slot's part (a mismatch means the layout is not the one vLLM built)."""
    out = {}
    for name, slot in slots.items():
        if slot.target not in params:
            raise KeyError(f"{name}: vLLM has no parameter {slot.target!r}")
        target = params[slot.target].data
        r0, r1 = slot.part.row_range
        c0, c1 = slot.part.col_range
        view = target[slot.row0 : slot.row0 + (r1 - r0)]
        want = (r1 - r0,) + ((c1 - c0,) if len(slot.part.shape) > 1 else ())
        if tuple(view.shape) != want or (target.dim() > 1 and target.shape[1] != want[1]):
            raise ValueError(f"{name}: expected {want} at rows {slot.row0}.. of {slot.target} "
                             f"{tuple(target.shape)}; vLLM's layout differs")
        out[name] = view
    return out


def fuse(hf: dict[str, torch.Tensor], slots: dict[str, Slot], tp_size: int = 1,
         vocab_padding: int = VOCAB_PADDING) -> dict[str, torch.Tensor]:
    """vLLM's parameters of one rank built from whole HF tensors, as vLLM's loader lays them out
    (padding rows zero): the layout's reference for tests."""
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    dtype = next(iter(hf.values())).dtype
    out = {n: torch.zeros(s, dtype=dtype) for n, s in target_shapes(slots, shapes, tp_size, vocab_padding).items()}
    for name, slot in slots.items():
        piece = slot.part.take(hf[name])
        out[slot.target][slot.row0 : slot.row0 + piece.shape[0]].copy_(piece)
    return out
