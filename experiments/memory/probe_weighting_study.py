"""Which size variable lets a small KL probe read the whole batch's KL: tokens, |advantage| × tokens, or
the tokens' spread at θ (Gini impurity 1 − Σp², entropy) summed over the row.

    python -m experiments.memory.probe_weighting_study [policy=<run dir or checkpoint dir>] [batches=6]
        [probe_seqs=4,8,12,16] [draws=300] [target_kl=0.01] [seed=0] [out=results/time_table/probe_weighting]
        [run-config key=value ...]     (default run config: config=arith_compare method=logra)

For each of ``batches`` real GRPO batches (the trainer's own rollouts, rewards and group advantages;
the trained rows are those with a nonzero advantage), one logra update is proposed, scaled so the
whole batch's exact KL is κ (``target_kl``; s ≤ 1), and the exact per-token KL of that step is measured
on every trained response token (``logra_core.kl_secant.trial_kl_terms`` at ε = s: a forward at
θ + sΔ through hooks, no weight changed). Then ``draws`` probes of k rows
per size, drawn as the trainer draws them (``experiments.rl.trainer.probe_rows``: across prompt
groups, seeded), read the batch's mean token KL with each size variable of the ratio estimator
(``logra_core.kl_predictor.sampled_mean``: tokens, the default; advantage, rows weighted by |A|;
gini / entropy, rows weighted by their tokens' mean Gini impurity / entropy of p(θ): :func:`token_spread`).
The per-token KL is the same for all, so the comparison is of the sampling error alone.

``policy``: a run directory (its newest checkpoint) or a checkpoint directory whose
``model.safetensors`` replaces the starting weights — a trained policy has more groups with mixed
rewards (SmolLM2 at step 0 trains on few rows). The policy moves on by one controlled training step
between batches (``advance=false``: every batch is drawn from the same policy, about half the time).

Writes ``<out>/probe_weighting.csv`` (one row per batch × size × draw × estimator), ``.json``
(command, git sha, settings, per-batch facts) and ``.txt`` (median / 80th-percentile relative error,
share within ±25 %, share within 2 stated se, per estimator and size, pooled over batches).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch


@dataclass
class ProbeWeightingArgs:
    policy: str = ""  # a run dir (its newest checkpoint) or checkpoint dir whose model.safetensors is loaded; empty: the model as configured
    batches: int = 6  # batches studied (a batch with fewer trained rows than twice the smallest probe is skipped, not counted)
    probe_seqs: str = "4,8,12,16"  # probe sizes (rows)
    draws: int = 300  # random probes per size and batch
    target_kl: float = 0.01  # κ the step is scaled to before the KL is measured
    seed: int = 0  # run seed (rollouts, data order) and the probes' seeds
    out: str = "results/time_table/probe_weighting"  # output folder
    max_tries: int = 30  # stop after this many batches drawn, studied or not
    advance: bool = True  # one controlled training step between batches; false: every batch from the same policy


COLUMNS = ["batch", "step", "trained_rows", "trained_tokens", "scale", "exact", "probe_seqs", "draw", "estimator",
           "estimate", "stderr", "rel_err", "within_25", "within_2se"]
ESTIMATORS = ("tokens", "advantage", "gini", "entropy")


def token_spread(h: torch.Tensor, W: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token Gini impurity 1 − Σ_v p_v² and entropy of p = softmax(h Wᵀ) [T], ``chunk`` tokens at a time.

    Why a size for the KL probe: a step moves the logits by δz and KL(p ‖ p') ≈ ½ Var_p(δz); for δz with
    independent entries of variance σ², E Var_p(δz) = σ² (1 − Σ p²). A token the policy is sure of
    (p ≈ one-hot) contributes ≈ 0 whatever the step; both are known for every row from the update's own
    forward."""
    gini, ent = torch.empty(h.shape[0], dtype=torch.float64), torch.empty(h.shape[0], dtype=torch.float64)
    for i in range(0, h.shape[0], chunk):
        logp = torch.log_softmax((h[i : i + chunk].to(W.dtype) @ W.t()).double(), dim=-1)
        p = logp.exp()
        gini[i : i + chunk] = 1 - p.square().sum(-1)
        ent[i : i + chunk] = -(p * logp).sum(-1)
    return gini, ent


