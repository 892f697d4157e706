"""Weight sync from trainer to rollout engine (docs/design.md §3.3): bit-exact copies, corruption and gaps healed."""

import collections
import copy
import dataclasses
import pickle

import pytest
import torch
import transformers

from experiments.config import build_config
from experiments.rl.trainer import GRPOTrainer
from logra_core.optimizer import LoGRA
from logra_core.sync import LowRankOp, SyncReceiver, SyncSender, apply_lowrank, full_bytes, recv_payload, send_payload
from tests.conftest import TINY
from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

pytestmark = pytest.mark.unit

VARIANTS = {
    "default": dict(rank=4, lr=1e-2, weight_decay=0.1),
    "embeddings": dict(rank=4, lr=1e-2, embeddings=True),
    "svd": dict(rank=4, lr=1e-2, projection="svd", refresh_every=3, weight_decay=0.1),
}


def tiny(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def logra_step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 10), generator=gen)
    loss = (model(ids).logits.float() * torch.randn(2, 10, 96, generator=gen)).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def assert_equal_models(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def synced_pair(dtype, variant):
    model = tiny(dtype)
    engine_model = copy.deepcopy(model).requires_grad_(False)
    opt = LoGRA(model, **VARIANTS[variant])
    sender, receiver = SyncSender(model), SyncReceiver(engine_model)
    assert receiver.receive(sender.full(opt.masters()))
    return model, engine_model, opt, sender, receiver


def deliver(opt, sender):
    return sender.delta(opt.last_lowrank, opt.last_changed, opt.masters())


@pytest.mark.integration  # slow for the unit tier (see --durations)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_twenty_logra_steps_stay_bit_equal(dtype, variant):
    model, engine_model, opt, sender, receiver = synced_pair(dtype, variant)
    for step in range(20):
        logra_step(model, opt, step)
        payload = deliver(opt, sender)
        assert payload.lowrank, "sketched weights travel as low-rank ops"
        assert all((op.spec is None) == (variant == "svd") for op in payload.lowrank.values())
        assert receiver.receive(payload), receiver.last_error
        assert payload.nbytes() < full_bytes(model)
    assert_equal_models(model, engine_model)
    if dtype == torch.bfloat16:  # the receiver's fp32 masters equal the optimizer's
        masters = opt.masters()
        assert masters and masters.keys() == receiver.tensors.masters.keys()
        assert all(torch.equal(masters[n], receiver.tensors.masters[n]) for n in masters)


def test_a_different_rounding_of_the_same_update_drifts():
    """Why the receiver must replay the trainer's exact op: adding the formed L·A instead of addmm_
    rounds differently, and the checksum notices."""
    model, engine_model, opt, sender, receiver = synced_pair(torch.float32, "default")
    logra_step(model, opt, 0)
    payload = deliver(opt, sender)
    params = dict(engine_model.named_parameters())
    with torch.no_grad():
        for name, op in payload.lowrank.items():
            p = params[name]
            p.mul_(1 - op.decay)
            p.add_(op.left.double() @ op.right(p.device).double())  # same math, fp64 product
        for name, value in payload.values.items():
            params[name].copy_(value)
    assert any(not torch.equal(params[n], p) for n, p in model.named_parameters())
    assert receiver.tensors.checksum(payload.touched()) != payload.checksum


@pytest.mark.parametrize("fault,variant", [("flipped bit", "default"), ("lost payload", "embeddings")])
def test_a_faulty_delivery_is_caught_and_healed(fault, variant):
    """Payload 3 arrives with one bit flipped in one factor (checksum) or never arrives (the next one
    meets a version gap); the receiver refuses, a full payload heals it, and later steps stay equal."""
    model, engine_model, opt, sender, receiver = synced_pair(torch.float32, variant)
    for step in range(6):
        logra_step(model, opt, step)
        payload = deliver(opt, sender)
        if step == 2 and fault == "lost payload":
            continue
        if step == 2:
            raw = payload.lowrank[sorted(payload.lowrank)[1]].left.view(torch.uint8).view(-1)
            raw[5] ^= 0x01
        if step == (2 if fault == "flipped bit" else 3):
            assert not receiver.receive(payload)
            assert ("checksum" if fault == "flipped bit" else "version gap") in receiver.last_error
            assert receiver.receive(sender.full(opt.masters()))
        else:
            assert receiver.receive(payload), receiver.last_error
    assert_equal_models(model, engine_model)


def test_a_step_payload_holds_one_gathered_factor_at_a_time():
    """A sharded sender gathers each op's L when the receiver reads it (StreamedOps), so a step's
    payload adds one whole L at a time, not every sketched weight's at once; its size is known from
    the header without a gather."""
    from logra_core.digest import BLOCK, GROUP_BLOCKS
    from experiments.memory.profiler import MemoryProfiler

    class Gathering(SyncSender):  # as fsdp2's GatheringSender: each read makes a new whole L
        def whole_op(self, name, op):
            return dataclasses.replace(op, left=op.left.clone())

    rows, rank = 1 << 15, 64  # L: 8 MiB, above the digest's work buffer
    model = torch.nn.Sequential(*[torch.nn.Linear(rank, rows, bias=False) for _ in range(6)])
    engine_model = copy.deepcopy(model).requires_grad_(False)
    sender, receiver = Gathering(model), SyncReceiver(engine_model)
    assert receiver.receive(sender.full())
    ops = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            ops[name] = LowRankOp(torch.randn(rows, rank) * 1e-3, spec=(0, i, 1, "rademacher", rank, rank))
            apply_lowrank(p, ops[name])
    factors = sum(op.nbytes() for op in ops.values())
    profiler = MemoryProfiler(torch.nn.Module())
    with profiler:
        profiler.register([*model.parameters(), *engine_model.parameters(), *(op.left for op in ops.values())])
        before = profiler.current
        payload = sender.delta(ops, [], {})
        assert payload.nbytes() == factors
        assert receiver.receive(payload), receiver.last_error
    extra = profiler.peak - before
    assert extra <= factors / len(ops) + 4 * GROUP_BLOCKS * BLOCK + (1 << 16), (extra, factors)
    assert extra < 0.5 * factors
    assert_equal_models(model, engine_model)


class _Pipe:
    """Both ends of a Channel in one process: what one end sends, the other receives, in order."""

    def __init__(self):
        self.items = collections.deque()

    def send_obj(self, obj):
        self.items.append(pickle.loads(pickle.dumps(obj)))

    def recv_obj(self):
        return self.items.popleft()

    def send_tensor(self, t):
        self.items.append(t.clone())

    def recv_tensor(self, shape, dtype):
        t = self.items.popleft()
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype
        return t


@pytest.mark.parametrize("variant", ["embeddings", "svd"])
def test_a_payload_over_a_channel_arrives_as_the_receiver_reads_it(variant):
    """recv_payload reads the header only; each op (its L, and A where no seed rebuilds it) and tensor
    comes off the channel when the receiver reads it — so a full resync over a channel also holds one
    extra tensor at a time — and a read out of the sent order is refused, not misapplied."""
    model, engine_model, opt, sender, receiver = synced_pair(torch.bfloat16, variant)
    pipe = _Pipe()
    for step in range(2):
        logra_step(model, opt, step)
        send_payload(deliver(opt, sender), pipe)
        payload = recv_payload(pipe)
        assert payload.lowrank and payload.values
        assert len(pipe.items) == sum(1 + (op.basis is not None) for op in payload.lowrank.meta.values()) + len(payload.values)
        assert receiver.receive(payload), receiver.last_error
        assert not pipe.items
    send_payload(sender.full(opt.masters()), pipe)
    full = recv_payload(pipe)
    assert full.masters and len(pipe.items) == len(full.values) + len(full.masters)
    assert receiver.receive(full), receiver.last_error
    assert not pipe.items
    assert_equal_models(model, engine_model)
    logra_step(model, opt, 2)
    send_payload(deliver(opt, sender), pipe)
    payload = recv_payload(pipe)
    with pytest.raises(RuntimeError, match="out of order"):
        payload.lowrank[sorted(payload.lowrank)[-1]]


def test_apply_lowrank_decay_order():
    W = torch.ones(2, 3)
    op = LowRankOp(torch.ones(2, 1), basis=torch.ones(1, 3), decay=0.5, decay_first=True)
    apply_lowrank(W, op)
    assert torch.equal(W, torch.full((2, 3), 1.5))  # (1 − ½)·1 + 1
    W = torch.ones(2, 3)
    apply_lowrank(W, LowRankOp(torch.ones(2, 1), basis=torch.ones(1, 3), decay=0.5, decay_first=False))
    assert torch.equal(W, torch.full((2, 3), 1.0))  # (1 + 1) − ½·2


# ---- in the GRPO loop: the engine the rollouts come from ----------------------------------------------
METHOD_ARGS = {
    "logra": ["method=logra", "logra.rank=4", "logra.lr=1e-2", "logra.weight_decay=0.1"],
    "dense": ["method=dense", "dense.lr=1e-3"],
    "lora": ["method=lora", "lora.r=4", "lora.lr=1e-2"],
}


def run_steps(tmp_path, method, engine, steps, extra=()):
    cfg = build_config([*TINY, *METHOD_ARGS[method], f"rollout.engine={engine}", "eval.every=0",
                        f"out_dir={tmp_path / 'run'}", *extra])
    t = GRPOTrainer(cfg)
    try:
        t.sync(full=True)
        records = []
        for _ in range(steps):
            records.append(t.train_step())
            t.step += 1
        state = t.engine.state_dict()
        trainer_state = {n: p.detach() for n, p in t.model.named_parameters()}
    finally:
        t.close()
    return records, state, trainer_state


# Every master mode in the loop through the in-process engine; the engine in its own process (the same
# receiver behind a pipe) once per dtype, bf16 with the paper profile's stochastic rounding (each master mode's
# merge is also checked without the loop, shard against whole: tests/test_tp_sync.py).
@pytest.mark.parametrize("engine,dtype,master", [
    ("hf", "float32", "fp32"), ("hf_process", "float32", "fp32"),
    *[("hf", "bfloat16", master) for master in ("fp32", "kahan", "stochastic", "none")],
    ("hf_process", "bfloat16", "stochastic")])
@pytest.mark.integration
def test_engine_equals_trainer_after_twenty_logra_steps(tmp_path, engine, dtype, master):
    records, state, trainer_state = run_steps(tmp_path, "logra", engine, 20, [f"model.dtype={dtype}", f"logra.master={master}"])
    assert state.keys() == trainer_state.keys()
    for name, value in trainer_state.items():
        assert torch.equal(state[name], value), name
    synced = [r for r in records if "sync/bytes" in r and r["rollout/trained_seqs"] > 0]
    assert len(synced) >= 10
    assert all(r["sync/resyncs"] == 0 and 0 < r["sync/bytes"] < r["sync/full_bytes"] for r in synced)
    if dtype == "float32":  # the sampler is the synced policy: its log-probs are the trainer's
        assert all(abs(r["kl/sampler_trainer"]) < 1e-4 for r in synced)


@pytest.mark.integration
@pytest.mark.parametrize("method,engine", [("dense", "hf"), ("lora", "hf"), ("lora", "hf_process")])
def test_dense_and_lora_payloads_stay_equal(tmp_path, method, engine):
    records, state, trainer_state = run_steps(tmp_path, method, engine, 4)
    for name, value in trainer_state.items():
        assert torch.equal(state[name], value), name
    synced = [r for r in records if "sync/bytes" in r]
    assert synced and all(r["sync/resyncs"] == 0 for r in synced)
    if method == "lora":  # adapters only
        assert all(r["sync/bytes"] < 0.5 * r["sync/full_bytes"] for r in synced)


def flip_sign_bit(t: torch.Tensor) -> None:
    """Flip one bit in place: the sign bit of ``t``'s largest-magnitude element. (A low mantissa bit,
    which an earlier version flipped, can leave every merged weight unchanged, and then the checksum
    rightly sees nothing: CI caught that once.)"""
    i = int(t.abs().argmax())
    t.view(torch.uint8).view(-1)[i * t.element_size() + t.element_size() - 1] ^= 0x80  # little-endian: sign in the last byte


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["hf", "hf_process"])
def test_trainer_heals_a_corrupt_and_a_lost_payload(tmp_path, engine):
    """In the loop: payload 3 arrives with a flipped bit, payload 5 never arrives (its ack faked); the
    engine refuses the corrupt one and the one after the gap, the trainer resyncs, and it ends equal."""
    cfg = build_config([*TINY, *METHOD_ARGS["logra"], f"rollout.engine={engine}", "eval.every=0",
                        f"out_dir={tmp_path / 'run'}"])
    t = GRPOTrainer(cfg)
    deliver_ = t.engine.receive
    calls = []

    def faulty(payload):
        calls.append(payload.version)
        if not payload.full and len(calls) == 4:
            payload = dataclasses.replace(payload, lowrank={n: copy.deepcopy(op) for n, op in payload.lowrank.items()},
                                          values=dict(payload.values))  # what travels: read once, then corrupted
            flip_sign_bit(max(payload.lowrank.values(), key=lambda op: op.left.abs().max()).left)
        if not payload.full and len(calls) == 6:
            return True  # lost in transit
        return deliver_(payload)

    t.engine.receive = faulty
    try:
        t.sync(full=True)
        records = []
        while len([r for r in records if "sync/bytes" in r]) < 8:
            records.append(t.train_step())
            t.step += 1
        state, trainer_state = t.engine.state_dict(), {n: p.detach() for n, p in t.model.named_parameters()}
    finally:
        t.close()
    assert sum(r.get("sync/resyncs", 0) for r in records) == 2
    for name, value in trainer_state.items():
        assert torch.equal(state[name], value), name


