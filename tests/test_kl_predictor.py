"""Predicted KL (docs/design.md §3.2): vocabulary sums, head tangents, forward-mode tangents, KL̂ vs realized KL."""

import importlib.util
import subprocess
import sys
import textwrap
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from logra_core.kl_predictor import (exact_kl, head_tangent_factors, hidden_and_tangent, hidden_states, kl_terms,
                                     kl_terms_reference, predict_kl)

pytestmark = pytest.mark.unit

HAS_TRITON = importlib.util.find_spec("triton") is not None
REPO = Path(__file__).resolve().parents[1]


def dense_kl_terms(h, W, g, U):
    """½(Σ p δz² − (Σ p δz)²) with the full T × V softmax, in float64."""
    p = torch.softmax(h.double() @ W.double().t(), dim=-1)
    dz = sum(gi.double() @ Ui.double().t() for gi, Ui in zip(g, U))
    return 0.5 * ((p * dz**2).sum(-1) - (p * dz).sum(-1) ** 2)


def random_factors(T, d, V, ks, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h, W = torch.randn(T, d, generator=gen, dtype=dtype), torch.randn(V, d, generator=gen, dtype=dtype) / d**0.5
    g = [torch.randn(T, k, generator=gen, dtype=dtype) for k in ks]
    U = [torch.randn(V, k, generator=gen, dtype=dtype) for k in ks]
    return h, W, g, U


# ---- vocabulary sums -------------------------------------------------------------------------
def test_kl_terms_hand_worked():
    # V = 2, z = (0, 0) so p = (½, ½); δz = (1, −1): Σ p δz² = 1, Σ p δz = 0 → ½·(1 − 0) = 0.5.
    h, W = torch.zeros(2, 1), torch.zeros(2, 1)
    g, U = torch.ones(2, 1), torch.tensor([[1.0], [-1.0]])
    torch.testing.assert_close(kl_terms(h, W, g, U, chunk=1), torch.tensor([0.5, 0.5]))
    # A second pair adding δz = (7, 7) to token 1 only shifts its logits alike: still 0.5 each.
    shift_g, shift_U = torch.tensor([[0.0], [7.0]]), torch.ones(2, 1)
    torch.testing.assert_close(kl_terms(h, W, [g, shift_g], [U, shift_U]), torch.tensor([0.5, 0.5]))
    # δz = (1, 1): the distribution does not move → 0.
    torch.testing.assert_close(kl_terms(h, W, torch.ones(2, 1), torch.ones(2, 1)), torch.zeros(2))


@pytest.mark.parametrize("chunk", [1, 3, 7, 256])
@pytest.mark.parametrize("ks", [(5,), (9, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_kl_terms_equal_dense(chunk, ks, seed):
    h, W, g, U = random_factors(T=7, d=12, V=50, ks=ks, seed=seed)  # chunk 3 does not divide T = 7
    out = kl_terms(h, W, g, U, chunk=chunk)
    assert out.dtype == torch.float32 and out.shape == (7,)
    torch.testing.assert_close(out.double(), dense_kl_terms(h, W, g, U), rtol=1e-5, atol=1e-7)


def test_kl_terms_shift_invariant_in_fp32():
    """A large common offset in δz (a moving logit scale) must not swamp the variance in fp32."""
    h, W, g, U = random_factors(T=6, d=8, V=40, ks=(4,), seed=3)
    shifted = kl_terms(h, W, [g[0], torch.full((6, 1), 1e3)], [U[0], torch.ones(40, 1)])
    torch.testing.assert_close(shifted.double(), dense_kl_terms(h, W, g, U), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("delta", ["none", "dense", "lowrank", "lowrank+dense"])
def test_head_tangent_factors_equal_jvp_of_logits(delta):
    gen = torch.Generator().manual_seed(4)
    T, d, V, r = 5, 8, 30, 3
    h, h_dot, W = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in [(T, d), (T, d), (V, d)])
    D, A, dW = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in [(V, r), (r, d), (V, d)])
    pieces = {"none": None, "dense": dW, "lowrank": (D, A), "lowrank+dense": [(D, A), dW]}[delta]
    dW_total = {"none": 0 * dW, "dense": dW, "lowrank": D @ A, "lowrank+dense": D @ A + dW}[delta]
    _, expected = torch.func.jvp(lambda h_, W_: h_ @ W_.t(), (h, W), (h_dot, dW_total))
    g, U = head_tangent_factors(h, h_dot, W, pieces)
    torch.testing.assert_close(sum(gi @ Ui.t() for gi, Ui in zip(g, U)), expected)


# ---- forward-mode tangents through a tiny Llama (float64) ----------------------------------------
def tiny_llama(tied=True):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).double().eval()
    for m in model.modules():  # HF's RMSNorm computes in fp32: keep the fp64 model fp64 end to end
        if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm):
            m.forward = types.MethodType(lambda self, x: self.weight * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon), m)
    return model


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    positions = mask.bool().clone()
    positions[:, :4] = False  # the "response": positions 4..8
    return ids, mask, positions


