"""Where one update's time goes, per method: torch.profiler over fwd_bwd + optimizer on a fixed batch.

    python -m experiments.memory.step_profile [methods=dense,logra:step_control.enabled=false]
        [model=smollm2-135m-instruct] [seqs=8] [micro_batch=8] [completion_len=40] [top=25]
        [out=results/time_table] [run-config key=value ...]

Each method builds its trainer, runs one untimed update (warm-up: lazily allocated state, first-call
setup), then one update under ``torch.profiler`` (CPU activities; CUDA too when on a GPU). Reported
per method: the count of every aten op and its share of the total self CPU time (shares stay
meaningful on busy cores, absolute times do not), the top ``top`` ops, and the ops whose counts
differ between the methods. Writes ``<out>/profile_<method>.txt`` (command and git sha in the
header) and prints the comparison.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

@dataclass
class StepProfileArgs:
    methods: str = "dense,logra:step_control.enabled=false"  # methods, each with optional overrides
    model: str = "smollm2-135m-instruct"  # model.name
    seqs: int = 8  # sequences in the fixed batch
    micro_batch: int = 8  # sequences per forward/backward
    completion_len: int = 40  # completion tokens per sequence
    top: int = 25  # ops listed per method
    out: str = "results/time_table"  # output folder for profile_<method>.txt

KEYS = {k: str(v) for k, v in asdict(StepProfileArgs()).items()}


def profile_update(spec: str, args: dict, overrides: list[str]) -> tuple[Counter, Counter, str]:
    from torch.profiler import ProfilerActivity, profile

    from experiments.config import build_config
    from experiments.memory.step_bench import fixed_rollouts
    from experiments.rl.trainer import GRPOTrainer

    method, _, extra = spec.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config([f"method={method}", f"model={args['model']}", f"out_dir={tmp}/run", "log.progress=false",
                            "eval.every=0", *overrides, *[e for e in extra.split() if e]])
        tr = GRPOTrainer(cfg)
        seqs, mb = int(args["seqs"]), int(args["micro_batch"])
        batch = fixed_rollouts(tr.tokenizer, seqs, int(args["completion_len"]))
        adv, rows = torch.linspace(-1.0, 1.0, seqs), torch.arange(seqs)
        micro = [rows[i: i + mb] for i in range(0, seqs, mb)]

        def update():
            tr.method.zero_grad()
            tr.accumulate_gradients(batch, adv, micro)
            tr.method.step()

        update()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            update()
        tr.close()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    counts = Counter({e.key: e.count for e in events})
    self_us = Counter({e.key: e.self_cpu_time_total for e in events})
    return counts, self_us, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(args["top"]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from experiments.common.cli import fail, parse_tool
    from experiments.common.config import ConfigError
    from experiments.config import run_keys
    from experiments.common.provenance import git_sha

    try:
        args, overrides = parse_tool(StepProfileArgs, argv, __doc__, run_keys)
    except ConfigError as e:
        return fail(e, "experiments.memory.step_profile")

    specs = [m.strip() for m in args["methods"].split(",") if m.strip()]
    header = f"# python -m experiments.memory.step_profile {' '.join(argv)}\n# git sha {git_sha()}, torch {torch.__version__}, threads {torch.get_num_threads()}\n"
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for spec in specs:
        counts, self_us, table = profile_update(spec, args, overrides)
        results[spec] = (counts, self_us)
        total = sum(self_us.values()) or 1
        lines = [header + f"# one update (fwd_bwd + optimizer) of {spec} after a warm-up update; aten ops by self CPU time",
                 f"{'op':<44}{'count':>8}{'self CPU share':>16}"]
        lines += [f"{k:<44}{counts[k]:>8}{100 * v / total:>15.1f}%" for k, v in self_us.most_common(int(args["top"]))]
        lines += ["", "# torch.profiler table (all events, sorted by self CPU time)", table]
        name = spec.replace(":", "_").replace("=", "_").replace(" ", "_")
        (out / f"profile_{name}.txt").write_text("\n".join(lines) + "\n")
        print(f"wrote {out / f'profile_{name}.txt'}")
    if len(specs) >= 2:
        (a, (ca, sa)), (b, (cb, sb)) = list(results.items())[:2]
        ta, tb = sum(sa.values()) or 1, sum(sb.values()) or 1
        print(f"{'op':<40}{'count ' + a[:10]:>18}{'count ' + b[:10]:>18}{'share ' + a[:10]:>18}{'share ' + b[:10]:>18}")
        for k in sorted(set(ca) | set(cb), key=lambda k: -(sa[k] / ta + sb[k] / tb)):
            if ca[k] != cb[k] or abs(sa[k] / ta - sb[k] / tb) > 0.01:
                print(f"{k:<40}{ca[k]:>18}{cb[k]:>18}{100 * sa[k] / ta:>17.1f}%{100 * sb[k] / tb:>17.1f}%")
        print(f"total self CPU (busy cores: only the ratio means something): {a} {ta / 1e6:.2f} s, {b} {tb / 1e6:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
