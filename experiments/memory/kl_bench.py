"""Cost of predicted-KL step control beside one forward pass of the same probe batch.

    python -m experiments.memory.kl_bench [method=logra] [seqs=8] [completion_len=128] [repeats=3]
        [any run-config key=value ...]   (--help: the keys; ``method=`` and its overrides are run-config keys,
        e.g. ``method=logra logra.rank=32``; the method defaults to logra here)

The method accumulates gradients on a fixed rollout batch (as in ``step_bench``) and proposes its
update; then, alternating ``repeats`` times, (a) a no-grad forward of the probe batch through the
LM head (the trainer's log-prob path) and (b) ``predict_kl`` of the update on the same batch.
Times are taken in this process with the default allocator; memory in a child process with
``MALLOC_MMAP_THRESHOLD_`` fixed so that freed tensors leave RSS (an allocator setting that also
slows allocation-heavy code, so no time is taken there): each one's extra resident memory is the
peak RSS while it ran (sampled every millisecond by a thread) minus the RSS just before it.
Prints the median times and their ratio, the peaks, and the size of the model's parameters, the
scale a model-sized tangent buffer would have.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

from dataclasses import asdict, dataclass

import psutil
import torch

from experiments.common.cli import fail, parse
from experiments.common.config import ConfigError


@dataclass
class KLBenchArgs:
    seqs: int = 8  # sequences in the fixed rollout (and probe) batch
    completion_len: int = 128  # completion tokens per sequence
    repeats: int = 3  # alternating forward / predict_kl timings (medians are printed)


class PeakRSS:
    """Peak resident set size above the level at entry, sampled by a background thread."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def measure(bench: dict, rest: list[str], what: str) -> dict:
    """``what`` = "time": median seconds of the two, alternating; "memory": their peak extra RSS."""
    import tempfile

    from experiments.config import build_config
    from experiments.memory.step_bench import fixed_rollouts
    from experiments.rl.trainer import GRPOTrainer, probe_inputs
    from logra_core.kl_predictor import predict_kl

    seqs = int(bench["seqs"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config([f"out_dir={tmp}/run", "log.progress=false", "eval.every=0", *rest])
        trainer = GRPOTrainer(cfg)
        rollouts = fixed_rollouts(trainer.tokenizer, seqs, int(bench["completion_len"]))
        rows = torch.arange(seqs)
        trainer.method.zero_grad()
        trainer.accumulate_gradients(rollouts, torch.linspace(-1.0, 1.0, seqs), [rows[i : i + 4] for i in range(0, seqs, 4)])
        update, _ = trainer.method.propose()
        trainer.method.zero_grad()
        inputs = probe_inputs(rollouts, trainer.device)

        def forward():
            with torch.no_grad():
                trainer._logprobs(trainer.model, rollouts)

        def predict():
            return predict_kl(trainer.model, **inputs, lowrank=update.lowrank, dense=update.dense,
                              chunk=cfg.step_control.chunk)

        out = {"forward": [], "predict": [], "update_numel": update.numel(),
               "param_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters())}
        for _ in range(int(bench["repeats"])):
            for name, fn in (("forward", forward), ("predict", predict)):
                with PeakRSS() if what == "memory" else nullcontext() as m:
                    t0 = time.perf_counter()
                    value = fn()
                    seconds = time.perf_counter() - t0
                out[name].append(m.extra if what == "memory" else seconds)
                if name == "predict":
                    out["kl"] = value
        trainer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    child = bool(argv) and argv[0] == "--memory"
    if child:
        argv = argv[1:]
    from experiments.config import run_keys

    try:
        args, rest, _ = parse(KLBenchArgs, argv, doc=__doc__, run_keys=run_keys)
    except ConfigError as e:
        return fail(e, "experiments.memory.kl_bench")
    bench = {k: str(v) for k, v in asdict(args).items()}
    rest = ["method=logra", *rest]  # the method measured unless method= says otherwise
    bench["method"] = next(r.split("=", 1)[1] for r in reversed(rest) if r.startswith("method="))
    if child:
        print("RESULT " + json.dumps(measure(bench, rest, "memory")))
        return 0
    times = measure(bench, rest, "time")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-m", "experiments.memory.kl_bench", "--memory", *argv], env=env,
                          capture_output=True, text=True)
    found = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"the memory measurement failed:\n{proc.stderr[-3000:]}")
    memory = json.loads(found[-1][len("RESULT "):])
    med = {k: statistics.median(times[k]) for k in ("forward", "predict")}
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"method {bench['method']}: {bench['seqs']} sequences x {bench['completion_len']} completion tokens; "
          f"update holds {times['update_numel']:,} numbers; predicted KL {times['kl']:.3e}; overrides: {' '.join(rest) or '-'}")
    print(f"forward of the probe batch : median {med['forward']:.2f} s, extra RSS {mib(max(memory['forward'])):.0f} MiB")
    print(f"predict_kl                 : median {med['predict']:.2f} s, extra RSS {mib(max(memory['predict'])):.0f} MiB")
    print(f"predictor / forward time   : {med['predict'] / med['forward']:.2f}")
    print(f"model parameters           : {mib(times['param_bytes']):.0f} MiB (a model-sized tangent buffer would be this large)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