def _checkpoint(policy: str) -> Path:
    p = Path(policy)
    if (p / "model.safetensors").is_file():
        return p
    found = sorted((p / "checkpoints").glob("step_*")) if (p / "checkpoints").is_dir() else []
    if not found or not (found[-1] / "model.safetensors").is_file():
        raise FileNotFoundError(f"policy={policy}: neither a checkpoint dir with model.safetensors nor a run dir with checkpoints/step_*")
    return found[-1]


def run(args: dict, overrides: list[str]) -> tuple[list[dict], dict]:
    from safetensors.torch import load_file

    from experiments.config import build_config
    from experiments.rl.grpo import group_advantages
    from experiments.rl.trainer import GRPOTrainer, probe_inputs, probe_rows
    from logra_core.kl_predictor import hidden_states, sampled_mean
    from logra_core.kl_secant import trial_kl_terms

    sizes = sorted(int(x) for x in str(args["probe_seqs"]).split(",") if x)
    seed, kappa = int(args["seed"]), float(args["target_kl"])
    out, batches = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(["config=arith_compare", "method=logra", f"out_dir={tmp}/run", "eval.every=0",
                            "log.progress=false", "checkpoint.every=0", f"seed={seed}", *overrides])
        tr = GRPOTrainer(cfg)
        if args["policy"]:
            ckpt = _checkpoint(args["policy"])
            state = load_file(str(ckpt / "model.safetensors"))
            missing, unexpected = tr.model.load_state_dict(state, strict=False)
            params = dict(tr.model.named_parameters(remove_duplicate=False))
            loaded = {id(params[k]) for k in state if k in params}
            untied = [k for k in missing if k not in params or id(params[k]) not in loaded]  # a tied weight is saved once
            if unexpected or untied:
                raise ValueError(f"policy {ckpt}: missing {untied}, unexpected {unexpected}")
            tr.sync()  # the rollout engine's copy follows
        tc, model = cfg.train, tr.model
        tries = 0
        while len(batches) < int(args["batches"]) and tries < int(args["max_tries"]):
            tries += 1
            problems = tr._next_problems(tc.prompts_per_step)
            rollouts = tr.dist.generate(tr.engine, tr._prompts(problems), tc.group_size, tr.step)  # sampled, as train_step
            refs = [p.reference for p in problems for _ in range(tc.group_size)]
            rewards = torch.tensor(tr.reward_fn(rollouts.texts, refs), dtype=torch.float32)
            adv = group_advantages(rewards, tc.group_size, tc.std_normalize)
            rows = (adv != 0).nonzero().squeeze(-1)
            if len(rows) < 2 * sizes[0]:
                print(f"[probe_weighting] try {tries}: {len(rows)} trained rows, skipped", flush=True)
            else:
                sel = rollouts.select(rows)
                micro = list(rows.split(tc.micro_batch_size))
                tr.method.zero_grad()
                tr.accumulate_gradients(rollouts, adv, micro)
                update, _ = tr.method.propose()
                parts = [probe_inputs(sel.select(i), tr.device) for i in torch.arange(len(rows)).split(tc.micro_batch_size)]
                h_old = [hidden_states(model, **p) for p in parts]

                def kl_at(s: float) -> torch.Tensor:  # the exact KL of the step s·Δ; no weight is changed
                    return torch.cat([trial_kl_terms(model, **p, lowrank=update.lowrank, dense=update.dense, chunk=64,
                                                     at=s, h_old=h) * s**2 for h, p in zip(h_old, parts)])

                unit = kl_at(1.0)
                scale = min(1.0, math.sqrt(kappa / float(unit.mean()))) if float(unit.mean()) > 0 else 1.0
                terms = kl_at(scale) if scale < 1 else unit
                lengths = sel.completion_mask.sum(1)
                row_of = torch.arange(len(rows)).repeat_interleave(lengths)
                exact = float(terms.double().mean())
                a = adv[rows].abs().double()
                a_mean = float((a * lengths).sum() / lengths.sum())
                spread = dict(zip(("gini", "entropy"), token_spread(torch.cat(h_old), model.get_output_embeddings().weight.detach())))
                per_row = {k: torch.zeros(len(rows), dtype=torch.float64).index_add_(0, row_of, v) / lengths.double()
                           for k, v in spread.items()}  # the row's token mean
                sizes_of = {"advantage": (a, a_mean), **{k: (per_row[k], float(v.mean())) for k, v in spread.items()}}
                b = len(batches)
                batches.append({"batch": b, "step": tr.step, "trained_rows": len(rows),
                                "trained_tokens": int(lengths.sum()), "scale": scale, "exact": exact})
                print(f"[probe_weighting] batch {b} (step {tr.step}): {len(rows)} trained rows, "
                      f"{int(lengths.sum())} tokens, s {scale:.3f}, exact KL {exact:.5f}", flush=True)
                for k in sizes:
                    if k >= len(rows):
                        continue
                    for d in range(int(args["draws"])):
                        probe = probe_rows(rows, tc.group_size, k, seed + 7919 * b, d)
                        local = torch.searchsorted(rows, probe.sort().values)
                        keep = torch.isin(row_of, local)
                        r = torch.searchsorted(local, row_of[keep])
                        for est in ESTIMATORS:
                            w, w_mean = sizes_of.get(est, (None, 1.0))
                            extra = (w[local], w_mean) if w is not None else (None, 1.0)
                            m, se = sampled_mean(terms[keep], r, len(rows), *extra)
                            err = abs(m - exact) / exact
                            out.append({**batches[-1], "probe_seqs": k, "draw": d, "estimator": est, "estimate": m,
                                        "stderr": se, "rel_err": err, "within_25": err <= 0.25,
                                        "within_2se": abs(m - exact) <= 2 * se})
            tr.method.zero_grad()
            if str(args["advance"]).lower() in ("true", "1"):
                tr.train_step()  # the policy moves on (a controlled step, as the run config says)
            tr.step += 1  # a new draw of problems and probes either way
        tr.close()
    return out, {"batches": batches, "tries": tries}


