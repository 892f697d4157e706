"""Projections A = f(seed, layer, step) from Philox-4x32-10: reference vectors, no stream shared
between the (layer, step) projections of a run, cross-correlations at chance, determinism from the key."""

import math

import pytest
import torch

from logra_core.sketch import philox4x32, projection, projection_words

pytestmark = pytest.mark.unit

M = 0xFFFFFFFF
# Random123's known-answer vectors for philox4x32_10: (counter, key) -> four words
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_matches_the_reference_vectors(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key)) == expected


def shared_windows(shapes, steps, words=projection_words, seed=0):
    """Pairs of (layer, step) projections whose word streams overlap: projection P's first two words
    (a 64-bit fingerprint) found at any position of projection Q's stream, Q ≠ P. Any overlap of two
    windows of one sequence contains the start of one of them, so this finds every shared window."""
    keys = [(layer, step, rows * cols) for step in range(steps) for layer, (rows, cols) in enumerate(shapes)]
    streams = {}
    prints = []
    for layer, step, n in keys:
        w = words(n, seed, layer, step)
        streams[(layer, step)] = w
        prints.append(int((w[0] << 32) | w[1]))  # int64, wrapping: still a 64-bit fingerprint
    table = torch.tensor(prints, dtype=torch.int64).sort().values
    owner = {p: k[:2] for p, k in zip(prints, keys)}
    found = set()
    for key, w in streams.items():
        pairs = (w[:-1] << 32) | w[1:]
        at = torch.searchsorted(table, pairs).clamp(max=len(table) - 1)
        hits = pairs[table[at] == pairs]
        for h in hits.tolist():
            if owner[h] != key:
                found.add(tuple(sorted((owner[h], key))))
    return found


def test_no_shared_windows_within_a_30_step_run():
    """21 projections (rank 64, width 576) × 30 steps: the old generator (windows of one fmix32
    sequence at key·φ⁻¹) shared windows between some pairs at this size; Philox shares none."""
    assert shared_windows([(64, 576)] * 21, 30) == set()


@pytest.mark.slow
def test_no_shared_windows_in_a_smollm2_shaped_run():
    """SmolLM2-135M at rank 64: 30 layers × (q, k, v, o, gate, up of width 576; down of width 1536),
    30 steps = 6,300 projections (the old generator: 381 overlapping pairs)."""
    shapes = [(64, 576)] * 6 + [(64, 1536)]
    assert shared_windows(shapes * 30, 30) == set()


def test_cross_correlations_at_chance():
    """Entries of distinct projections are uncorrelated: |corr| ≤ 5/√n over 55 pairs (neighbouring
    layers, neighbouring steps, other seeds); each is ~N(0, 1/n) when independent."""
    r, c = 16, 256
    n = r * c
    others = [dict(seed=0, layer=layer, step=7) for layer in range(24) if layer != 5]
    others += [dict(seed=0, layer=5, step=s) for s in range(24) if s != 7]
    others += [dict(seed=s, layer=5, step=7) for s in range(1, 10)]
    for kind in ("rademacher", "gaussian"):
        base = projection(r, c, seed=0, layer=5, step=7, kind=kind).flatten().double()
        z = []
        for o in others:
            other = projection(r, c, kind=kind, **o).flatten().double()
            z.append(float(torch.corrcoef(torch.stack([base, other]))[0, 1]) * math.sqrt(n))
        assert max(abs(v) for v in z) < 5, (kind, max(z, key=abs))
        assert abs(sum(v * v for v in z) / len(z) - 1) < 0.5  # the z-scores have unit variance


def test_projection_is_a_function_of_the_key_only():
    a = projection(16, 100, seed=2**40 + 3, layer=9, step=70000)
    assert torch.equal(a, projection(16, 100, seed=2**40 + 3, layer=9, step=70000))
    assert not torch.equal(a, projection(16, 100, seed=3, layer=9, step=70000))  # the seed's high word counts
    # a projection's words do not depend on its shape beyond their number: a prefix of a longer one
    assert torch.equal(projection_words(50, 1, 2, 3), projection_words(4000, 1, 2, 3)[:50])
    with pytest.raises(ValueError, match="layer"):
        projection(4, 4, seed=0, layer=-1, step=0)
    with pytest.raises(ValueError, match="step"):
        projection(4, 4, seed=0, layer=0, step=2**32)
