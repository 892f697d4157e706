"""Rollout engines that hold their own copy of the policy, kept equal to the trainer's by weight sync.

``rollout.engine``:

* ``shared`` (:mod:`experiments.rl.rollout`): generation on the trainer's own module; nothing to sync.
* ``hf``: an HF model in the trainer's process, a separate copy of the policy, fed payloads by call.
* ``hf_process``: an HF model in a worker process, fed payloads over a gloo :class:`Channel`; it
  generates the rollouts and sends them back, so what samples is the synced copy.

Every sync is verified by checksum on the receiving side; a failure (a corrupt payload, a version
gap) makes the trainer send a full payload (:mod:`logra_core.sync`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

from experiments.rl.rollout import (HFGenerateEngine, RolloutConfig, RolloutEngine, Rollouts, copy_policy,
                                   register_engine)
from logra_core.sync import Channel, SyncPayload, SyncReceiver, recv_payload, send_payload


@dataclass
class PolicyFactory:
    """Builds the policy skeleton a worker process receives weights into: the model of the run with the
    method's structural changes (``Method.prepare``, e.g. LoRA adapters). Picklable."""

    model_cfg: Any
    method: str
    method_cfg: Any
    threads: int = 0

    def __call__(self, weights: bool = True, device="cpu"):
        """(policy, tokenizer) on ``device``; ``weights=False``: allocated, not read (a copy that its
        first full sync fills: nothing is loaded twice)."""
        from baselines import METHODS
        from experiments.rl.models import load_model

        if self.threads > 0:
            torch.set_num_threads(self.threads)
        model, tokenizer = load_model(self.model_cfg, device=device, weights=weights)
        model = METHODS[self.method](self.method_cfg).prepare(model)
        return model.eval().requires_grad_(False), tokenizer


@register_engine("hf")
class HFCopyEngine(HFGenerateEngine):
    """Generation on an in-process copy of the policy, updated only through sync payloads."""

    holds_copy = True

    def __init__(self, cfg: RolloutConfig, model, tokenizer, factory: Optional[Callable] = None):
        copy_ = copy_policy(model, factory)
        super().__init__(cfg, copy_, tokenizer)
        self.receiver = SyncReceiver(copy_)

    def receive(self, payload: SyncPayload) -> bool:
        return self.receiver.receive(payload)

    @property
    def last_error(self) -> str:
        return self.receiver.last_error

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def resident_tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.receiver.tensors.masters.values()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(port: int, cfg: RolloutConfig, factory: Callable) -> None:
    """The rollout process: receive payloads, generate on request, until told to stop."""
    channel = Channel(port, rank=1)
    model, tokenizer = factory()
    engine = HFGenerateEngine(cfg, model, tokenizer)
    receiver = SyncReceiver(model)
    while True:
        cmd, args = channel.recv_obj()
        if cmd == "sync":
            ok = receiver.receive(recv_payload(channel))
            channel.send_obj((ok, receiver.last_error))
        elif cmd == "generate":
            channel.send_obj(engine.generate(*args))
        elif cmd == "state":
            channel.send_obj({n: p.detach().clone() for n, p in model.named_parameters()})
        elif cmd == "stop":
            channel.send_obj("stopped")
            return


@register_engine("hf_process")
class HFProcessEngine(RolloutEngine):
    """An HF policy in a worker process (spawned; gloo on CPU): syncs and generation go over a Channel.

    The worker runs on CPU, so the trainer must too: a low-rank delta W + L·A computed by another
    device's kernels rounds differently, fails the receiver's checksum and turns every sync into a
    full one. A trainer on any other device is refused here, before a process is spawned.
    """

    holds_copy = True

    def __init__(self, cfg: RolloutConfig, model, tokenizer, factory: Optional[Callable] = None):
        if factory is None:
            raise ValueError("rollout.engine=hf_process needs a factory that builds the policy in the worker")
        device = next(iter(model.parameters())).device
        if device.type != "cpu":
            raise ValueError(
                f"rollout.engine=hf_process generates on CPU but the trainer is on {device}: every low-rank "
                "delta would be applied by other kernels, fail the checksum and fall back to a full sync. "
                "Use rollout.engine=hf (same device as the trainer) or device=cpu.")
        port = _free_port()
        self.process = mp.get_context("spawn").Process(target=_worker, args=(port, cfg, factory), daemon=True)
        self.process.start()
        self.channel = Channel(port, rank=0)
        self.last_error = ""

    def _call(self, cmd: str, *args):
        if not self.process.is_alive():
            raise RuntimeError(f"the rollout worker process died (exit code {self.process.exitcode})")
        self.channel.send_obj((cmd, args))

    def generate(self, prompts: list[str], n: int = 1, greedy: bool = False, max_new_tokens: int = 0) -> Rollouts:
        self._call("generate", prompts, n, greedy, max_new_tokens)
        return self.channel.recv_obj()

    def receive(self, payload: SyncPayload) -> bool:
        self._call("sync")
        send_payload(payload, self.channel)
        ok, self.last_error = self.channel.recv_obj()
        return ok

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._call("state")
        return self.channel.recv_obj()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._call("stop")
                self.channel.recv_obj()
            finally:
                self.process.join(timeout=30)
                if self.process.is_alive():
                    self.process.kill()