def make_update(model, kind, scale=0.1, seed=0):
    """(lowrank, dense) of a random update of the given kind, entries of size ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * scale
    lowrank, dense = {}, {}
    pattern = {"lowrank_qvd": ("q_proj", "v_proj", "down_proj"), "lowrank_all": ("proj",),
               "mixed": ("k_proj", "up_proj")}.get(kind, ())
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(p in name for p in pattern):
            lowrank[name] = (rnd(m.out_features, 3), rnd(3, m.in_features))
    if kind in ("lowrank_all", "mixed"):
        lowrank["model.embed_tokens"] = (rnd(128, 3), rnd(3, 32))  # tied: the head moves too
    if kind in ("dense", "mixed"):
        for name, p in model.named_parameters():
            if "norm" in name or "o_proj" in name or "embed" in name or (kind == "mixed" and "up_proj" in name):
                dense[name] = rnd(*p.shape)  # mixed: up_proj gets D A plus a dense (decay-like) term
    if kind == "untied_head":
        lowrank["lm_head"] = (rnd(128, 3), rnd(3, 32))
        lowrank["model.layers.1.self_attn.v_proj"] = (rnd(16, 3), rnd(3, 32))
    return lowrank, dense


@contextmanager
def shifted(model, lowrank, dense, s):
    """Parameters at θ + sΔ inside the block, exactly θ again after it."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, (D, A) in lowrank.items():
            model.get_submodule(name).weight.add_(D @ A, alpha=s)
        for name, delta in dense.items():
            model.get_parameter(name).add_(delta, alpha=s)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])


@pytest.mark.parametrize("kind", ["lowrank_qvd", "lowrank_all", "dense", "mixed"])
def test_hidden_tangent_equals_finite_difference(llama, kind):
    ids, mask, positions = batch()
    lowrank, dense = make_update(llama, kind)
    h, h_dot = hidden_and_tangent(llama, ids, mask, None, lowrank, dense, positions)
    s = 1e-6
    with shifted(llama, lowrank, dense, s):
        h_plus = hidden_states(llama, ids, mask, None, positions)
    with shifted(llama, lowrank, dense, -s):
        h_minus = hidden_states(llama, ids, mask, None, positions)
    assert h.shape == h_dot.shape == (int(positions.sum()), 32)
    torch.testing.assert_close(h, hidden_states(llama, ids, mask, None, positions))
    torch.testing.assert_close(h_dot, (h_plus - h_minus) / (2 * s), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["lowrank_all", "mixed", "untied_head"])
def test_predict_kl_equals_half_variance_of_full_logit_jvp(kind):
    """KL̂ against δz from torch.func.jvp of the whole model's logits with the dense ΔW formed."""
    model = tiny_llama(tied=kind != "untied_head")
    ids, mask, positions = batch()
    lowrank, dense = make_update(model, kind)
    names = {id(p): n for n, p in model.named_parameters()}
    tangent = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for name, (D, A) in lowrank.items():
        tangent[names[id(model.get_submodule(name).weight)]] += D @ A
    for name, delta in dense.items():
        tangent[names[id(model.get_parameter(name))]] += delta
    params = {n: p.detach() for n, p in model.named_parameters()}
    logits = lambda ps: torch.func.functional_call(model, ps, kwargs=dict(input_ids=ids, attention_mask=mask)).logits
    with sdpa_kernel(SDPBackend.MATH):
        z, dz = torch.func.jvp(logits, (params,), (tangent,))
    p = torch.softmax(z[positions], -1)
    expected = 0.5 * ((p * dz[positions] ** 2).sum(-1) - (p * dz[positions]).sum(-1) ** 2).mean()
    got = predict_kl(model, ids, mask, None, lowrank, dense, positions, chunk=3)
    assert abs(got / expected.item() - 1) < 1e-10


