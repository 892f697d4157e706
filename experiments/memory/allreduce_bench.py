"""Data-parallel gradient traffic: bytes LoGRA all-reduces per step against dense AdamW's (docs/design.md §6).

    python -m experiments.memory.allreduce_bench [rank=64] [methods="logra,logra:logra.embeddings=true"]
        [tokens=64] [repeats=3] [model=smollm2-135m-instruct] [big_rank=256 (0: skip the big configs)]   (--help: the keys)

1. Two gloo processes on this machine each load the model, run one real forward/backward on their
   own random tokens, and call ``Method.reduce_gradients`` — the very reduction the trainer runs once
   per step under ``torchrun`` — for dense AdamW (every ``.grad``) and for each LoGRA variant (the m × r
   sketches plus the gradients of the tensors that are not sketched). Prints the bytes each rank
   all-reduced, their ratio to dense, and the median time of the collective over ``repeats`` calls
   (loopback gloo on a shared machine: the time says little about a real interconnect; the bytes are
   exact).
2. The same ratio from shapes alone (meta tensors) for SmolLM2 and, at ``big_rank``, for a 7B
   (Llama-2-7B) and a 27B (Gemma-2-27B) config — the all-reduce of a step moves what a LoGRA weight
   sync sends: m × r per sketched weight, every other trainable tensor whole.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.common.cli import fail, parse, parse_methods
from experiments.common.config import ConfigError
from experiments.common.provenance import git_sha


@dataclass
class AllreduceBenchArgs:
    rank: int = 64  # sketch rank of every method entry (<method>.rank)
    methods: str = "logra,logra:logra.embeddings=true"  # compared with dense; each with optional overrides after ':'
    tokens: int = 64  # random tokens per rank in the forward/backward
    repeats: int = 3  # all-reduce calls timed per method (median printed)
    model: str = "smollm2-135m-instruct"  # model.name
    big_rank: int = 256  # rank of the from-shapes estimate for the 7B and 27B configs; 0 = skip them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, variants: list[list[str]], bench: dict, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from baselines import METHODS
    from experiments.config import build_config
    from experiments.rl.models import load_model

    results = []
    for overrides in variants:
        cfg = build_config([f"model={bench['model']}", "out_dir=unused", *overrides])
        model, _ = load_model(cfg.model)
        method = METHODS[cfg.method](getattr(cfg, cfg.method))
        model = method.setup(model)
        gen = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(0, model.config.vocab_size, (1, int(bench["tokens"])), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        times, nbytes = [], None
        for _ in range(int(bench["repeats"])):
            dist.barrier()
            t0 = time.perf_counter()
            nbytes = method.reduce_gradients(None)
            times.append(time.perf_counter() - t0)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        results.append({"variant": " ".join(overrides), "bytes": nbytes, "seconds": statistics.median(times),
                        "param_bytes": params, "config": model.config})
        del model, method
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def shape_fraction(config, rank: int, embeddings: bool) -> float:
    from experiments.memory.sync_bench import payload_fraction

    return payload_fraction(config, rank, embeddings)[0]


def main(argv: list[str]) -> int:
    from baselines import METHODS

    try:
        args, _, _ = parse(AllreduceBenchArgs, argv, doc=__doc__)
        specs = parse_methods(args.methods, known=METHODS)
    except ConfigError as e:
        return fail(e, "experiments.memory.allreduce_bench")
    bench = {k: str(v) for k, v in asdict(args).items()}
    rank = args.rank
    variants = [["method=dense"]] + [[f"method={m.method}", f"{m.method}.rank={rank}", *m.overrides] for m in specs]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.start_processes(_worker, args=(2, _free_port(), variants, bench, out), nprocs=2, join=False,
                               start_method="spawn")
    results = out.get()
    procs.join()

    print(f"command: python -m experiments.memory.allreduce_bench {' '.join(argv)}".rstrip())
    print(f"git sha: {git_sha()}   torch {torch.__version__}   2 gloo processes, 1 thread each, model {bench['model']}")
    dense = results[0]["bytes"]
    print(f"\n{'variant':<50} {'all-reduced bytes/step':>24} {'/ dense':>8} {'time (median)':>14}")
    for r in results:
        print(f"{r['variant']:<50} {r['bytes']:>24,} {r['bytes'] / dense:>8.3f} {r['seconds']:>12.3f} s")
    print(f"(model parameters: {results[0]['param_bytes']:,} bytes; times: loopback gloo on a shared 2-core machine)")

    from experiments.memory.sync_bench import big_configs

    print("\nfrom shapes (m x r per sketched weight + the other trainable tensors) / every tensor:")
    configs = {f"{bench['model']} r={rank}": (results[0]["config"], rank)}
    big = int(bench["big_rank"])
    configs.update({f"{name} r={big}": (c, big) for name, c in big_configs().items()} if big > 0 else {})
    for name, (c, r) in configs.items():
        print(f"  {name:<28} default {shape_fraction(c, r, False):.3f}   logra.embeddings=true {shape_fraction(c, r, True):.3f}")
    for r in results[1:]:  # the collective moved exactly what the shapes say
        expected = shape_fraction(results[0]["config"], rank, "embeddings=true" in r["variant"])
        if abs(r["bytes"] / dense - expected) > 1e-9:
            print(f"MISMATCH: {r['variant']} all-reduced {r['bytes'] / dense:.6f} of dense, shapes say {expected:.6f}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
