"""The run directory: the record of one run (``<out_dir>/``), read and written in one place.

It holds ``config.yaml`` (the resolved config), ``meta.json`` (git sha, library versions, start time,
one entry per resumption), ``metrics.jsonl`` (the metrics writer's), ``samples.jsonl`` (a few
completions per step), ``eval_outcomes.jsonl`` (every evaluation's per-problem outcomes),
``skips.jsonl`` (updates the non-finite guard skipped) and the checkpoints
(``experiments/rl/checkpoint.py``, written and read by the distributed strategy). A run refuses to start in a directory that holds one unless
``resume=true``, and a resumption refuses a config that differs in a key that matters
(``experiments.config.config_diff``). Only the main rank writes here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from experiments.common.config import ConfigError
from experiments.common.provenance import git_sha, write_atomic
from experiments.config import config_diff, to_yaml
from experiments.rl import checkpoint as ckpt
from experiments.rl.metrics import truncate_jsonl

CONFIG, META, SAMPLES, SKIPS = "config.yaml", "meta.json", "samples.jsonl", "skips.jsonl"
EVAL_OUTCOMES = "eval_outcomes.jsonl"  # analysis/outcomes.py reads it


class RunDirectory:
    """``path`` of a run with config ``cfg`` (the resolved DictConfig)."""

    def __init__(self, path: Path | str, cfg: DictConfig):
        self.path = Path(path)
        self.cfg = cfg

    def check(self) -> None:
        """Refuse to overwrite a run; on resume, refuse a config that differs in a key that matters."""
        saved = self.path / CONFIG
        if saved.exists():
            if not self.cfg.resume:
                raise FileExistsError(f"{self.path} already holds a run: pass resume=true to continue it, or another out_dir")
            # a key added since the run started is no change at its default; old saved configs' other
            # method sections are ignored (experiments.config.config_diff)
            diff = config_diff(OmegaConf.load(saved), self.cfg)
            if diff:
                raise ConfigError(f"resume: config differs from the saved run in {sorted(diff)}")

    def record(self) -> None:
        """Write the resolved config and meta.json (git sha, versions); a resumption is appended."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path / CONFIG, to_yaml(self.cfg))
        now = {"git_sha": git_sha(), "torch": torch.__version__, "transformers": transformers.__version__,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path = self.path / META
        if self.cfg.resume and path.exists():
            meta = json.loads(path.read_text())
            meta.setdefault("resumed", []).append(now)
        else:
            meta = {**now, "resumed": []}
        write_atomic(path, json.dumps(meta, indent=1))

    # ---- checkpoints ------------------------------------------------------------------------------
    def latest_checkpoint(self, verbose: bool = True) -> Optional[Path]:
        """The newest complete checkpoint (the distributed strategy loads it), or None. Incomplete ones
        (no manifest: a write that did not finish) are reported and ignored."""
        found, incomplete = ckpt.scan_checkpoints(self.path)
        for p in incomplete if verbose else []:
            print(f"[resume] ignoring incomplete checkpoint {p} (no {ckpt.MANIFEST}: a write that did not finish)")
        return found[-1] if found else None

    def truncate_after(self, step: int) -> None:
        """Drop the samples, skips and evaluation outcomes written after ``step`` (they are redone on
        resume, not duplicated; ``step`` = -1 drops them all, the step-0 evaluation included)."""
        for name in (SAMPLES, SKIPS, EVAL_OUTCOMES):
            truncate_jsonl(self.path / name, step)

    # ---- per-step records -------------------------------------------------------------------------
    def append_samples(self, records: list[dict]) -> None:
        """``samples.jsonl``: a few completions of a step (step, question, reference, completion, reward)."""
        with open(self.path / SAMPLES, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def append_eval_outcomes(self, step: int, problem_ids: list[str], correct: list[bool]) -> None:
        """``eval_outcomes.jsonl``: one evaluation's per-problem outcomes, one line
        ``{"step": s, "problem_ids": [uid, ...], "correct": "0110..."}`` — the held-out problems by their
        task uid (``Problem.uid``: their place in the task's unshuffled split, the same for every method
        and seed) in the order evaluated, and character i ``1`` where problem i was answered correctly
        (its count over the line is ``eval/accuracy`` · ``eval/num_problems`` of that step)."""
        if len(problem_ids) != len(correct):
            raise ValueError(f"{len(problem_ids)} problem ids but {len(correct)} outcomes")
        line = {"step": step, "problem_ids": list(problem_ids), "correct": "".join("1" if c else "0" for c in correct)}
        with open(self.path / EVAL_OUTCOMES, "a") as f:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def append_skip(self, record: dict) -> None:
        """``skips.jsonl``: an update the non-finite guard skipped (step, why, how many in a row)."""
        with open(self.path / SKIPS, "a") as f:
            f.write(json.dumps(record) + "\n")

    @property
    def skips_path(self) -> Path:
        return self.path / SKIPS
