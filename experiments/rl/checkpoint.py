"""Checkpoints: model weights (safetensors), method/optimizer state, RNG states, data cursor.

Layout: ``<run_dir>/checkpoints/step_000010/`` with ``model.safetensors``, ``method.pt``,
``rng.pt`` and ``trainer_state.json``. A checkpoint is written under a temporary name and renamed
into place, so a crash mid-write leaves no half checkpoint under a real name; all ``.pt`` files
load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

PREFIX = "step_"


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


def save_checkpoint(run_dir: Path, step: int, model, method_state: dict, trainer_state: dict, keep: int = 2) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp_{PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(method_state, tmp / "method.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    done = [p for p in root.glob(f"{PREFIX}*") if (p / "trainer_state.json").exists()] if root.exists() else []
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


def load_checkpoint(path: Path, model) -> tuple[dict, dict]:
    """Load weights into ``model`` and the RNG states; return (method_state, trainer_state)."""
    path = Path(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if unexpected or missing:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    method_state = torch.load(path / "method.pt", weights_only=True)
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return method_state, json.loads((path / "trainer_state.json").read_text())
