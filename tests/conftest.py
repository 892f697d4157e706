"""Shared fixtures: a toy task whose reward a random tiny model can earn, tiny-run overrides."""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]

# A tiny GRPO run: tiny-llama, 2 prompts × 4 samples, 8 new tokens, toy reward.
TINY = [
    "model=tiny-llama",
    "task=toy",
    "train.prompts_per_step=2",
    "train.group_size=4",
    "train.micro_batch_size=4",
    "rollout.max_new_tokens=8",
    "eval.size=4",
    "eval.every=2",
    "log.progress=false",
]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The GSM8K/MATH-500 JSONL folder (CI: LOGRA_DATA_DIR=../shared/data)."""
    path = Path(os.environ.get("LOGRA_DATA_DIR", REPO.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"no data folder at {path} (set LOGRA_DATA_DIR)")
    return path
