"""The weight digest of the sync check (logra_core/digest.py): its definition, shards that add up, and
changes it cannot miss."""

import pytest
import torch

from logra_core.digest import BLOCK, MASK32, _splitmix64, block_term, salt, tensor_digest

pytestmark = pytest.mark.unit


def reference(t: torch.Tensor, name: str, offset: int = 0) -> int:
    """D = Σ_i w_i (T[i mod B] + u(s, ⌊i/B⌋)) mod 2³², word by word in Python integers."""
    s, per = salt(name), max(1, t.element_size() // 4)
    flat = t.contiguous().reshape(-1)
    if t.element_size() >= 4:
        words = flat.view(torch.int32).tolist()
    else:
        words = flat.view({1: torch.int8, 2: torch.int16}[t.element_size()]).tolist()
    total = 0
    for k, w in enumerate(words):
        i = offset * per + k
        c = ((_splitmix64(i % BLOCK) | 1) + block_term(s, i // BLOCK)) & MASK32
        total = (total + w * c) & MASK32
    return total


@pytest.mark.parametrize("dtype, shape, offset", [(torch.float32, (37, 23), 0), (torch.float32, (3, 70000), 12345),
                                                  (torch.bfloat16, (61, 29), 5), (torch.float64, (9, 11), 7),
                                                  (torch.float16, (300,), 0)])
def test_equals_its_definition(dtype, shape, offset):
    """The device computation (int32 products and sums, wrapping mod 2³², blocks grouped) equals the
    sum written out in Python integers, across block boundaries and offsets."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert int(tensor_digest(t, "w", offset)) == reference(t, "w", offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_shards_add_up(dtype):
    """Any split into row shards: the shards' digests (each at its first element's offset) sum, mod 2³²,
    to the whole tensor's — what a row-sharded sender all-reduces. A strided view digests like its copy."""
    t = torch.randn(301, 257, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = int(tensor_digest(t, "w"))
    for cuts in ([151], [1, 2, 300], [100, 200]):
        edges = [0, *cuts, t.shape[0]]
        parts = sum(int(tensor_digest(t[a:b], "w", a * t.shape[1])) for a, b in zip(edges, edges[1:]))
        assert parts & MASK32 == whole
    assert int(tensor_digest(t[:, 3:90], "w")) == int(tensor_digest(t[:, 3:90].contiguous(), "w"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_single_bit_flip_changes_it(dtype):
    """A one-word change δ moves D by δ·c_i with c_i odd: never zero mod 2³², whichever bit, wherever."""
    t = torch.randn(129, 515, generator=torch.Generator().manual_seed(2)).to(dtype)
    base = int(tensor_digest(t, "w"))
    width = 8 * t.element_size()
    gen = torch.Generator().manual_seed(3)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for _ in range(200):
        i = int(torch.randint(0, t.numel(), (1,), generator=gen))
        bit = int(torch.randint(0, width, (1,), generator=gen))
        u = t.clone()
        word = u.view(-1)[i : i + 1].view(ints)
        word.bitwise_xor_(torch.tensor(1, dtype=ints) << bit)
        assert int(tensor_digest(u, "w")) != base, (i, bit)


def test_names_and_swapped_rows_differ():
    """The salt separates equal contents under two names; two swapped rows are a change like any other."""
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(4))
    assert int(tensor_digest(t, "a")) != int(tensor_digest(t, "b"))
    swapped = t.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert int(tensor_digest(swapped, "a")) != int(tensor_digest(t, "a"))
