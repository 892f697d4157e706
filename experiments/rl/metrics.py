"""Metric keys and the per-run metrics writer.

Every line of ``metrics.jsonl`` is one step: ``{"step": s, "<namespace>/<name>": value, ...}``.
Namespaces: reward/, eval/, loss/, clip/, kl/, step/, rollout/, sync/, time/, mem/, dist/. The harness'
keys are documented here (:data:`METRICS`); a method documents the keys only it logs in its own file
(``Method.metrics``), and :func:`documented_metrics` joins both. A key documented in neither place is
refused, so the analysis code can rely on the table.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

METRICS: dict[str, str] = {
    "step": "policy updates completed (0 = before training)",
    "reward/mean": "mean reward of the step's sampled completions",
    "reward/std": "std of the step's rewards",
    "reward/accuracy": "fraction of sampled completions judged correct (reward > 0.5)",
    "reward/zero_std_groups": "fraction of prompt groups whose completions all got the same reward",
    "reward/timeouts": "completions of the step whose verification hit the hard timeout (task.reward_timeout_s) or crashed its worker; scored 0",
    "eval/accuracy": "greedy pass@1 on the held-out problems",
    "eval/num_problems": "held-out problems in the evaluation",
    "eval/len_mean": "mean completion length in tokens at evaluation",
    "loss/policy": "clipped surrogate loss, token mean over the trained tokens (summed over ppo epochs' last pass)",
    "clip/fraction": "fraction of trained tokens whose ratio was clipped",
    "kl/ref": "k3 estimate of KL(policy || reference) per token (when train.kl_coef > 0)",
    "kl/sampler_trainer": "mean log pi_sampler - log pi_trainer over sampled tokens (engine/trainer mismatch)",
    "step/grad_norm": "global L2 gradient norm before clipping (the method's max_grad_norm clips it): dense, galore, lora: over every trainable tensor's .grad (galore: the full gradients, before projection); logra: the estimated global norm sqrt(sum ||S||^2 over sketches + sum ||g||^2 over unsketched tensors), ||G A^T||^2 being an unbiased estimate of ||G||^2 (logra_core/clip.py)",
    "kl/predicted": "predicted KL(pi_old || pi_new) per probe token of the proposed update, second order (step control)",
    "kl/predicted_scaled": "the prediction for the applied update: kl/predicted * step/scale^2",
    "kl/predicted_stderr": "standard error of kl/predicted read as the whole batch's mean token KL: 0 when every trained sequence is probed, NaN for a one-sequence probe (logra_core.kl_predictor.sampled_mean)",
    "kl/probe_tokens": "response tokens in the KL probe (step_control.probe_seqs rows drawn across prompt groups, summed over ranks)",
    "kl/trial_scale": "the secant predictor's last trial scale ε: kl/predicted is K(ε)/ε², the KL measured on the probe at θ + εΔ (logra_core/kl_secant.py)",
    "kl/trials": "trial forwards of the secant predictor this step (a second one when the chosen scale was > 2x off the first trial)",
    "kl/realized": "exact KL(pi_old || pi_new) per response token of the whole trained batch for the applied update (step_control.measure_realized: two more forwards of the batch)",
    "step/scale": "scale s applied to the proposed update: min(1, sqrt(target_kl / kl/predicted))",
    "step/skipped": "updates of the step skipped by the non-finite guard (a NaN/Inf in a loss, gradient, sketch or proposed update; experiments/rl/guard.py): 0 or 1 per ppo epoch; the offending tensor is named in <run_dir>/skips.jsonl",
    "step/lr": "learning rate of the update",
    "rollout/len_mean": "mean completion length in tokens",
    "rollout/seq_len": "tokens per trained sequence as padded (the longest prompt + the longest completion, over ranks)",
    "rollout/truncated_frac": "fraction of completions cut by max_new_tokens",
    "rollout/trained_seqs": "sequences that entered the loss (zero-advantage ones are skipped)",
    "rollout/trained_tokens": "completion tokens that entered the loss",
    "time/step_s": "wall time of the step (rollout + reward + train), seconds",
    "time/rollout_s": "generation time, seconds",
    "time/reward_s": "reward verification time, seconds",
    "time/train_s": "log-probs + backward + optimizer time, seconds",
    "time/eval_s": "evaluation time, seconds",
    "time/sync_s": "weight sync to the rollout engine's copy (build, send, apply, verify), seconds",
    # the runs' own phase timers (experiments/memory/profiler.py StepProfiler, always on): a step's time by phase
    "time/old_logprobs_s": "the no-grad pass for pi_old (train.ppo_epochs > 1), seconds",
    "time/fwd_bwd_s": "forward + backward over every micro-batch (and the gradient reduction), seconds",
    "time/optimizer_s": "the update (clipping, moments, applying it) without the KL prediction and the realized-KL measurement, seconds (runs before time/kl_realized_s existed: with the measurement)",
    "time/kl_predict_s": "step control's KL prediction (and its trial forwards), seconds",
    "time/kl_realized_s": "step_control.measure_realized's two forwards of the trained batch and the exact KL (a diagnostic, not the method's cost), seconds",
    "sync/bytes": "tensor bytes sent to the rollout engine in the step (a full resync included)",
    "sync/full_bytes": "bytes a full-weight sync sends (every parameter once)",
    "sync/resyncs": "full resyncs in the step after a payload was refused (checksum mismatch, version gap)",
    "dist/allreduce_bytes": "bytes one rank all-reduced in the step's gradient reduction (Method.reduce_gradients: logra's m x r sketches + small dense grads; dense: every .grad; FSDP's own reduce-scatter of sharded grads and ZeRO's are not counted); only with several processes",
    "time/allreduce_s": "wall time of the step's gradient reduction (Method.reduce_gradients), seconds; only with several processes",
    "mem/peak_bytes": "peak memory: CUDA max allocated in the step, else the process's peak RSS so far",
    "mem/peak_rss_bytes": "the process's peak resident set size so far (ru_maxrss)",
    # log.memory_profile=true (experiments/memory/profiler.py): live tensor bytes by tensor accounting
    **{f"mem/{p}/peak_bytes": f"peak of live tensor bytes during the {p} phase of the step (CUDA: the allocator's max_memory_allocated, reset at the phase's start)"
       for p in ("rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync")},
    **{f"mem/{p}/start_bytes": f"live tensor bytes when the {p} phase of the step began (tensor accounting)"
       for p in ("rollout", "old_logprobs", "fwd_bwd", "optimizer", "kl_predict", "sync")},
    "mem/tensor_peak_bytes": "the step's peak of live tensor bytes (tensor accounting); the four categories below sum to it",
    "mem/params_bytes": "at the step's tensor peak: the trained model's parameters (an engine's own copy counts under activations/other)",
    "mem/grads_bytes": "at the step's tensor peak: the parameters' .grad tensors (LoGRA's sketches are optimizer state, not here)",
    "mem/optimizer_bytes": "at the step's tensor peak: optimizer state (moments, LoGRA sketches and row moments, GaLore projectors, fp32 masters)",
    "mem/activations_bytes": "at the step's tensor peak: every other live tensor (activations, logits, temporaries, an engine's copy)",
}


def documented_metrics() -> dict[str, str]:
    """Every documented key with its meaning: :data:`METRICS` and each registered method's ``metrics``."""
    from baselines import METHODS

    out = dict(METRICS)
    for name, method in sorted(METHODS.items()):
        for key, meaning in method.metrics.items():
            if key in METRICS and METRICS[key] != meaning:
                raise ValueError(f"method {name!r} redefines the harness metric {key!r}; choose another key")
            out.setdefault(key, f"{meaning} ({name})")
    return out


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def memory_metrics(device: torch.device) -> dict[str, float]:
    rss = peak_rss_bytes()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss
    return {"mem/peak_bytes": float(peak), "mem/peak_rss_bytes": float(rss)}


class MetricsWriter:
    """Appends one JSON line per record to ``metrics.jsonl`` (and TensorBoard when asked)."""

    def __init__(self, run_dir: Path, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.known = documented_metrics()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("log.tensorboard=true needs the tensorboard package: pip install tensorboard") from e
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (written after the checkpoint a resumed run restarts from)."""
        truncate_jsonl(self.path, step)

    def write(self, record: dict) -> None:
        unknown = [k for k in record if k not in self.known]
        if unknown:
            self.known = documented_metrics()  # a method registered after this writer was made
            unknown = [k for k in record if k not in self.known]
        if unknown:
            raise KeyError(f"undocumented metric keys {unknown}: add them to experiments/rl/metrics.py "
                           "(harness keys) or to the method's `metrics` (keys only it logs)")
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _step_of(line: str):
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None  # a line torn by a kill in the middle of its write


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep only the lines of a JSONL file whose ``step`` is at most ``step`` (and drop torn lines)."""
    path = Path(path)
    if path.exists():
        keep = [l for l in path.read_text().splitlines() if (s := _step_of(l)) is not None and s <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(l + "\n" for l in keep))
        tmp.replace(path)


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