@pytest.mark.integration
def test_a_run_with_a_synced_engine_logs_its_sync_metrics(tmp_path):
    cfg = build_config([*TINY, *METHOD_ARGS["logra"], "rollout.engine=hf", "train.steps=3",
                        f"out_dir={tmp_path / 'run'}"])
    rows = [r for r in GRPOTrainer(cfg).train() if r.get("rollout/trained_seqs")]
    assert rows and all(0 < r["sync/bytes"] < r["sync/full_bytes"] and r["time/sync_s"] > 0 for r in rows)


def test_hf_process_refuses_a_trainer_off_cpu():
    """The worker generates on CPU: a CUDA trainer's low-rank deltas would round differently there
    and fail every checksum, so the combination is refused before a process is spawned."""
    from types import SimpleNamespace

    from experiments.rl.rollout import RolloutConfig, build_engine

    on_cuda = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda", 0))]))
    with pytest.raises(ValueError, match="hf_process.*CPU.*checksum"):
        build_engine(RolloutConfig(engine="hf_process"), on_cuda, tokenizer=None, factory=lambda: None)


# ---- what verifying a sync costs: digests on the device, one tensor at a time -----------------------
def _host_bytes(monkeypatch) -> list[int]:
    """Count the bytes of every tensor read to the host (``.cpu``, ``.numpy``, ``.tolist``, ``.item``, or
    ``.to`` a CPU device from another) from now on — on this CPU-only machine, the calls that on a GPU
    would copy to the host; returns the list the counts are appended to."""
    moved = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            to_host = any(str(a).startswith("cpu") for a in (*args, kwargs.get("device", ""))) and self.device.type != "cpu"
            if name != "to" or to_host:
                moved.append(self.numel() * self.element_size())
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("cpu", "numpy", "tolist", "item", "to"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sync_moves_no_weight_to_the_host_to_verify(monkeypatch, dtype):
    """Every sketched weight (and, in bf16, its fp32 master) is touched by a LoGRA step, yet building,
    applying and verifying the payload reads only the digests to the host: 8 bytes per digested tensor
    on each side (the old check copied every touched tensor and master to the host to CRC it)."""
    model, engine_model, opt, sender, receiver = synced_pair(dtype, "default")
    logra_step(model, opt, 0)
    moved = _host_bytes(monkeypatch)
    payload = deliver(opt, sender)
    assert receiver.receive(payload), receiver.last_error
    monkeypatch.undo()
    digested = len(payload.touched()) + len(opt.masters())
    assert len(payload.lowrank) >= 14 and (dtype == torch.float32 or opt.masters())
    assert sum(moved) <= 2 * 8 * digested and max(moved) <= 8 * digested, moved


def test_a_full_resync_holds_one_extra_tensor_at_a_time():
    """A full payload streams: each tensor (and master) is made when the receiver reads it and dropped
    after, so a resync's extra peak is one tensor plus the digest's work buffer — not a second model."""
    from logra_core.digest import BLOCK, GROUP_BLOCKS
    from experiments.memory.profiler import MemoryProfiler

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(6)])
    engine_model = copy.deepcopy(model).requires_grad_(False)
    masters = {n: p.detach().double() for n, p in list(model.named_parameters())[:2]}  # 8 MiB each
    sender, receiver = SyncSender(model), SyncReceiver(engine_model)
    assert receiver.receive(sender.full(masters))  # the first sync: the receiver now keeps masters too
    with torch.no_grad():
        for p in engine_model.parameters():
            p.mul_(0.5)  # drifted: the resync must rewrite everything
    profiler = MemoryProfiler(torch.nn.Module())
    with profiler:
        profiler.register([*model.parameters(), *engine_model.parameters(), *masters.values(),
                           *receiver.tensors.masters.values()])
        before = profiler.current
        assert receiver.receive(sender.full(masters))
    largest = max(t.numel() * t.element_size() for t in [*model.parameters(), *masters.values()])
    extra = profiler.peak - before
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert extra <= largest + 4 * GROUP_BLOCKS * BLOCK + (1 << 16), (extra, largest)
    assert extra < 0.5 * whole
    assert_equal_models(model, engine_model)
