"""How the KL prediction's error and cost depend on the probe: probe size → |predicted − exact| / exact
on the whole batch, and → time.

    python -m experiments.memory.kl_probe_study [model=smollm2-135m-instruct] [seqs=32] [group=4]
        [max_new_tokens=64] [probe_seqs=1,2,4,8,16,32] [draws=4] [chunks=64,256] [dtypes=float32,bfloat16]
        [target_kl=0.01] [out=results/time_table/probe_study] [run-config key=value ...]

One logra update on a real rollout batch (``seqs`` completions of ``seqs/group`` arith prompts sampled
from the model, advantages from seeded signs): the update is proposed, its step s chosen so the
whole-batch prediction lands on κ (``target_kl``; s ≤ 1), and the exact mean token KL of the applied
step s·Δ over every response token of the batch is measured (``exact_kl``, one forward before and
after; the weights are restored afterwards). Then for each probe size n, ``draws`` random probes of n
rows (seeded, without replacement) are predicted with :func:`logra_core.kl_predictor.predict_kl_sampled`
(the exact path's prediction on the probe, and its stated standard error as an estimate of the whole
batch); the whole batch (n = seqs) is also predicted with every ``chunks`` size and ``dtypes`` (the
model copied to bf16). Each row: the prediction s²·KL̂, the stated se, the exact KL, the relative
error to the exact KL (second-order error + sampling) and to the whole-batch prediction (sampling
alone), whether the error is within 2 se, the predictor's seconds and that time in forwards of the
whole batch (one no-grad forward of all ``seqs`` rows, timed here) and as a fraction of the batch's
forward+backward (timed here too). Times are only meaningful on quiet cores.

Writes ``<out>/probe_study.csv``, ``probe_study.json`` (command, git sha, settings) and
``probe_study.png``/``.pdf``; prints a summary per probe size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

@dataclass
class ProbeStudyArgs:
    model: str = "smollm2-135m-instruct"  # model.name
    seqs: int = 32  # sequences in the batch whose exact KL is the reference
    group: int = 4  # completions per prompt
    max_new_tokens: int = 64  # completion length
    probe_seqs: str = "1,2,4,8,16,32"  # probe sizes (sequences) to study
    draws: int = 4  # random probes per size
    chunks: str = "64,256"  # vocabulary chunk sizes of the predictor
    dtypes: str = "float32,bfloat16"  # tangent dtypes
    target_kl: float = 0.01  # κ the update is scaled to before the comparison
    predictors: str = "exact,secant"  # KL predictors to study (logra_core.kl_predictor.PREDICTORS)
    trials: str = "0.5,1,2"  # the secant's trial scale ε as multiples of the applied scale s (clamped to 1)
    out: str = "results/time_table/probe_study"  # output folder
    seed: int = 0  # seeds the batch and the probes

KEYS = {k: str(v) for k, v in asdict(ProbeStudyArgs()).items()}
COLUMNS = ["predictor", "trial", "probe_seqs", "probe_tokens", "chunk", "dtype", "draw", "predicted", "stderr", "exact", "rel_err_exact",
           "predicted_full", "rel_err_sampling", "within_2se", "time_s", "forwards", "of_fwd_bwd", "scale"]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(args: dict, overrides: list[str]) -> tuple[list[dict], dict]:
    from experiments.config import build_config
    from experiments.rl.trainer import GRPOTrainer, probe_inputs, probe_rows
    from logra_core.kl_predictor import exact_kl, hidden_states, predict_kl_sampled

    seqs, group = int(args["seqs"]), int(args["group"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(["method=logra", f"model={args['model']}", f"out_dir={tmp}/run", "log.progress=false",
                            "eval.every=0", f"rollout.max_new_tokens={args['max_new_tokens']}", f"seed={args['seed']}",
                            *overrides])
        tr = GRPOTrainer(cfg)
        model = tr.model
        torch.manual_seed(int(args["seed"]))
        rollouts = tr.engine.generate(tr._prompts(tr.train_problems[: seqs // group]), group)
        n_seqs = len(rollouts)
        g = torch.Generator().manual_seed(int(args["seed"]))
        advantages = torch.where(torch.rand(n_seqs, generator=g) < 0.5, -1.0, 1.0)
        rows = torch.arange(n_seqs)
        micro = [rows[i: i + tr.cfg.train.micro_batch_size] for i in range(0, n_seqs, tr.cfg.train.micro_batch_size)]
        tr.method.zero_grad()
        _, fwd_bwd_s = _timed(lambda: tr.accumulate_gradients(rollouts, advantages, micro))
        update, _ = tr.method.propose()
        full = probe_inputs(rollouts, tr.device)
        (h_old, forward_s) = _timed(lambda: hidden_states(model, **full))
        pred_full, _ = predict_kl_sampled(model, **full, lowrank=update.lowrank, dense=update.dense, chunk=64)
        kappa = float(args["target_kl"])
        scale = min(1.0, (kappa / pred_full) ** 0.5) if pred_full > 0 else 1.0
        head = model.get_output_embeddings().weight
        w_old = head.detach().clone()
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        tr.method.apply(update, scale)
        exact = float(exact_kl(h_old, w_old, hidden_states(model, **full), head.detach(), 64).mean())
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        del saved
        out = []
        full_by_variant = {}  # (predictor, trial, chunk, dtype) -> its prediction on the whole batch (recorded first)

        def record(n, idx, chunk, dtype, draw, m=model, predictor="exact", trial=0.0):
            inputs = probe_inputs(rollouts.select(idx), tr.device)
            at = min(1.0, trial * scale)
            extra = {} if predictor == "exact" else {"predictor": predictor, "at": at}
            (pred, se), secs = _timed(lambda: predict_kl_sampled(m, **inputs, lowrank=update.lowrank, dense=update.dense,
                                                                 chunk=chunk, population=n_seqs, **extra))
            s2 = scale ** 2
            reference = full_by_variant.setdefault((predictor, trial, chunk, dtype), pred)  # the variant's whole batch
            out.append({"predictor": predictor, "trial": trial if predictor != "exact" else "", "probe_seqs": n, "probe_tokens": int(inputs["positions"].sum()), "chunk": chunk, "dtype": dtype,
                        "draw": draw, "predicted": pred * s2, "stderr": se * s2, "exact": exact,
                        "rel_err_exact": abs(pred * s2 - exact) / exact, "predicted_full": reference * s2,
                        "rel_err_sampling": abs(pred - reference) / reference,
                        "within_2se": bool(abs(pred - reference) <= 2 * se) if se == se and se > 0 else "",
                        "time_s": secs, "forwards": secs / forward_s, "of_fwd_bwd": secs / fwd_bwd_s, "scale": scale})
            print(f"[probe_study] {predictor}{f'@{trial:g}s' if predictor != 'exact' else ''} n={n} draw={draw} chunk={chunk} {dtype}: rel err {out[-1]['rel_err_exact']:.3f} "
                  f"(sampling {out[-1]['rel_err_sampling']:.3f}, se/mean {se / pred if pred else 0:.3f}) {secs:.2f} s", flush=True)

        sizes = [int(x) for x in args["probe_seqs"].split(",") if x]
        variants = [(p, t) for p in args["predictors"].split(",") if p
                    for t in ([0.0] if p == "exact" else [float(x) for x in args["trials"].split(",") if x])]
        for predictor, trial in variants:  # the whole batch: second-order / extrapolation error alone
            record(n_seqs, rows, 64, "float32", 0, predictor=predictor, trial=trial)
        for n in sizes:
            if n >= n_seqs:
                continue
            for d in range(int(args["draws"])):  # the trainer's probe: spread over the prompt groups
                idx = probe_rows(rows, group, n, int(args["seed"]) + 1000 * n, d).sort().values
                for predictor, trial in variants:
                    record(n, idx, 64, "float32", d, predictor=predictor, trial=trial)
        for chunk in [int(x) for x in args["chunks"].split(",") if x and int(x) != 64]:
            record(n_seqs, rows, chunk, "float32", 0)
        for dtype in [x for x in args["dtypes"].split(",") if x and x != "float32"]:
            low = copy.deepcopy(model).to(getattr(torch, dtype))
            record(n_seqs, rows, 64, dtype, 0, m=low)
            del low
        tr.close()
    meta = {"n_seqs": n_seqs, "response_tokens": int(full["positions"].sum()), "forward_s": forward_s,
            "fwd_bwd_s": fwd_bwd_s, "predicted_full_unit_step": pred_full, "scale": scale, "exact": exact}
    return out, meta


def _variant(r: dict) -> str:
    return r["predictor"] if r["predictor"] == "exact" else f"{r['predictor']} at {float(r['trial']):g}s"


def _main_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """fp32, chunk-64 rows by predictor variant."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["dtype"] == "float32" and r["chunk"] == 64:
            by.setdefault(_variant(r), []).append(r)
    return by


