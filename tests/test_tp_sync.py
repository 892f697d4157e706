"""Tensor-parallel payload slicing (logra_core/sync.py: Part, shard_op, apply_lowrank_part, part_digest):
each shard's merge equals its slice of the whole merge, bit for bit, in every master mode; the shards'
digests add up to the whole tensor's."""

import pytest
import torch

from logra_core.digest import tensor_digest
from logra_core.precision import new_buffer
from logra_core.sync import LowRankOp, Part, apply_lowrank, apply_lowrank_part, part_digest, shard_op

pytestmark = pytest.mark.unit

MODES = ("fp32", "kahan", "stochastic", "none")
M, N, R = 48, 40, 6


def ops(master, steps=3, basis=False, seed=0):
    """``steps`` low-rank updates of an M × N weight: a seeded A (or a sent basis), decay both ways, and
    the rounding key of ``stochastic``. Updates are ~1e-2 of the weights so rounding matters in bf16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        left = torch.randn(M, R, generator=g) * 1e-2
        spec = (seed + 11, 3, step, "rademacher", R, N)
        op = LowRankOp(left=left, spec=None if basis else spec, decay=0.01 * (step % 2),
                       decay_first=step % 3 != 1, master=master, rounding=(seed + 11, step, 3))
        if basis:
            op.basis = torch.randn(R, N, generator=g)
        out.append(op)
    return out


def whole_run(w0, steps_ops, master):
    w = w0.clone()
    buffer = new_buffer(w, master)
    for op in steps_ops:
        apply_lowrank(w, op, buffer=buffer)
    return w, buffer


@pytest.mark.parametrize("basis", [False, True], ids=["seeded", "sent_basis"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layer", ["column_parallel", "row_parallel"])
@pytest.mark.parametrize("master", MODES)
def test_each_shard_equals_its_slice_of_the_whole_merge(master, layer, dtype, basis):
    w0 = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(dtype)
    steps = ops(master, basis=basis)
    whole, whole_buffer = whole_run(w0, steps, master)
    assert not torch.equal(whole, w0)
    for k in (2, 4):
        for rank in range(k):
            part = Part.rows_of((M, N), rank, k) if layer == "column_parallel" else Part.cols_of((M, N), rank, k)
            shard = part.take(w0).clone()
            buffer = new_buffer(shard, master)
            for op in steps:
                cut = shard_op(op, part)
                if layer == "column_parallel":  # its rows of L, the whole A
                    assert cut.left.shape == (M // k, R) and cut.columns is None
                else:  # the whole L, its columns of A
                    assert cut.left.shape == (M, R) and cut.right("cpu").shape == (R, N // k)
                apply_lowrank_part(shard, cut, part, buffer)
            assert torch.equal(shard, part.take(whole)), f"{layer} shard {rank}/{k}"
            if whole_buffer is not None:
                assert torch.equal(buffer, part.take(whole_buffer)), f"{layer} shard {rank}/{k}: buffer"


def test_a_shard_rounding_at_local_positions_would_differ():
    """The check above can fail: a column shard whose stochastic rounding drew its bits at local
    positions (as if it were a standalone tensor) differs from the slice of the whole merge."""
    w0 = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    steps = ops("stochastic")
    whole, _ = whole_run(w0, steps, "stochastic")
    part = Part.cols_of((M, N), 1, 2)
    shard = part.take(w0).clone()
    for op in steps:
        apply_lowrank(shard, shard_op(op, part))  # offset 0, width N/2: the wrong positions
    assert not torch.equal(shard, part.take(whole))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_shards_digests_add_up_to_the_whole(dtype):
    w = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(M, generator=torch.Generator().manual_seed(2)).to(dtype)
    for k in (2, 4):
        for parts in ([Part.rows_of((M, N), r, k) for r in range(k)], [Part.cols_of((M, N), r, k) for r in range(k)]):
            total = sum(int(part_digest(p.take(w).clone(), "w", p)) for p in parts) % 2**32
            assert total == int(tensor_digest(w, "w"))
        vector = [Part.rows_of((M,), r, k) for r in range(k)]
        assert sum(int(part_digest(p.take(bias), "b", p)) for p in vector) % 2**32 == int(tensor_digest(bias, "b"))
    flipped = w.clone()
    flipped.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[7, 33] ^= 1
    part = Part.cols_of((M, N), 1, 2)  # columns 20..39: holds the flipped word
    assert part_digest(part.take(flipped), "w", part) != part_digest(part.take(w), "w", part)


def test_uneven_splits_are_refused():
    with pytest.raises(ValueError, match="equal shards"):
        Part.rows_of((10, 4), 0, 3)
    with pytest.raises(ValueError, match="equal shards"):
        Part.cols_of((4, 10), 0, 4)