def summary(rows: list[dict]) -> list[str]:
    lines = [f"{'estimator':<10}{'seqs':>5}{'draws':>7}{'med err':>9}{'p80 err':>9}{'±25 %':>7}{'in 2se':>8}"]
    for k in sorted({r["probe_seqs"] for r in rows}):
        for est in ESTIMATORS:
            sel = [r for r in rows if r["probe_seqs"] == k and r["estimator"] == est]
            errs = sorted(r["rel_err"] for r in sel)
            lines.append(f"{est:<10}{k:>5}{len(sel):>7}{statistics.median(errs):>9.3f}{errs[int(0.8 * (len(errs) - 1))]:>9.3f}"
                         f"{sum(r['within_25'] for r in sel) / len(sel):>7.2f}{sum(r['within_2se'] for r in sel) / len(sel):>8.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from experiments.common.cli import fail, parse_tool
    from experiments.common.config import ConfigError
    from experiments.common.provenance import git_sha, write_results
    from experiments.config import run_keys

    try:
        args, overrides = parse_tool(ProbeWeightingArgs, argv, __doc__, run_keys)
    except ConfigError as e:
        return fail(e, "experiments.memory.probe_weighting_study")
    sha = git_sha()
    rows, meta = run(args, overrides)
    if not rows:
        print(f"[probe_weighting] no batch had enough trained rows in {meta['tries']} tries", file=sys.stderr)
        return 1
    out = Path(args["out"])
    write_results(out, "probe_weighting", rows, {
        "command": "python -m experiments.memory.probe_weighting_study " + " ".join(argv), "git_sha": sha,
        "torch": torch.__version__, "settings": args, "overrides": overrides, **meta}, COLUMNS)
    text = "\n".join(summary(rows))
    (out / "probe_weighting.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