def figure(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.render import save_png_pdf

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rs in _main_rows(rows).items():
        sizes = sorted({r["probe_seqs"] for r in rs})
        a1.plot(sizes, [statistics.median(r["rel_err_exact"] for r in rs if r["probe_seqs"] == n) for n in sizes],
                "o-", label=f"{name}: median")
        a1.plot(sizes, [max(r["rel_err_exact"] for r in rs if r["probe_seqs"] == n) for n in sizes], "x:",
                label=f"{name}: max", color=a1.lines[-1].get_color())
        a2.plot(sizes, [statistics.median(r["of_fwd_bwd"] for r in rs if r["probe_seqs"] == n) for n in sizes], "o-",
                label=name)
    a1.axhline(0.25, color="grey", lw=0.8, ls="--")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("probe sequences")
        ax.legend(fontsize=6)
    a1.set_yscale("log")
    a1.set_ylabel("|predicted − exact| / exact (whole batch)")
    a2.set_ylabel("predictor time / batch fwd+bwd time")
    save_png_pdf(fig, out / "probe_study.png", dpi=None)  # and its .pdf; closes the figure


def summary(rows: list[dict]) -> list[str]:
    """One line per (predictor variant, probe size): median / max error against the exact KL, the
    sampling error's median, how often it fell within 2 stated se, time in forwards and of fwd_bwd."""
    lines = [f"{'predictor':<18}{'seqs':>5}{'tokens':>7}{'med err':>9}{'max err':>9}{'med samp':>9}{'in 2se':>7}"
             f"{'fwds':>7}{'/fwd_bwd':>9}"]
    for name, rs in _main_rows(rows).items():
        for n in sorted({r["probe_seqs"] for r in rs}):
            sel = [r for r in rs if r["probe_seqs"] == n]
            inside = [r["within_2se"] for r in sel if r["within_2se"] != ""]
            lines.append(f"{name:<18}{n:>5}{sel[0]['probe_tokens']:>7}{statistics.median(r['rel_err_exact'] for r in sel):>9.3f}"
                         f"{max(r['rel_err_exact'] for r in sel):>9.3f}{statistics.median(r['rel_err_sampling'] for r in sel):>9.3f}"
                         f"{(f'{sum(inside)}/{len(inside)}' if inside else '-'):>7}"
                         f"{statistics.median(r['forwards'] for r in sel):>7.2f}{statistics.median(r['of_fwd_bwd'] for r in sel):>9.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from experiments.common.cli import fail, parse_tool
    from experiments.common.config import ConfigError
    from experiments.config import run_keys
    from experiments.common.provenance import git_sha, write_results

    try:
        args, overrides = parse_tool(ProbeStudyArgs, argv, __doc__, run_keys)
    except ConfigError as e:
        return fail(e, "experiments.memory.kl_probe_study")

    sha = git_sha()  # the code this run imports: read before it runs (edits during a long run would show as -dirty)
    rows, meta = run(args, overrides)
    out = Path(args["out"])
    write_results(out, "probe_study", rows, {
        "command": "python -m experiments.memory.kl_probe_study " + " ".join(argv), "git_sha": sha,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "settings": args, "overrides": overrides,
        **meta}, COLUMNS)
    figure(rows, out)
    text = "\n".join(summary(rows))
    (out / "probe_study.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
