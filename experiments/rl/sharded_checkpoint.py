"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) for row-sharded (FSDP2) training.

Every rank writes its own shards; nothing is gathered. A checkpoint directory (crash-safe as in
:mod:`experiments.rl.checkpoint`: ``.tmp_`` dir, fsync, manifest with SHA-256 of every file last,
rename) holds

* ``dcp/``: one DCP checkpoint of ``{"model": the model's state dict, "method": the method state's
  tensors}`` (``__<rank>_0.distcp`` files and ``.metadata``). Model weights and dense AdamW moments
  are DTensors already; a method tensor that holds one entry per row of a row-sharded weight (LoGRA's
  RowAdam second moment, its first moment and fp32 master: this rank's rows, a plain tensor) is saved
  as the row-sharded DTensor it is a part of, so DCP knows each shard's offset;
* ``method_structure.pt``: the method state with each tensor replaced by its key in ``dcp/`` and how
  it was held (``rows`` / ``dtensor`` / ``plain``); a tensor reached twice (LoGRA keeps its fp32
  tensors under two names) is stored once;
* ``rng_rank<r>.pt`` per rank, ``trainer_state.json`` (step, data position) from rank 0.

Loading allocates every tensor for the *current* layout (this world size's row shards, or whole
tensors in one process) and lets DCP read the overlapping parts of the saved shards, so a run
resumes on the same world size bit for bit and on another one (2 → 1) with the same numbers laid out
anew. Only methods whose state is ``{"optimizer": <a torch optimizer state_dict>}`` (plus extras
whose tensors are among the optimizer's) are supported: a tensor belongs to the parameter whose
optimizer-state index holds it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from experiments.rl.checkpoint import (begin_checkpoint, finish_checkpoint, rng_state, set_rng_state,
                                       verify_checkpoint)
from logra_core.distributed import local, local_rows

DCP_DIR = "dcp"
STRUCTURE = "method_structure.pt"
_TENSOR = "\x00tensor"  # placeholder tag in the structure: (_TENSOR, key, kind)


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at ``path`` was written by :func:`save_sharded`."""
    return (Path(path) / DCP_DIR).is_dir()


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _optimizer_params(method) -> list[torch.Tensor]:
    """The parameters in the index order of ``optimizer.state_dict()['state']``."""
    seen, out = set(), []
    for group in method.optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _owner(path: tuple, params: list[torch.Tensor]):
    """The parameter a tensor at ``path`` of the method state belongs to (``optimizer/state/<i>/...``)."""
    if len(path) >= 3 and path[0] == "optimizer" and path[1] == "state":
        return params[int(path[2])]
    return None


def _row_dtensor(t: torch.Tensor, p: DTensor) -> DTensor:
    """This rank's rows ``t`` of a tensor with ``p``'s rows, as the row-sharded DTensor they are part of."""
    shape = (p.shape[0], *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t.contiguous(), p.device_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _split(state, params, path=(), tensors=None, seen=None):
    """(structure, {key: tensor}) of a nested method state (see the module doc)."""
    tensors = {} if tensors is None else tensors
    seen = {} if seen is None else seen
    if isinstance(state, dict):
        return {k: _split(v, params, path + (k,), tensors, seen)[0] for k, v in state.items()}, tensors
    if isinstance(state, (list, tuple)):
        return type(state)(_split(v, params, path + (i,), tensors, seen)[0] for i, v in enumerate(state)), tensors
    if not torch.is_tensor(state):
        return state, tensors
    if id(state) in seen:
        return seen[id(state)], tensors
    key = "/".join(str(x) for x in path)
    p = _owner(path, params)
    if isinstance(state, DTensor):
        kind, value = "dtensor", state
    elif p is not None and local_rows(p) is not None and state.dim() >= 1 and state.shape[0] == local(p).shape[0]:
        kind, value = "rows", _row_dtensor(state, p)
    else:
        kind, value = "plain", state
    tensors[key] = value
    seen[id(state)] = (_TENSOR, key, kind)
    return seen[id(state)], tensors


def _join(structure, loaded: dict):
    if isinstance(structure, tuple) and len(structure) == 3 and structure[0] == _TENSOR:
        _, key, kind = structure
        t = loaded[key]
        return t.to_local() if kind == "rows" and isinstance(t, DTensor) else t
    if isinstance(structure, dict):
        return {k: _join(v, loaded) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_join(v, loaded) for v in structure)
    return structure


def _model_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def save_sharded(run_dir: Path, step: int, model, method, trainer_state: dict, keep: int = 2) -> None:
    """Every rank calls it: the checkpoint of ``step`` in ``run_dir/checkpoints`` (module doc)."""
    import torch.distributed.checkpoint as dcp

    rank, _ = _rank()
    params = _optimizer_params(method)
    structure, tensors = _split(method.state_dict(), params)
    tmp = begin_checkpoint(run_dir, step) if rank == 0 else None
    if dist.is_initialized():
        box = [str(tmp) if tmp else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
    dcp.save({"model": _model_state(model), "method": tensors}, checkpoint_id=str(tmp / DCP_DIR))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(structure, tmp / STRUCTURE)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        finish_checkpoint(run_dir, step, tmp, trainer_state, keep)
    if dist.is_initialized():
        dist.barrier()


def _verify_everywhere(path: Path) -> None:
    """Rank 0 checks every file against the manifest; every rank raises what it found."""
    from experiments.rl.checkpoint import CheckpointCorrupt

    rank, _ = _rank()
    error = None
    if rank == 0:
        try:
            verify_checkpoint(path)
        except CheckpointCorrupt as e:
            error = str(e)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointCorrupt(error)


def _target(meta, p, device) -> torch.Tensor:
    """An empty tensor of a saved tensor's size and dtype, laid out for the current run: row-sharded
    like ``p`` where ``p`` is row-sharded and the tensor has its rows, else whole."""
    size, dtype = tuple(meta.size), meta.properties.dtype
    if p is not None and local_rows(p) is not None and len(size) >= 1 and size[0] == p.shape[0]:
        rows = local_rows(p)
        return _row_dtensor(torch.empty((rows.stop - rows.start, *size[1:]), dtype=dtype, device=device), p)
    return torch.empty(size, dtype=dtype, device="cpu" if len(size) == 0 else device)


def load_sharded(path: Path, model, method) -> dict:
    """Verify ``path`` (:class:`CheckpointCorrupt` naming the file), load the model's and the method's
    state into the current layout, this rank's RNG state; return the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    path = Path(path)
    _verify_everywhere(path)
    rank, _ = _rank()
    structure = torch.load(path / STRUCTURE, weights_only=True)
    metadata = FileSystemReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata
    params = _optimizer_params(method)
    device = local(params[0]).device if params else torch.device("cpu")
    targets = {}
    for full_key, meta in metadata.items():
        if not full_key.startswith("method.") or not isinstance(meta, TensorStorageMetadata):
            continue
        key = full_key[len("method."):]
        targets[key] = _target(meta, _owner(tuple(key.split("/")), params), device)
    model_state = _model_state(model)
    dcp.load({"model": model_state, "method": targets}, checkpoint_id=str(path / DCP_DIR))
    set_model_state_dict(model, model_state)
    method.load_state_dict(_join(structure, targets))
    rng = path / f"rng_rank{rank}.pt"
    if rng.is_file():  # another world size: ranks beyond the saved ones keep their seeds
        set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())




def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model weights of a sharded checkpoint, read in this process (no process group), by name."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # what dcp_to_torch_save uses

    reader = FileSystemReader(str(Path(path) / DCP_DIR))
    keys = {k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")}
    state: dict = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return dict(state["model"])
