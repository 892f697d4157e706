"""The GRPO loop — one for every method (docs/design.md §4).

Per step: sample ``prompts_per_step × group_size`` completions from the rollout engine → verify
rewards → group advantages → (old log-probs) → micro-batch forward/backward, accumulating →
``method.step()`` → log; every ``eval.every`` steps a greedy pass@1 evaluation; every
``checkpoint.every`` steps a checkpoint. The trainer knows methods, tasks and engines only through
their registries and interfaces.

Old log-probs: with ``ppo_epochs = 1`` the policy that sampled is the one being trained, so
π_old = π_θ detached from the same forward pass (the ratio is exactly 1 and only its gradient
matters); with more epochs they come from one extra no-grad pass before the first update.

Fault tolerance (``experiments/rl/guard.py``): an update whose loss, accumulated gradients/sketches
or (with step control) proposed update holds a NaN/Inf is skipped and logged (``step/skipped``,
``<run_dir>/skips.jsonl``); ``guard.max_consecutive_skips`` skipped steps in a row stop the run with
:class:`NonFiniteError` after a checkpoint. SIGTERM/SIGUSR1 during :meth:`GRPOTrainer.train` finish
the current step, write a checkpoint and raise :class:`Preempted`. An out-of-memory error names its
phase and the memory planner's estimate. Checkpoints are crash-safe (``experiments/rl/checkpoint.py``).
"""

from __future__ import annotations

import math
import os
import random
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from baselines import METHODS
from experiments.common.provenance import git_sha  # noqa: F401  (re-exported for older callers)
from experiments.rl.distributed import build_strategy
from experiments.rl.grpo import clipped_policy_loss, completion_logprobs, group_advantages, logit_softcap
from experiments.rl.guard import (PREEMPTED_EXIT, NonFiniteError, Preempted, PreemptionSignals,  # noqa: F401  (re-exported)
                                  oom_context, planner_estimate, update_nonfinite)
from experiments.memory.profiler import MemoryProfiler, StepProfiler, optimizer_tensors, write_phase_trace
from experiments.rl.metrics import MetricsWriter, memory_metrics, read_metrics
from experiments.rl.models import load_skeleton
from experiments.rl.probe_capture import ProbeCapture
from experiments.rl.rollout import Rollouts, build_engine
from experiments.rl.run_dir import RunDirectory
from experiments.rl.sync_engines import PolicyFactory
from experiments.rl.sync_stats import WeightSync
from experiments.rl.tasks import build_task, format_prompt, held_out
from logra_core.kl_predictor import exact_kl, hidden_states
from logra_core.step_control import step_scale

def probe_inputs(rollouts: Rollouts, device) -> dict[str, torch.Tensor]:
    """Model inputs of a probe batch for the KL predictor, and ``positions``: the [B, P + C] mask of
    the positions that predict response tokens."""
    ids, mask = (t.to(device) for t in rollouts.model_inputs())
    positions = torch.zeros_like(mask, dtype=torch.bool)
    positions[:, -rollouts.completion_ids.shape[1] - 1 : -1] = rollouts.completion_mask.bool().to(device)
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0),
                positions=positions)


