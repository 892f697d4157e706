"""Weight-sync cost: payload bytes of a LoGRA step against a full-weight sync, and their times side by side.

    python -m experiments.memory.sync_bench [methods="logra,logra:logra.embeddings=true"] [repeats=3]
        [seqs=8] [completion_len=128] [rank=256] [any run-config key=value ...]   (--help: the keys)

1. For each variant, on SmolLM2-135M-Instruct with a worker-process engine (``rollout.engine=
   hf_process``, gloo): ``repeats`` times, one real LoGRA step on a fixed rollout batch, then the
   trainer's step sync (``GRPOTrainer.sync``: payload, send, apply in the worker, checksum) and, right
   after it, a full sync of every tensor through the same path. Prints payload bytes / full bytes and
   the median times of both.
2. The same byte ratio computed from model shapes alone (meta tensors, LoGRA's own choice of sketched
   weights) for SmolLM2 at the run's rank, and for a 7B (Llama-2-7B) and a 27B (Gemma-2-27B) config at
   ``rank``: each sketched m × n weight sends its m × r factor, every other trainable tensor its value.
"""

from __future__ import annotations

import statistics
import sys
import tempfile

from dataclasses import dataclass

import torch

from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError


@dataclass
class SyncBenchArgs:
    methods: str = "logra,logra:logra.embeddings=true"  # logra variants, each with optional overrides after ':'
    repeats: int = 3  # step + full syncs per variant (medians are printed)
    seqs: int = 8  # sequences in the fixed rollout batch
    completion_len: int = 128  # completion tokens per sequence
    rank: int = 256  # sketch rank of the from-shapes estimate for the 7B and 27B configs


def big_configs():
    import transformers

    return {
        "llama-2-7b": transformers.LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
        "gemma-2-27b": transformers.Gemma2Config(
            vocab_size=256000, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
            num_attention_heads=32, num_key_value_heads=16, head_dim=128, tie_word_embeddings=True),
    }


def payload_fraction(config, rank: int, embeddings: bool) -> tuple[float, int, int]:
    """(payload / full bytes, payload bytes, full bytes) of one LoGRA step, from shapes only."""
    import transformers

    from logra_core.sketch import install

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    sketched = {id(m.weight): m.weight for m in install(model, rank, embeddings=embeddings).values()}
    full = payload = 0
    for _, p in model.named_parameters():
        size = p.element_size()
        full += p.numel() * size
        payload += (p.shape[0] * rank if id(p) in sketched else p.numel()) * size
    return payload / full, payload, full


def measure(variant: str, bench: SyncBenchArgs, overrides: list[str]) -> dict:
    from experiments.config import build_config
    from experiments.memory.step_bench import fixed_rollouts
    from experiments.rl.trainer import GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        entry = parse_methods(variant)[0]
        cfg = build_config([f"out_dir={tmp}/run", "log.progress=false", "eval.every=0",
                            "rollout.engine=hf_process", *overrides, *entry.run_overrides()])
        trainer = GRPOTrainer(cfg)
        try:
            seqs = bench.seqs
            rollouts = fixed_rollouts(trainer.tokenizer, seqs, bench.completion_len)
            rows = torch.arange(seqs)
            trainer.sync(full=True)
            step, full = [], []
            for _ in range(bench.repeats):
                trainer.method.zero_grad()
                trainer.accumulate_gradients(rollouts, torch.linspace(-1.0, 1.0, seqs),
                                             [rows[i : i + 4] for i in range(0, seqs, 4)])
                trainer.method.step()
                step.append(trainer.sync())
                full.append(trainer.sync(full=True))
            rank = trainer.cfg.logra.rank
            embeddings = trainer.cfg.logra.embeddings
            config = trainer.model.config
        finally:
            trainer.close()
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"variant": variant, "bytes": med(step, "sync/bytes"), "full_bytes": med(full, "sync/bytes"),
            "time": med(step, "time/sync_s"), "full_time": med(full, "time/sync_s"),
            "resyncs": sum(r["sync/resyncs"] for r in step), "estimate": payload_fraction(config, rank, embeddings)[0],
            "rank": rank}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from baselines import METHODS
    from experiments.config import run_keys

    try:
        bench, rest, _ = parse(SyncBenchArgs, argv, doc=__doc__, run_keys=run_keys)
        variants = [m.label for m in parse_methods(bench.methods, known=METHODS)]
    except ConfigError as e:
        return fail(e, "experiments.memory.sync_bench")
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"SmolLM2 step sync over a gloo channel to a worker process, median of {bench.repeats} "
          f"(overrides: {' '.join(rest) or '-'})")
    for variant in variants:
        r = measure(variant, bench, rest)
        print(f"  {variant} (rank {r['rank']}): step payload {mib(r['bytes']):.1f} MiB / full {mib(r['full_bytes']):.1f} MiB"
              f" = {r['bytes'] / r['full_bytes']:.3f} (from shapes: {r['estimate']:.3f}); time {r['time']:.2f} s vs full"
              f" {r['full_time']:.2f} s = {r['time'] / r['full_time']:.2f}; resyncs {r['resyncs']:.0f}")
    rank = bench.rank
    print(f"From shapes at rank {rank} (bytes of one step's payload / a full-weight sync):")
    for name, config in big_configs().items():
        for embeddings in (False, True):
            frac, payload, full = payload_fraction(config, rank, embeddings)
            print(f"  {name:12s} embeddings={'sketched' if embeddings else 'dense   '}: {frac:.3f} "
                  f"({payload / 2**30:.2f} GiB of {full / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
