"""Weight sync from the trainer to a rollout engine that holds its own copy, and what it cost.

After every applied update the engine receives the step's payload (``logra_core/sync.py``: low-rank
factors for sketched weights, the other tensors whole; ``docs/design.md`` §3.3); a payload the engine
rejects (checksum mismatch, version gap) is followed by a full one. Each call returns
``sync/bytes`` (bytes sent, a fallback included), ``sync/full_bytes`` (what a full sync would send),
``sync/resyncs`` (fallbacks) and ``time/sync_s``; over the updates of one step :meth:`WeightSync.add`
sums the bytes, resyncs and time.
"""

from __future__ import annotations

import time

from logra_core.sync import SyncSender, full_bytes

ADDITIVE = ("sync/bytes", "time/sync_s", "sync/resyncs")  # summed over a step's updates; the rest: the last value


class WeightSync:
    """The sender side for ``engine``; a no-op (empty stats) for an engine that shares the trainer's module."""

    def __init__(self, model, engine, make_sender=SyncSender):
        self.model, self.engine = model, engine
        self.sender = make_sender(model) if engine.holds_copy else None  # the strategy's (sharded weights: gathered)

    def __call__(self, method, full: bool = False, step: int = 0) -> dict[str, float]:
        """Send ``method``'s last update (``full``: every tensor) and return the stats above."""
        if self.sender is None:
            return {}
        t0 = time.perf_counter()
        ops, changed, masters = method.sync_entries()
        full = full or self.engine.needs_full  # an engine whose copy was dropped (vLLM sleep level 2)
        payload = self.sender.full(masters) if full else self.sender.delta(ops, changed, masters)
        sent, resyncs = payload.nbytes(), 0
        if not self.sender.agree(self.engine.receive(payload)):  # a sharded sender's ranks resync together
            if full:
                raise RuntimeError(f"rollout engine rejected a full sync: {self.engine.last_error or 'on another rank'}")
            print(f"[sync] step {step}: {self.engine.last_error or 'a rank refused the payload'}; sending every tensor")
            payload = self.sender.full(masters)
            sent, resyncs = sent + payload.nbytes(), 1
            if not self.sender.agree(self.engine.receive(payload)):
                raise RuntimeError(f"rollout engine rejected a full resync: {self.engine.last_error or 'on another rank'}")
        return {"sync/bytes": float(sent), "sync/full_bytes": float(full_bytes(self.model)),
                "sync/resyncs": float(resyncs), "time/sync_s": time.perf_counter() - t0}

    @staticmethod
    def add(stats: dict[str, float], synced: dict[str, float]) -> None:
        """Fold one update's sync stats into the step's ``stats`` (in place)."""
        for k, v in synced.items():
            stats[k] = stats.get(k, 0.0) + v if k in ADDITIVE else v
