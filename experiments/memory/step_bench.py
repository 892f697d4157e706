"""Peak memory of one GRPO training step per method, each in a fresh process, side by side.

    python -m experiments.memory.step_bench [methods="dense,logra,logra:logra.embeddings=true"]
        [seqs=8] [micro_batch=4] [completion_len=128] [steps=2] [any run-config key=value ...]   (--help: the keys)

``methods``: method names, each optionally followed by ``:`` and its own overrides
(``experiments.common.cli.parse_methods``); the other run-config ``key=value`` arguments apply to every
method (e.g. ``model.gradient_checkpointing=true train.logprob_chunk=0``).

Every method trains on the same fixed rollout batch (arith prompts, seeded random completion
tokens, fixed advantages) through the trainer's own code path (``accumulate_gradients`` then the
method's ``step``), for ``steps`` updates so optimizer state exists at the peak. Each child reports
its peak resident set size (``ru_maxrss``) and the RSS right after the model loaded; the parent
prints both and the ratio of each method's peak to the first method's. On CUDA it reports the
allocator's peak instead.

glibc raises its mmap threshold dynamically as large blocks are freed, after which freed tensor
memory stays in the heap and counts in RSS; the children run with ``MALLOC_MMAP_THRESHOLD_`` fixed
(``malloc_mmap_threshold=65536`` bytes by default, 0 = glibc's default) so that RSS follows the
live tensors. The same setting applies to every variant. ``out=<file.json>`` also writes the
figures with the command line and the git sha.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError
from experiments.common.provenance import git_sha


@dataclass
class StepBenchArgs:
    methods: str = "dense,logra,logra:logra.embeddings=true"  # methods, each with optional overrides after ':'
    seqs: int = 8  # sequences in the fixed rollout batch
    micro_batch: int = 4  # sequences per forward/backward
    completion_len: int = 128  # completion tokens per sequence
    steps: int = 2  # updates per method (the second has optimizer state)
    malloc_mmap_threshold: int = 65536  # MALLOC_MMAP_THRESHOLD_ of the children, bytes; 0 = glibc's default
    out: str = ""  # also write the figures as JSON to this file


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    """The benchmark's settings (as strings) and the run-config overrides for every method."""
    from experiments.config import run_keys

    args, rest, _ = parse(StepBenchArgs, argv, doc=__doc__, run_keys=run_keys)
    return {k: str(v) for k, v in asdict(args).items()}, rest


def fixed_rollouts(tokenizer, seqs: int, completion_len: int, seed: int = 0, pad: int = 0, group: int = 1):
    """A deterministic rollout batch: real arith prompts, random completion tokens, full masks.

    ``group``: rows per prompt, group-major like a GRPO batch (row r holds prompt r // group; the time
    table's probe shares a group's prompt as the trainer's does). ``pad > 0``: the even groups' prompts
    get ``pad`` more (random, real) tokens on the left and the odd ones are left-padded to their
    length, so every micro-batch of two or more groups carries a padding mask, as real GRPO batches do.
    """
    from experiments.rl.rollout import Rollouts
    from experiments.rl.tasks import TaskConfig, build_task, format_prompt

    if group < 1:
        raise ValueError(f"fixed_rollouts: group must be >= 1, got {group}")
    groups = -(-seqs // group)
    problems = build_task(TaskConfig(name="arith")).train_split()[:groups]
    problems = [p for p in problems for _ in range(group)][:seqs]
    enc = tokenizer([format_prompt(tokenizer, p, TaskConfig().instruction) for p in problems],
                    return_tensors="pt", padding=True, add_special_tokens=False)
    g = torch.Generator().manual_seed(seed)
    ids, mask = enc.input_ids, enc.attention_mask
    if pad > 0:
        of_row = torch.arange(seqs) // group
        even = of_row % 2 == 0
        extra = torch.full((seqs, pad), tokenizer.pad_token_id, dtype=ids.dtype)
        prefix = torch.randint(0, len(tokenizer), ((groups + 1) // 2, pad), generator=g)
        extra[even] = prefix[of_row[even] // 2]  # one prefix per even group
        ids, mask = torch.cat([extra, ids], 1), torch.cat([torch.zeros_like(extra), mask], 1)
        mask[even, :pad] = 1
    completion = torch.randint(0, len(tokenizer), (seqs, completion_len), generator=g)
    ones = torch.ones_like(completion)
    return Rollouts(ids, mask, completion, ones, torch.zeros(seqs, completion_len),
                    [""] * seqs, torch.zeros(seqs, dtype=torch.bool))


def child(variant: str, bench: dict, overrides: list[str]) -> dict:
    from experiments.config import build_config
    from experiments.rl.metrics import peak_rss_bytes
    from experiments.rl.trainer import GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        entry = parse_methods(variant)[0]
        cfg = build_config([f"out_dir={tmp}/run", "log.progress=false", "eval.every=0", *overrides, *entry.run_overrides()])
        trainer = GRPOTrainer(cfg)
        rss_after_load = peak_rss_bytes()
        device = trainer.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seqs, mb = int(bench["seqs"]), int(bench["micro_batch"])
        rollouts = fixed_rollouts(trainer.tokenizer, seqs, int(bench["completion_len"]))
        advantages = torch.linspace(-1.0, 1.0, seqs)
        rows = torch.arange(seqs)
        for _ in range(int(bench["steps"])):
            trainer.method.zero_grad()
            trainer.accumulate_gradients(rollouts, advantages, [rows[i : i + mb] for i in range(0, seqs, mb)])
            trainer.method.step()
        trainer.close()
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    return {"variant": variant, "peak_bytes": peak, "rss_after_load_bytes": rss_after_load, "device": device.type}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "--child":
            bench, rest = _split(argv[2:])
            print("RESULT " + json.dumps(child(argv[1], bench, rest)))
            return 0
        bench, rest = _split(argv)
        from baselines import METHODS

        variants = [m.label for m in parse_methods(bench["methods"], known=METHODS)]
    except ConfigError as e:
        return fail(e, "experiments.memory.step_bench")
    results = []
    for variant in variants:
        cmd = [sys.executable, "-m", "experiments.memory.step_bench", "--child", variant, *argv]
        env = dict(os.environ)
        if int(bench["malloc_mmap_threshold"]) > 0:
            env["MALLOC_MMAP_THRESHOLD_"] = bench["malloc_mmap_threshold"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{variant}: the benchmark process failed (exit {proc.returncode})")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    base = results[0]["peak_bytes"]
    print(f"one GRPO step x{bench['steps']}: {bench['seqs']} sequences, micro-batch {bench['micro_batch']}, "
          f"{bench['completion_len']} completion tokens; MALLOC_MMAP_THRESHOLD_={bench['malloc_mmap_threshold']}; "
          f"overrides: {' '.join(rest) or '-'}")
    print(f"{'variant':<32} {'peak MiB':>10} {'after load MiB':>15} {'peak / ' + results[0]['variant']:>16}")
    for r in results:
        print(f"{r['variant']:<32} {r['peak_bytes'] / 2**20:>10.0f} {r['rss_after_load_bytes'] / 2**20:>15.0f} "
              f"{r['peak_bytes'] / base:>16.3f}")
    if bench["out"]:
        record = {"command": "python -m experiments.memory.step_bench " + " ".join(argv), "git_sha": git_sha(),
                  "bench": bench, "overrides": rest,
                  "results": [{**r, "ratio_to_first": r["peak_bytes"] / base} for r in results]}
        Path(bench["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(bench["out"]).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