@pytest.mark.parametrize("kind", ["lowrank_all", "dense"])
def test_realized_over_predicted_kl_tends_to_one(llama, kind):
    ids, mask, positions = batch()
    lowrank, dense = make_update(llama, kind, scale=0.3)
    predicted = predict_kl(llama, ids, mask, None, lowrank, dense, positions)
    W = llama.get_output_embeddings().weight
    h_old, W_old = hidden_states(llama, ids, mask, None, positions), W.detach().clone()
    errors = []
    for s in [0.3, 0.03, 1e-3]:
        with shifted(llama, lowrank, dense, s):
            realized = exact_kl(h_old, W_old, hidden_states(llama, ids, mask, None, positions), W.detach()).mean()
        errors.append(abs(realized.item() / (s**2 * predicted) - 1))
    assert errors[-1] < 0.05 and errors[-1] <= errors[0], errors


def test_exact_kl_equals_log_softmax_difference():
    h_old, W_old, (h_new,), (W_new,) = random_factors(T=6, d=8, V=40, ks=(8,), seed=5, dtype=torch.float64)
    lp_old, lp_new = torch.log_softmax(h_old @ W_old.t(), -1), torch.log_softmax(h_new @ W_new.t(), -1)
    expected = (lp_old.exp() * (lp_old - lp_new)).sum(-1)
    torch.testing.assert_close(exact_kl(h_old, W_old, h_new, W_new, chunk=4), expected)



def _kl_reference(h_old, W_old, h_new, W_new, softcap=None):
    cap = (lambda z: softcap * torch.tanh(z / softcap)) if softcap else (lambda z: z)
    lp_old, lp_new = torch.log_softmax(cap(h_old @ W_old.t()), -1), torch.log_softmax(cap(h_new @ W_new.t()), -1)
    return (lp_old.exp() * (lp_old - lp_new)).sum(-1)


