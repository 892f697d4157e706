"""The tensor-accounting memory profiler."""

import pytest
import torch

from experiments.memory.profiler import MemoryProfiler

pytestmark = pytest.mark.unit


def _adam_state(opt):
    return lambda: [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def test_categories_add_up_to_the_peak_and_match_the_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(m.parameters())
    prof = MemoryProfiler(m, _adam_state(opt))
    with prof:
        for _ in range(2):
            with prof.phase("fwd_bwd"):
                m(torch.randn(32, 128)).pow(2).sum().backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    rec = prof.record()
    cats = [rec[f"mem/{k}_bytes"] for k in ("params", "grads", "optimizer", "activations")]
    assert sum(cats) == rec["mem/tensor_peak_bytes"] == max(rec["mem/fwd_bwd/peak_bytes"], rec["mem/optimizer/peak_bytes"])
    n = sum(p.numel() * 4 for p in m.parameters())
    assert rec["mem/params_bytes"] == n
    assert rec["mem/optimizer/peak_bytes"] == rec["mem/tensor_peak_bytes"]  # Adam's step is the peak here
    assert rec["mem/grads_bytes"] == n  # the peak is inside step(): every grad alive
    assert n * 2 <= rec["mem/optimizer_bytes"] <= n * 2 + 1024  # two moments (+ step counters)


def test_freed_tensors_leave_the_count():
    m = torch.nn.Linear(4, 4)
    prof = MemoryProfiler(m)
    with prof:
        base = prof.current
        x = torch.empty(1024, 1024)  # 4 MiB
        assert prof.current == base + 4 * 2**20
        del x
        assert prof.current == base
    assert prof.peak == base + 4 * 2**20


def test_unknown_phase_is_an_error():
    with pytest.raises(ValueError, match="unknown phase"):
        with MemoryProfiler(torch.nn.Linear(2, 2)).phase("bogus"):
            pass


@pytest.mark.integration
def test_memory_table_cli_on_tiny_llama(tmp_path, capsys):
    """Fresh child per method, categories sum to the peak, logra has no dense projection grads."""
    import csv

    from experiments.memory_table import main

    assert main([f"out={tmp_path}", "model=tiny-llama", "methods=dense,logra", "seqs=2", "micro_batch=2",
                 "completion_len=8", "steps=1"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "memory.csv")))
    assert [r["method"] for r in rows] == ["dense", "logra"]
    for r in rows:
        cats = sum(int(r[f"{k}_bytes"]) for k in ("params", "grads", "optimizer", "activations"))
        assert cats == int(r["peak_bytes"]) and len(r["git_sha"]) >= 7
    dense, logra = rows
    assert int(logra["grads_bytes"]) < int(dense["grads_bytes"])  # projections train by sketches
    assert (tmp_path / "memory.png").is_file() and (tmp_path / "memory.pdf").is_file()
    assert "logra" in capsys.readouterr().out


def test_memory_table_rejects_an_unknown_method(tmp_path):
    from experiments.memory_table import main

    with pytest.raises(SystemExit, match="unknown method"):
        main([f"out={tmp_path}", "methods=dense,adam8bit"])


@pytest.mark.integration
@pytest.mark.parametrize("method", ["dense", "logra"])
def test_trainer_writes_the_profile(tmp_path, method):
    """log.memory_profile=true: every phase's peak, categories summing to the tensor peak, a profile file."""
    import json

    from experiments.config import build_config
    from experiments.rl.metrics import read_metrics
    from experiments.rl.trainer import GRPOTrainer
    from tests.conftest import TINY
    from tests.toy_task import Toy  # noqa: F401  (registers the toy task)

    cfg = build_config([*TINY, f"out_dir={tmp_path / 'r'}", "train.steps=2", f"method={method}", "log.memory_profile=true",
                        "train.skip_zero_advantage=false"])
    trainer = GRPOTrainer(cfg)
    trainer.train()
    trainer.close()
    rows = [r for r in read_metrics(tmp_path / "r") if "mem/tensor_peak_bytes" in r]
    assert len(rows) == 2
    for r in rows:
        cats = sum(r[f"mem/{k}_bytes"] for k in ("params", "grads", "optimizer", "activations"))
        assert cats == r["mem/tensor_peak_bytes"]
        phases = [k for k in r if k.endswith("/peak_bytes") and k.count("/") == 2]
        assert {"mem/rollout/peak_bytes", "mem/fwd_bwd/peak_bytes", "mem/optimizer/peak_bytes"} <= set(phases)
        assert max(r[k] for k in phases) == r["mem/tensor_peak_bytes"]
        assert r["mem/params_bytes"] == sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    lines = [json.loads(l) for l in open(tmp_path / "r" / "memory_profile.jsonl")]
    assert [l["step"] for l in lines[1:]] == [r["step"] for r in rows] == [1, 2]  # the metrics step numbers
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert lines[0]["step"] == 0 and lines[0]["mem/init/peak_bytes"] >= params  # the load, before step 1


def test_the_live_snapshot_is_taken_again_when_a_finalizer_frees_during_the_copy():
    """A storage's finalizer can run inside ``list(live.items())`` (a collection triggered by the copy's
    allocation) and pop from ``live``: seen as "dictionary changed size during iteration" in a quick run's
    logra profile. The snapshot retries instead of failing the run."""
    class FreedDuringCopy(dict):
        copies = 0

        def items(self):
            FreedDuringCopy.copies += 1
            if FreedDuringCopy.copies == 1:
                self.pop(2)  # what the finalizer does
                raise RuntimeError("dictionary changed size during iteration")
            return super().items()

    prof = MemoryProfiler.__new__(MemoryProfiler)
    prof.live = FreedDuringCopy({1: 8, 2: 16})
    assert prof._snapshot() == [(1, 8)] and FreedDuringCopy.copies == 2


@pytest.mark.parametrize("enabled", [False, True])
def test_the_optimizer_phase_excludes_the_kl_phases_timed_inside_it(enabled, monkeypatch):
    """time/optimizer_s is the update alone: kl_predict and kl_realized (measure_realized's forwards,
    timed only, no memory phase of their own) are opened inside it and subtracted."""
    from experiments.memory.profiler import StepProfiler

    ticks = iter(range(100))
    prof = StepProfiler(enabled, torch.nn.Linear(2, 2), lambda: [], torch.device("cpu"))
    monkeypatch.setattr(prof, "_clock", lambda: float(next(ticks)))
    with prof.step(1):
        with prof.phase("optimizer"):  # clock 0 .. 11: kl_predict 2 .. 5, kl_realized 6 .. 8 and 9 .. 10
            next(ticks)
            with prof.phase("kl_predict"):
                for _ in range(2):
                    next(ticks)
            with prof.phase("kl_realized"):
                next(ticks)
            with prof.phase("kl_realized"):
                pass
    rec = prof.record()
    assert (rec["time/optimizer_s"], rec["time/kl_predict_s"], rec["time/kl_realized_s"]) == (5.0, 3.0, 3.0)
    assert ("mem/kl_realized/peak_bytes" in rec) is False and ("mem/optimizer/peak_bytes" in rec) is enabled
