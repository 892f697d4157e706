"""Checkpoints: model weights (safetensors), method/optimizer state, RNG states, data cursor.

Layout: ``<run_dir>/checkpoints/step_000010/`` with ``model.safetensors``, ``method.pt``,
``rng.pt``, ``trainer_state.json`` and, written last, ``manifest.json`` (step, every file with its
size and SHA-256). Crash safety: everything is written into ``.tmp_step_000010/``, flushed to disk
(fsync), the manifest last; then the directory is renamed into place, atomically. A directory
under a real name without a manifest, or a leftover ``.tmp_*``, is therefore incomplete: it is
reported and ignored (:func:`scan_checkpoints`), and the next save removes leftovers. Loading
checks every file against the manifest and refuses a mismatch (:class:`CheckpointCorrupt`).

Sharded checkpoints (``dist.strategy=fsdp2``, :mod:`experiments.rl.sharded_checkpoint`) put the
model's and the method's tensors in ``dcp/`` (``torch.distributed.checkpoint``: one file per rank
plus ``.metadata``), the method state's structure in ``method_structure.pt`` and one
``rng_rank<r>.pt`` per rank; the same manifest lists every file, shards included.

Safe loading: weights are safetensors; every ``.pt`` file loads with ``torch.load(weights_only=True)``
(no pickle of code: GaLore's projector objects are stored as plain tensors and numbers, see
``baselines/galore.py``), and only after its checksum matched the manifest the run wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

PREFIX = "step_"
TMP = ".tmp_"
MANIFEST = "manifest.json"


class CheckpointCorrupt(RuntimeError):
    """A checkpoint file does not match its manifest (changed, truncated or missing)."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model, method_state: dict, trainer_state: dict, keep: int = 2) -> Path:
    """Write ``checkpoints/step_<step>`` crash-safely (module doc); keep the newest ``keep`` (0 = all)."""
    tmp = begin_checkpoint(run_dir, step)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(method_state, tmp / "method.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    return finish_checkpoint(run_dir, step, tmp, trainer_state, keep)


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """The fresh ``.tmp_step_<step>`` directory a checkpoint is written into (leftovers of a crashed
    write removed). One process calls it; writers then fill the directory."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{TMP}*"):  # what a crashed write left behind
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{TMP}{PREFIX}{step:06d}"
    tmp.mkdir()
    return tmp


def finish_checkpoint(run_dir: Path, step: int, tmp: Path, trainer_state: dict, keep: int = 2) -> Path:
    """Add ``trainer_state.json``, fsync every file (subfolders too: a sharded checkpoint's shards),
    write the manifest last, rename ``tmp`` into place; keep the newest ``keep`` (0 = all)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:06d}"
    (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=1))
    files = {}
    for f in sorted(x for x in tmp.rglob("*") if x.is_file()):
        _fsync(f)
        files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    for d in sorted((x for x in tmp.rglob("*") if x.is_dir()), reverse=True):
        _fsync(d)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    if final.exists():  # the same step saved again: swap, so a complete one exists at every moment
        old = root / f"{TMP}old_{final.name}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync(root)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def scan_checkpoints(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints, oldest first; incomplete ones: leftover ``.tmp_*`` and dirs without a manifest)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return [], []
    complete, incomplete = [], []
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if p.name.startswith(TMP):
            incomplete.append(p)
        elif p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            (complete if (p / MANIFEST).is_file() else incomplete).append(p)
    return sorted(complete, key=lambda p: int(p.name[len(PREFIX):])), sorted(incomplete)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (with a manifest), oldest first."""
    return scan_checkpoints(run_dir)[0]


def verify_checkpoint(path: Path) -> dict:
    """The manifest of ``path`` after checking every file it lists; :class:`CheckpointCorrupt` if not."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable {MANIFEST} ({e})") from None
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointCorrupt(f"checkpoint {path}: {name} is missing")
        if f.stat().st_size != meta["bytes"] or sha256(f) != meta["sha256"]:
            raise CheckpointCorrupt(f"checkpoint {path}: {name} does not match its SHA-256 in {MANIFEST} "
                                    "(changed or truncated after it was written); refusing to load it. Remove this "
                                    "checkpoint directory to resume from the previous one.")
    return manifest


def load_checkpoint(path: Path, model) -> tuple[dict, dict]:
    """Verify ``path`` against its manifest, load weights into ``model`` and the RNG states; return
    (method_state, trainer_state)."""
    path = Path(path)
    verify_checkpoint(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if unexpected or missing:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    method_state = torch.load(path / "method.pt", weights_only=True)
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return method_state, json.loads((path / "trainer_state.json").read_text())