def probe_rows(rows: torch.Tensor, group_size: int, k: int, seed: int, step: int) -> torch.Tensor:
    """``k`` of the kept ``rows`` (group-major row indices) for the KL probe, spread over the prompt
    groups: the rows are shuffled by a generator seeded with (seed, step), then taken round-robin —
    every group's first drawn row, then every group's second, ... — so the probe sees min(k, groups)
    prompts rather than the first k / group_size of them."""
    if k >= len(rows):
        return rows
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    shuffled = rows[torch.randperm(len(rows), generator=g)]
    seen: dict[int, int] = {}
    turn = []
    for r in shuffled.tolist():  # the row's turn: how many of its group were drawn before it
        turn.append(seen.get(r // group_size, 0))
        seen[r // group_size] = turn[-1] + 1
    order = torch.argsort(torch.tensor(turn), stable=True)
    return shuffled[order[:k]]


class GRPOTrainer:
    def __init__(self, cfg: DictConfig):
        self.cfg_yaml = cfg
        self.cfg = OmegaConf.to_object(cfg)
        c = self.cfg
        self.run_dir = Path(c.out_dir)
        self.directory = RunDirectory(self.run_dir, cfg)  # config, meta, samples, skips, checkpoints
        self.dist = build_strategy(c, METHODS[c.method])  # one process: the identity (experiments/rl/distributed/)
        if self.dist.is_main:
            self.directory.check()  # refuse to overwrite a run, or to resume one with another config
        if c.threads > 0:
            torch.set_num_threads(c.threads)
        self.device = torch.device("cuda" if c.device == "auto" and torch.cuda.is_available() else ("cpu" if c.device == "auto" else c.device))
        random.seed(c.seed)
        torch.manual_seed(c.seed + 1_000_003 * self.dist.rank)  # ranks sample different completions

        self.task = build_task(c.task)
        self.train_problems = self.task.train_split()
        self.test_problems = held_out(self.task.test_split(), c.eval.size, c.seed)  # seeded order
        if not self.train_problems:
            raise ValueError(f"task {c.task.name!r} has no training problems")
        self.reward_fn = self.task.reward_function()

        self.method = METHODS[c.method](getattr(c, c.method))
        # every rank profiles itself (log.memory_profile): rank 0 into memory_profile.jsonl, rank r into memory_profile_rank<r>.jsonl
        profile_path = self.run_dir / ("memory_profile.jsonl" if self.dist.is_main else f"memory_profile_rank{self.dist.rank}.jsonl")
        trace = os.environ.get("LOGRA_MEMORY_TRACE", "") not in ("", "0")
        init = MemoryProfiler(torch.nn.Module(), trace=trace) if c.log.memory_profile else None  # the load's peak: "init"
        with init or nullcontext():
            with init.phase("init") if init else nullcontext():
                skeleton, self.tokenizer, source = load_skeleton(c.model)  # no weights yet: the strategy places them
                self.model = self.dist.build_model(skeleton, source, self.method, self.device, c.model)
            self.ref_model = None
            if c.train.kl_coef > 0:  # placed as the policy is (sharded under fsdp2)
                with init.phase("init_reference") if init else nullcontext():
                    self.ref_model = self.dist.build_reference(*load_skeleton(c.model)[::2], self.device, c.model)
        self.method = self.dist.attach(self.method)
        self.model.train()
        self.profiler = StepProfiler(c.log.memory_profile, self.model,  # off by default
                                     lambda: optimizer_tensors(self.method, self.model), self.device, profile_path,
                                     resident=lambda: self.engine.resident_tensors())
        if init is not None:
            self.profiler.write({"step": 0, **init.record()})
            if trace:
                write_phase_trace(init, Path(str(profile_path) + ".trace.txt"), 0)
        enabled = c.step_control.enabled
        self.step_control = self.method.step_control_default if enabled is None else enabled
        self.engine = build_engine(c.rollout, self.model, self.tokenizer,
                                   factory=PolicyFactory(c.model, c.method, getattr(c, c.method), c.threads))
        self.weight_sync = WeightSync(self.model, self.engine, self.dist.sync_sender)  # bytes, resyncs, full-sync fallback
        if self.dist.is_main:
            self.directory.record()  # only now: a run that failed to set up leaves no run directory behind
        self.metrics = self.dist.metrics_writer(lambda: MetricsWriter(self.run_dir, tensorboard=c.log.tensorboard))
        self.step = 0
        self.epoch, self.cursor = 0, 0
        self.consecutive_skips = 0  # steps in a row skipped by the non-finite guard
        self.kl_trial_scale = 1.0  # the secant KL predictor's trial scale: the last applied step scale
        self._skips: list[str] = []  # why this step's updates were skipped
        self._bad_loss: str | None = None
        if c.resume:
            self._resume()

    # ---- checkpoints ----------------------------------------------------------------------------
    def _resume(self) -> None:
        found = self.directory.latest_checkpoint(verbose=self.dist.is_main)  # the newest complete one, or None
        if found:
            state = self.dist.load_checkpoint(found, self.model, self.method)  # CheckpointCorrupt on a checksum mismatch
            self.step, self.epoch, self.cursor = state["step"], state["epoch"], state["cursor"]
            self.consecutive_skips = state.get("consecutive_skips", 0)
            self.kl_trial_scale = state.get("kl_trial_scale", 1.0)
            print(f"[resume] continuing {self.run_dir} from step {self.step}")
        else:
            print(f"[resume] no checkpoint yet in {self.run_dir}: starting at step 0")
        # records written after that checkpoint are redone, not duplicated
        self.metrics.truncate_after(self.step if found else -1)
        if self.dist.is_main:
            self.directory.truncate_after(self.step if found else -1)

    def save(self) -> None:
        state = {"epoch": self.epoch, "cursor": self.cursor, "consecutive_skips": self.consecutive_skips,
                 "kl_trial_scale": self.kl_trial_scale}
        self.dist.save_checkpoint(self.run_dir, self.step, self.model, self.method, state, keep=self.cfg.checkpoint.keep)  # every rank

    # ---- data -----------------------------------------------------------------------------
    def _next_problems(self, n: int):
        """The next ``n`` training problems of a seeded per-epoch permutation (resumable cursor)."""
        out = []
        while len(out) < n:
            order = torch.randperm(len(self.train_problems), generator=torch.Generator().manual_seed(self.cfg.seed * 100_003 + self.epoch))
            take = order[self.cursor : self.cursor + n - len(out)].tolist()
            out += [self.train_problems[i] for i in take]
            self.cursor += len(take)
            if self.cursor >= len(self.train_problems):
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def _policy_weights(self):
        """The trainer's whole weights while the engine samples from them (sharded strategies gather
        them); nothing where the engine holds its own copy."""
        return self.engine.sampling() if self.engine.holds_copy else self.dist.full_weights(self.model)

    def _prompts(self, problems) -> list[str]:
        return [format_prompt(self.tokenizer, p, self.cfg.task.instruction) for p in problems]

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> list[dict]:
        """Run to ``train.steps``; :class:`Preempted` after a checkpoint when SIGTERM/SIGUSR1 came,
        :class:`NonFiniteError` after a checkpoint when ``guard.max_consecutive_skips`` steps in a row were skipped."""
        c = self.cfg
        try:
            with PreemptionSignals() as signals:
                self.sync(full=True)  # the engine's copy starts equal to the (possibly resumed) policy
                if self.step == 0 and c.eval.every > 0 and c.eval.at_start:
                    self.metrics.write({"step": 0, **self.evaluate()})
                bar = tqdm(total=c.train.steps, initial=self.step, desc=f"GRPO {c.method}", disable=not (c.log.progress and self.dist.is_main), dynamic_ncols=True)
                while self.step < c.train.steps:
                    record = self.train_step()
                    self.step += 1
                    self.consecutive_skips = self.consecutive_skips + 1 if record.get("step/skipped") else 0
                    if c.eval.every > 0 and (self.step % c.eval.every == 0 or self.step == c.train.steps):
                        record.update(self.evaluate())
                    self.metrics.write({"step": self.step, **record})
                    self._checkpoint_or_stop(signals)
                    shown = {"reward": "reward/mean", "eval_acc": "eval/accuracy", "loss": "loss/policy"}
                    bar.set_postfix({label: f"{record[k]:.3f}" for label, k in shown.items() if k in record})
                    bar.update(1)
                bar.close()
        finally:
            self.close()
        return read_metrics(self.run_dir)

    def _checkpoint_or_stop(self, signals: PreemptionSignals) -> None:
        """After a step: save when due, then stop with :class:`NonFiniteError` (too many skips in a
        row) or :class:`Preempted` (a signal reached any rank), each after a checkpoint."""
        c = self.cfg
        give_up = 0 < c.guard.max_consecutive_skips <= self.consecutive_skips
        told = self.dist.all_sum(1.0 if signals.received else 0.0)[0] > 0  # every rank stops together
        preempted = told and self.step < c.train.steps  # a finished run simply ends
        if (c.checkpoint.every > 0 and self.step % c.checkpoint.every == 0) or self.step == c.train.steps \
                or give_up or preempted:
            self.save()
        if give_up:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive steps skipped for non-finite values (last: "
                f"{'; '.join(self._skips) or 'another rank'}); see {self.directory.skips_path}. The checkpoint "
                f"of step {self.step} holds the weights of the last good update.")
        if preempted:
            raise Preempted(f"{signals.received or 'a signal on another rank'}: stopped at step {self.step} "
                            "after a checkpoint; rerun with resume=true to continue")

    def close(self) -> None:
        self.metrics.close()
        self.reward_fn.close()
        self.engine.close()

    def train_step(self) -> dict[str, float]:
        c, tc = self.cfg, self.cfg.train
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        problems = self.dist.shard(self._next_problems(tc.prompts_per_step))  # this rank's whole groups
        with self.profiler.step(self.step + 1), self._phase("rollout"), self._policy_weights():
            rollouts = self.dist.generate(self.engine, self._prompts(problems), tc.group_size, self.step)
        t1 = time.perf_counter()
        references = [p.reference for p in problems for _ in range(tc.group_size)]
        timeouts = getattr(self.reward_fn, "timeouts", None)  # answers cut off by the verifier's hard timeout so far
        rewards = torch.tensor(self.reward_fn(rollouts.texts, references), dtype=torch.float32)
        t2 = time.perf_counter()
        advantages = group_advantages(rewards, tc.group_size, tc.std_normalize)
        keep = advantages != 0 if (tc.skip_zero_advantage and tc.kl_coef == 0) else torch.ones_like(advantages, dtype=torch.bool)
        every = self.dist.gather  # the whole global batch's rewards and lengths (the identity on one process)
        all_rewards, lengths = every(rewards), every(rollouts.completion_mask.sum(1).float())
        record = {
            "reward/mean": float(all_rewards.mean()),
            "reward/std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
            "reward/accuracy": float((all_rewards > 0.5).float().mean()),
            "reward/zero_std_groups": float((all_rewards.view(-1, tc.group_size).std(1) == 0).float().mean()) if tc.group_size > 1 else 1.0,
            "rollout/len_mean": float(lengths.mean()),
            "rollout/seq_len": float(every(torch.tensor([float(rollouts.prompt_ids.shape[1] + rollouts.completion_ids.shape[1])])).max()),
            "rollout/truncated_frac": float(every(rollouts.truncated.float()).mean()),
        }
        if timeouts is not None:  # scored 0 without a verdict: a rising count means reward_timeout_s is too short
            record["reward/timeouts"] = self.dist.all_sum(self.reward_fn.timeouts - timeouts)[0]
        self._skips = []
        with self.profiler.step(self.step + 1):
            record.update(self._optimize(rollouts, advantages, keep))
        self._log_skips()
        t3 = time.perf_counter()
        record.update({"time/rollout_s": t1 - t0, "time/reward_s": t2 - t1, "time/train_s": t3 - t2, "time/step_s": t3 - t0})
        record.update(memory_metrics(self.device))
        record.update(self.profiler.record())
        self._log_samples(problems, rollouts, rewards)
        return record

    def _optimize(self, rollouts: Rollouts, advantages: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        """``ppo_epochs`` updates on the rows in ``keep``, each from gradients accumulated over micro-batches."""
        tc = self.cfg.train
        rows = keep.nonzero().squeeze(-1)
        trained_seqs, trained_tokens = self.dist.all_sum(len(rows), rollouts.completion_mask[rows].sum())  # over ranks
        stats = {"rollout/trained_seqs": trained_seqs, "rollout/trained_tokens": 0.0, "step/skipped": 0.0}
        if trained_seqs == 0:  # every group had equal rewards: no signal, no update
            return {**stats, "loss/policy": 0.0, "clip/fraction": 0.0}
        micro, real = self.dist.micro_batches(rows, tc.micro_batch_size)  # FSDP: padded to equal forward counts
        stats["rollout/trained_tokens"] = trained_tokens
        old = None
        if tc.ppo_epochs > 1:
            with torch.no_grad(), self._phase("old_logprobs"):
                old = [self._logprobs(self.model, rollouts.select(idx)) for idx in micro]
        for epoch in range(tc.ppo_epochs):
            self.method.zero_grad()
            capture = self._probe_capture(rows)  # secant control: keep the probe's hidden states from this pass
            with self._phase("fwd_bwd"):
                pass_stats = self.accumulate_gradients(rollouts, advantages, micro, old, real=real, capture=capture)
                stats.update(self.dist.reduce_gradients(self.method))  # once per update, not per micro-batch
            h_old = capture.hidden() if capture else None
            if capture:
                capture.close()
            if epoch == 0:
                stats["kl/sampler_trainer"] = pass_stats.pop("kl/sampler_trainer")
            if self._skip_if_nonfinite(self._bad_loss or self.method.nonfinite()):
                stats["step/skipped"] += 1.0
                continue
            with self._phase("optimizer"):
                step_stats = self._controlled_step(rollouts, rows, h_old, advantages) if self.step_control else self.method.step()
            if step_stats is None:  # the proposed update was not finite: not applied
                stats["step/skipped"] += 1.0
                continue
            stats.update(step_stats)
            with self._phase("sync"):
                synced = self.sync()
            WeightSync.add(stats, synced)  # the engine follows every applied update
        self.method.zero_grad()
        pass_stats.pop("kl/sampler_trainer", None)
        return {**stats, **pass_stats}

    def _skip_if_nonfinite(self, reason: str | None) -> bool:
        """Skip this update when any rank found a non-finite tensor (all-reduced, so every rank
        agrees): drop the accumulated gradients/sketches, note why."""
        if self.dist.all_sum(1.0 if reason else 0.0)[0] == 0:
            return False
        self._skips.append(reason or "a non-finite value on another rank")
        self.method.discard()
        return True

    def _log_skips(self) -> None:
        if not self._skips or not self.dist.is_main:
            return
        print(f"[guard] step {self.step + 1}: update skipped, non-finite {'; '.join(self._skips)}", flush=True)
        self.directory.append_skip({"step": self.step + 1, "nonfinite": self._skips, "consecutive": self.consecutive_skips + 1})

    @contextmanager
    def _phase(self, name: str):
        """A step phase: profiled (log.memory_profile) and named in an out-of-memory error."""
        with oom_context(name, self._memory_estimate), self.profiler.phase(name):
            yield

    def _memory_estimate(self) -> str:
        config = getattr(self.model, "config", None)
        return planner_estimate(self.cfg, config.to_dict() if hasattr(config, "to_dict") else None,
                                self.dist.world_size, self.device)

    def sync(self, full: bool = False) -> dict[str, float]:
        """Bring the engine's copy of the policy up to date (docs/design.md §3.3): the last step's payload, or
        every tensor; a payload the engine rejects (checksum, version gap) is followed by a full one."""
        return self.weight_sync(self.method, full=full, step=self.step)

    def _probe(self, rows: torch.Tensor) -> torch.Tensor:
        """This step's KL probe: this rank's share of the kept ``rows``, spread over the prompt groups."""
        sc = self.cfg.step_control
        k = -(-sc.probe_rows(len(rows) * self.dist.world_size) // self.dist.world_size)  # each rank probes its share
        return probe_rows(rows, self.cfg.train.group_size, k, self.cfg.seed + self.dist.rank, self.step)

    def _probe_capture(self, rows: torch.Tensor) -> ProbeCapture | None:
        """A hook keeping the probe's hidden states from the coming forward, for the secant predictor on
        an fp32/fp64 model (experiments/rl/probe_capture.py says why not in bf16)."""
        if not (self.step_control and self.cfg.step_control.predictor == "secant"):
            return None
        if next(self.model.parameters()).dtype not in (torch.float32, torch.float64):
            return None
        probe = self._probe(rows)
        return ProbeCapture(self.model.get_decoder(), probe) if len(probe) else None

    def _probe_weights(self, rollouts: Rollouts, rows: torch.Tensor, probe: torch.Tensor,
                       advantages: torch.Tensor | None) -> tuple[torch.Tensor, float] | None:
        """(the probe rows' weights w, the batch's token mean of w) for the ratio estimator
        (logra_core.kl_predictor.sampled_mean), or None: every row weighs its tokens.
        ``probe_weighting=advantage``: w = |advantage|, the row's share of the update — measured on
        SmolLM2 to track the row's KL (docs/speed.md); tokens where a trained row has advantage 0
        (kl_coef > 0 or skip_zero_advantage=false), whose KL w = 0 could not stand for."""
        if self.cfg.step_control.probe_weighting != "advantage" or advantages is None:
            return None
        a = advantages.detach().abs().double().cpu()
        if not bool((a[rows] > 0).all()):
            return None
        n = rollouts.completion_mask.sum(1).double().cpu()
        return a[probe.cpu()], float((a[rows] * n[rows]).sum() / n[rows].sum())

    def _controlled_step(self, rollouts: Rollouts, rows: torch.Tensor, h_old: torch.Tensor | None = None,
                         advantages: torch.Tensor | None = None) -> dict[str, float] | None:
        """Propose the update, predict its KL on a probe of the batch, apply it scaled (docs/design.md §3.2).
        None: the update was not finite and is not applied (the optimizer's moments have advanced).
        ``h_old``: the probe's hidden states at θ, kept from the update's forward (secant predictor);
        ``advantages``: the batch's, for ``step_control.probe_weighting=advantage``."""
        sc = self.cfg.step_control
        update, stats = self.method.propose()
        if self._skip_if_nonfinite(update_nonfinite(update)):
            return None
        probe = self._probe(rows)
        inputs = probe_inputs(rollouts.select(probe), self.device) if len(probe) else None
        weight = float(inputs["positions"].sum()) if inputs else 0.0
        sizes = self._probe_weights(rollouts, rows, probe, advantages) if inputs else None
        T = self.temperature  # the probe's distributions are the sampler's, softmax(z / T)
        with self._phase("kl_predict"):  # a collective where the weights are sharded: every rank calls it
            at, trials = self.kl_trial_scale, 0
            while True:  # secant: measure again at the chosen scale while it is more than 2x off the trial's
                predicted, stderr = self.dist.predict_kl(self.model, inputs, update, sc.chunk, population=len(rows),
                                                         temperature=T, predictor=sc.predictor, at=at, h_old=h_old,
                                                         weights=sizes, share_context=sc.share_context)
                predicted = self.dist.weighted_mean(predicted, weight)  # the mean over every rank's probe tokens
                stderr = self.dist.weighted_mean(stderr, weight)  # the sampling error of reading it as the batch's KL
                scale, trials = step_scale(predicted, sc.target_kl), trials + 1
                nxt = max(scale, sc.min_trial_scale)
                if sc.predictor != "secant" or scale == 0 or trials >= sc.max_trials or abs(math.log(nxt / at)) <= math.log(2):
                    break
                at = nxt
        if scale > 0 and sc.predictor == "secant":  # the next step's trial scale (a skipped step keeps the last)
            self.kl_trial_scale = max(scale, sc.min_trial_scale)
        if sc.measure_realized:  # the whole trained batch, in micro-batches: the reference the probe estimates
            with self._phase("kl_realized"):
                batches = self.dist.even_probes([probe_inputs(rollouts.select(idx), self.device)
                                                 for idx in rows.split(self.cfg.train.micro_batch_size)] if len(rows) else [],
                                                self.model)
                head = self.model.get_output_embeddings().weight  # (a sharded model: this rank's rows, and no whole copy below)
                h_old, w_old = [hidden_states(self.model, **b) / T for b in batches], head.detach().clone()
        self.method.apply(update, scale)
        if sc.predictor == "secant":
            stats.update({"kl/trial_scale": at, "kl/trials": trials})
        stats.update({"kl/predicted": predicted, "kl/predicted_scaled": predicted * scale**2, "step/scale": scale,
                      "kl/predicted_stderr": stderr, "kl/probe_tokens": self.dist.all_sum(weight)[0]})
        if sc.measure_realized:
            with self._phase("kl_realized"):
                W = self.model.get_output_embeddings().weight.detach()
                terms = [exact_kl(h, w_old, hidden_states(self.model, **b) / T, W, sc.chunk, logit_softcap(self.model))
                         for h, b in zip(h_old, batches)]
                tokens = float(sum(t.numel() for t in terms))
                realized = float(sum(t.sum() for t in terms)) / tokens if tokens else 0.0
                stats["kl/realized"] = self.dist.weighted_mean(realized, tokens)
        return stats

    def accumulate_gradients(self, rollouts: Rollouts, advantages: torch.Tensor, micro: list[torch.Tensor], old=None,
                             real: int | None = None, capture: ProbeCapture | None = None) -> dict[str, float]:
        """Backward of the batch's token-mean loss, one micro-batch (row indices) at a time.

        ``old``: per-micro-batch old log-probs, or None for on-policy (π_old = π_θ detached).
        Each micro-batch's loss is divided by the token count of all micro-batches together, so
        the accumulated gradient equals the whole batch's; with several ranks the count is the global
        batch's, so the ranks' gradients sum to it. Micro-batches from index ``real`` on are padding
        (FSDP: equal forward counts on every rank), trained with weight 0.
        """
        tc = self.cfg.train
        real = len(micro) if real is None else real
        num_tokens = self.dist.all_sum(sum(rollouts.completion_mask[idx].sum() for idx in micro[:real]))[0]
        loss_sum, clipped, kl_sum, sampler_diff = 0.0, 0.0, 0.0, 0.0
        self._bad_loss = None  # the first micro-batch whose loss is not finite (the guard skips the update)
        for k, idx in enumerate(micro):
            mb = rollouts.select(idx)
            if capture is not None:
                capture.micro_batch(idx, mb.completion_mask)
            logprobs = self._logprobs(self.model, mb)
            old_lp = old[k] if old is not None else logprobs.detach()
            mask = mb.completion_mask.to(self.device)
            ref_lp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_lp = self._logprobs(self.ref_model, mb)
                self.dist.release(self.ref_model)  # fsdp2: no gathered root kept between forwards
            loss, s = clipped_policy_loss(
                logprobs, old_lp, advantages[idx].to(self.device), mask, tc.clip_low, tc.clip_high,
                num_tokens, ref_lp, tc.kl_coef,
            )
            if k >= real:
                loss, s, mask = loss * 0.0, {}, mask * 0
            self.method.backward(loss, last=k == len(micro) - 1)
            loss_value = float(loss.detach())
            if self._bad_loss is None and not math.isfinite(loss_value):
                self._bad_loss = f"loss (micro-batch {k})"
            loss_sum += loss_value
            clipped += s.get("clipped_tokens", 0.0)
            kl_sum += s.get("kl_sum", 0.0)
            sampler_diff += float(((mb.sampler_logprobs.to(self.device) - old_lp) * mask).sum())
        loss_sum, clipped, kl_sum, sampler_diff = self.dist.all_sum(loss_sum, clipped, kl_sum, sampler_diff)
        stats = {"loss/policy": loss_sum, "clip/fraction": clipped / num_tokens, "kl/sampler_trainer": sampler_diff / num_tokens}
        if self.ref_model is not None:
            stats["kl/ref"] = kl_sum / num_tokens
        return stats

    def _logprobs(self, model, mb: Rollouts) -> torch.Tensor:
        ids, mask = mb.model_inputs()
        return completion_logprobs(model, ids.to(self.device), mask.to(self.device), mb.completion_ids.shape[1],
                                   self.cfg.train.logprob_chunk, self.temperature)

    @property
    def temperature(self) -> float:
        """The sampling temperature T the trainer's log-probs and the KL probe use (1 for greedy rollouts)."""
        return self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0

    # ---- evaluation, logging --------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 on the run's ``eval.size`` held-out problems (``tasks.held_out``: a seeded order);
        the main rank appends every problem's outcome to ``eval_outcomes.jsonl`` (``RunDirectory``)."""
        c = self.cfg
        t0 = time.perf_counter()
        correct, lengths = [], []
        problems, real = self.dist.shard_padded(self.test_problems)  # every rank evaluates its share
        with oom_context("eval", self._memory_estimate), \
                torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), self._policy_weights():
            for i in tqdm(range(0, len(problems), c.eval.batch_size), desc="eval", leave=False, disable=not c.log.progress):
                batch = problems[i : i + c.eval.batch_size]
                out = self.engine.generate(self._prompts(batch), n=1, greedy=True, max_new_tokens=c.eval.max_new_tokens)
                correct += self.reward_fn(out.texts, [p.reference for p in batch])
                lengths += out.completion_mask.sum(1).tolist()
        n_correct, n, length_sum = self.dist.all_sum(sum(r > 0.5 for r in correct[:real]), real, sum(lengths[:real]))
        # rank r evaluated problems[r·k:(r+1)·k], padded past the end (dist.shard_padded): gathered in rank
        # order, the first len(test_problems) outcomes are the held-out problems' in their order
        solved = self.dist.gather(torch.tensor([r > 0.5 for r in correct], dtype=torch.float32))[: len(self.test_problems)]
        if self.dist.is_main:
            self.directory.append_eval_outcomes(self.step, [p.uid for p in self.test_problems], (solved > 0.5).tolist())
        return {
            "eval/accuracy": n_correct / max(n, 1),
            "eval/num_problems": n,
            "eval/len_mean": length_sum / max(n, 1),
            "time/eval_s": time.perf_counter() - t0,
        }

    def _log_samples(self, problems, rollouts: Rollouts, rewards: torch.Tensor) -> None:
        n = min(self.cfg.log.samples, len(rollouts))
        if n <= 0 or not self.dist.is_main:
            return
        G = self.cfg.train.group_size
        self.directory.append_samples([{"step": self.step + 1, "question": problems[i // G].question, "reference": problems[i // G].reference,
                                     "completion": rollouts.texts[i], "reward": float(rewards[i])} for i in range(n)])