@pytest.mark.parametrize("block,chunk", [(7, 1), (32, 4), (100, 3), (1000, 64)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_streamed_kl_over_vocabulary_blocks_equals_log_softmax_difference(block, chunk, softcap):
    """Blocks that do not divide V, several token chunks, the largest logit in the last block (the running
    maximum rescales the sums), Gemma-2's cap, dense and low-rank pieces of ΔW at a trial scale."""
    from logra_core.kl_predictor import streamed_kl

    gen = torch.Generator().manual_seed(3)
    T, d, V, r, at = 13, 8, 100, 2, 0.3
    W = torch.randn(V, d, generator=gen, dtype=torch.float64)
    W[-5:] *= 4  # the tail of the vocabulary holds the largest logits
    h_old = torch.randn(T, d, generator=gen, dtype=torch.float64)
    h_new = h_old + 0.1 * torch.randn(T, d, generator=gen, dtype=torch.float64)
    dW = 0.2 * torch.randn(V, d, generator=gen, dtype=torch.float64)
    D, A = torch.randn(V, r, generator=gen, dtype=torch.float64), 0.1 * torch.randn(r, d, generator=gen, dtype=torch.float64)
    expected = _kl_reference(h_old, W, h_new, W + at * (dW + D @ A), softcap)
    got = streamed_kl(h_old, W, h_new, W, chunk, softcap, [dW, (D, A)], at, block=block)
    torch.testing.assert_close(got, expected)
    W_old = W + 0.05 * torch.randn(V, d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(streamed_kl(h_old, W_old, h_new, W, chunk, softcap, block=block),
                               _kl_reference(h_old, W_old, h_new, W, softcap))


def test_streamed_kl_keeps_a_tiny_steps_relative_precision_in_fp32():
    """A step that moves logits by ~4e-5: the fp32 pass (many blocks) reads its KL (~5e-10 per token) to 2 %
    of the fp64 value (fp32's rounding of expm1(δ) − δ ≈ δ²/2; 1.1 % measured, 4.2 % for the token-chunked form
    this replaced), where a difference of fp32 log-softmaxes is off by more than the KL itself."""
    from logra_core.kl_predictor import streamed_kl

    gen = torch.Generator().manual_seed(4)
    W = torch.randn(3000, 16, generator=gen, dtype=torch.float64)
    h = torch.randn(10, 16, generator=gen, dtype=torch.float64)
    dW = 1e-5 * torch.randn(3000, 16, generator=gen, dtype=torch.float64)
    expected = streamed_kl(h, W, h, W, 64, None, [dW], 1.0, block=3000)
    assert 1e-11 < float(expected.mean()) < 1e-8
    torch.testing.assert_close(_kl_reference(h, W, h, W + dW), expected, rtol=1e-4, atol=0)  # fp64: the same KL (the reference cancels to ~1e-15)
    got = streamed_kl(h.float(), W.float(), h.float(), W.float(), 64, None, [(dW.float(), torch.eye(16))], 1.0, block=128)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=0)
    naive = _kl_reference(h.float(), W.float(), h.float(), (W + dW).float()).double()
    assert float(((naive - expected).abs() / expected).max()) > 1  # what the streamed form avoids


# ---- the fused Triton kernel -----------------------------------------------------------------
INTERPRETER_CHECK = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    from logra_core.kl_predictor import kl_terms_reference
    from logra_core.kl_triton import kl_terms_triton
    gen = torch.Generator().manual_seed(0)
    T, d, V = 8, 16, 100
    h, W = torch.randn(T, d, generator=gen), torch.randn(V, d, generator=gen) / 4
    g = [torch.randn(T, k, generator=gen) for k in (24, 5, 3)]
    U = [torch.randn(V, k, generator=gen) for k in (24, 5, 3)]
    U[0] += 10.0  # a large common offset in δz: the centred online merge must keep precision
    for pairs, block_v in [(1, 32), (2, 64), (3, 128)]:  # V = 100: partial last tiles; 3 pairs merge to 2
        out = kl_terms_triton(h, W, g[:pairs], U[:pairs], block_t=16, block_v=block_v)
        ref = kl_terms_reference(h, W, g[:pairs], U[:pairs], chunk=3)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=0)
    Ut = torch.randn(24, V, generator=gen).t()  # strided (non-contiguous) weight side
    torch.testing.assert_close(kl_terms_triton(h, W.t().contiguous().t(), [g[0]], [Ut], block_t=16, block_v=32),
                               kl_terms_reference(h, W, g[0], Ut), rtol=1e-4, atol=0)
    print("ok")
""")


@pytest.mark.integration
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (optional: pip install triton)")
def test_triton_kernel_matches_reference_under_interpreter():
    run = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (optional: pip install triton)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_cuda(dtype):
    h, W, g, U = random_factors(T=300, d=96, V=5000, ks=(96, 8), seed=0)
    h, W = h.cuda().to(dtype), W.cuda().to(dtype)
    g, U = [x.cuda().to(dtype) for x in g], [x.cuda().to(dtype) for x in U]
    out = kl_terms(h, W, g, U)  # dispatches to the kernel
    ref = kl_terms_reference(h.float(), W.float(), [x.float() for x in g], [x.float() for x in U], chunk=64)
    torch.testing.assert_close(out, ref, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-6)


# ---- the sampled probe: its stated standard error ----------------------------------------------
def test_sampled_mean_standard_error_equals_the_exact_sampling_variance():
    """Rows of equal length: the estimator is the mean of the drawn rows' means, whose variance over all
    C(N, n) draws is (1 − n/N) s²/n exactly (s²: the rows' variance); E[se²] over the draws equals it."""
    from itertools import combinations

    from logra_core.kl_predictor import sampled_mean

    N, n, L = 6, 3, 4
    terms_by_row = torch.rand(N, L, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    estimates, se2 = [], []
    for rows in combinations(range(N), n):
        t = terms_by_row[list(rows)].reshape(-1)
        r = torch.arange(n).repeat_interleave(L)
        mean, se = sampled_mean(t, r, N)
        assert abs(mean - float(t.mean())) < 1e-12
        estimates.append(mean)
        se2.append(se**2)
    exact_var = (1 - n / N) * float(terms_by_row.mean(1).var()) / n
    assert abs(float(torch.tensor(estimates, dtype=torch.float64).var(unbiased=False)) / exact_var - 1) < 1e-9
    assert abs(sum(se2) / len(se2) / exact_var - 1) < 1e-9
    full, se_full = sampled_mean(terms_by_row.reshape(-1), torch.arange(N).repeat_interleave(L), N)
    assert se_full == 0.0 and abs(full - float(terms_by_row.mean())) < 1e-12
    assert sampled_mean(terms_by_row[0], torch.zeros(L, dtype=torch.long), N)[1] != sampled_mean(terms_by_row[0], torch.zeros(L, dtype=torch.long), N)[1]  # NaN


@pytest.mark.parametrize("weighted", [False, True])
def test_sampled_probe_error_within_its_stated_standard_error(weighted):
    """The cheaper path on a tiny Llama: probes of 4 of 12 rows predict the whole batch's KL̂ within the
    error they state (RMS error / RMS stated se near 1, most draws within 2 se); the whole batch is exact.
    ``weighted``: the ratio estimator with row weights unrelated to the KL (the worst case for it)."""
    from logra_core.kl_predictor import predict_kl_sampled

    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (12, 10), generator=gen)
    mask = torch.ones_like(ids)
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[:, 4:] = True
    w = torch.rand(12, generator=gen, dtype=torch.float64) + 0.5
    sizes = lambda rows: dict(row_weights=w[rows], weight_mean=float(w.mean())) if weighted else {}  # 6 tokens a row
    lowrank, dense = make_update(model, "mixed", scale=0.1)
    full, se_full = predict_kl_sampled(model, ids, mask, None, lowrank, dense, positions, population=12,
                                       **sizes(torch.arange(12)))
    assert se_full == 0.0 and abs(full / predict_kl(model, ids, mask, None, lowrank, dense, positions) - 1) < 1e-12
    errors, ses = [], []
    for d in range(24):
        rows = torch.randperm(12, generator=torch.Generator().manual_seed(d))[:4]
        got, se = predict_kl_sampled(model, ids[rows], mask[rows], None, lowrank, dense, positions[rows],
                                     population=12, **sizes(rows))
        errors.append(got - full)
        ses.append(se)
    errors, ses = torch.tensor(errors), torch.tensor(ses)
    assert (ses > 0).all()
    ratio = float(errors.square().mean().sqrt() / ses.square().mean().sqrt())
    assert 0.5 < ratio < 2.0, ratio
    assert float((errors.abs() <= 2 * ses).float().mean()) >= 0.7, (errors / ses).tolist()


def test_weighted_ratio_estimator_states_its_error_and_beats_tokens_when_the_size_tracks_the_kl():
    """sampled_mean with row weights w: the ratio estimator Σ S / Σ w·n, scaled by the batch's token mean
    of w. Constant weights are the token estimator; the whole batch is exact whatever the weights; over
    every C(N, n) probe of a batch whose row KL tracks w·n (plus noise), its RMS error is below the token
    estimator's and its stated se matches that RMS error (ratio estimators: to first order)."""
    from itertools import combinations

    from logra_core.kl_predictor import sampled_mean

    gen = torch.Generator().manual_seed(1)
    N, n = 12, 6
    lengths = torch.randint(5, 20, (N,), generator=gen)
    w = torch.rand(N, generator=gen, dtype=torch.float64) * 2 + 0.1
    per_token = [w[i] * (1 + 0.2 * torch.randn(int(lengths[i]), generator=gen, dtype=torch.float64)) * 1e-3
                 for i in range(N)]
    w_mean = float((w * lengths).sum() / lengths.sum())
    truth = float(torch.cat(per_token).mean())
    full, se = sampled_mean(torch.cat(per_token), torch.arange(N).repeat_interleave(lengths), N, w, w_mean)
    assert se == 0.0 and abs(full / truth - 1) < 1e-12
    err_tok, err_w, se_w = [], [], []
    for rows in combinations(range(N), n):
        t = torch.cat([per_token[i] for i in rows])
        r = torch.arange(n).repeat_interleave(lengths[list(rows)])
        tok, tok_se = sampled_mean(t, r, N)
        same, same_se = sampled_mean(t, r, N, torch.full((n,), 3.0, dtype=torch.float64), 3.0)
        assert abs(same - tok) < 1e-15 and abs(same_se - tok_se) < 1e-15
        est, s = sampled_mean(t, r, N, w[list(rows)], w_mean)
        err_tok.append(tok - truth)
        err_w.append(est - truth)
        se_w.append(s)
    rms = lambda xs: float(torch.tensor(xs).square().mean().sqrt())
    assert rms(err_w) < 0.5 * rms(err_tok), (rms(err_w), rms(err_tok))
    assert 0.6 < rms(se_w) / rms(err_w) < 1.6, (rms(se_w), rms(err_w))
    with pytest.raises(ValueError, match="sum to zero"):
        sampled_mean(torch.cat(per_token[:2]), torch.arange(2).repeat_interleave(lengths[:2]), N,
                     torch.zeros(2, dtype=torch.float64), 1.0)

