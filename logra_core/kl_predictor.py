"""Predicted KL of an update before it is applied (docs/design.md §3.2).

For probe tokens t with logits z_t = h_t Wᵀ (h: T × d, head W: V × d), p_t = softmax(z_t), and the
directional derivative of the logits along the update Δ, δz_t = J_t Δ, the second-order expansion
of KL(π_old ‖ π_new) for θ ← θ + s·Δ is

    KL̂(s) = s² · ½ · mean_t ( Σ_v p_tv δz_tv² − (Σ_v p_tv δz_tv)² ) = s² · ½ Δᵀ F Δ,

with F the Fisher matrix of the policy on the probe tokens; the per-token term is ½ Var_{p_t}(δz_t).

δz comes from forward-mode AD along one scalar step ε (primal 0, tangent 1) through the decoder
(:func:`hidden_and_tangent`), then through the head: with tangent ḣ of the last hidden state,

    δz = ḣ Wᵀ + h ΔWᵀ = Σ_i g_i U_iᵀ,   (g, U) = ((ḣ, h Aᵀ), (W, D)) for ΔW = D A, ((ḣ, h), (W, ΔW))
                                        for a dense ΔW, ((ḣ,), (W,)) for an unchanged head.

Final-logit softcapping (Gemma-2), z = c·tanh(u/c) with u = h Wᵀ: p = softmax(z) and, by the chain
rule, δz = (1 − tanh²(u/c))·δu = (1 − (z/c)²)·δu for the δu above (``softcap`` = c; the realized
KL :func:`exact_kl` caps both logits the same way).

The vocabulary sums (:func:`kl_terms`) never form a T × V tensor: a chunked torch reference (chunk
× V at a time) and, on CUDA, a fused Triton kernel (:mod:`logra_core.kl_triton`).

An update is ``lowrank[module] = (D, A)`` (ΔW = D A for an ``nn.Linear`` or ``nn.Embedding`` weight)
plus ``dense[param] = Δ`` (:class:`logra_core.update.Update`). Weights are matched by identity: a
lowrank and a dense entry on one weight add up (a sketched weight and its weight decay), and a head
tied to the input embedding moves with the embedding's entry, under either module's name.
"""

from __future__ import annotations

import importlib
from contextlib import ExitStack
from typing import Optional, Sequence, Union

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

Factors = Union[torch.Tensor, Sequence[torch.Tensor]]
LowRank = dict[str, tuple[torch.Tensor, torch.Tensor]]
_TRITON = []  # [kl_terms_triton or None], filled on first use


def _pairs(g: Factors, U: Factors) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g, U = ((g,), (U,)) if isinstance(g, torch.Tensor) else (tuple(g), tuple(U))
    if len(g) != len(U) or not g:
        raise ValueError(f"g and U must be paired factor lists of equal length, got {len(g)} and {len(U)}")
    return list(zip(g, U))


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when an input is fp64 (so a float64 model predicts tiny steps exactly)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _capped(u: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """c·tanh(u/c) (in place) when ``softcap`` = c is set, else u."""
    return torch.tanh(u.div_(softcap)).mul_(softcap) if softcap else u


def kl_terms_reference(h: torch.Tensor, W: torch.Tensor, g: Factors, U: Factors, chunk: int = 256,
                       softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token ½ Var_p(δz) = ½(Σ_v p_v δz_v² − (Σ_v p_v δz_v)²) [T], ``chunk`` tokens at a time.

    z = h Wᵀ, δz = Σ_i g_i U_iᵀ; h: T × d, W: V × d, g_i: T × k_i, U_i: V × k_i (g, U: one tensor
    each, or equal-length sequences). Peak extra memory is a few chunk × V blocks.
    Computed as ½ Σ_v p_v (δz_v − Σ_u p_u δz_u)², which cannot cancel to a negative value.
    With ``softcap`` = c: z = c·tanh(h Wᵀ/c) and δz = (1 − (z/c)²)·Σ_i g_i U_iᵀ.
    """
    pairs = _pairs(g, U)
    acc = _acc_dtype(h, W, *(t for pair in pairs for t in pair))
    out = torch.empty(h.shape[0], dtype=acc, device=h.device)
    for i in range(0, h.shape[0], chunk):
        z = _capped((h[i : i + chunk].to(W.dtype) @ W.t()).to(acc), softcap)
        dz = None
        for gi, Ui in pairs:  # accumulated in place: one chunk × V block besides p
            gi = gi[i : i + chunk].to(Ui.dtype)
            if dz is None:
                dz = (gi @ Ui.t()).to(acc)
            elif Ui.dtype == acc:
                dz.addmm_(gi, Ui.t())
            else:
                dz += (gi @ Ui.t()).to(acc)
        if softcap:
            dz.mul_((z / softcap).square_().neg_().add_(1))
        p = torch.softmax(z, dim=-1)
        del z
        dz -= _rowdot(p, dz).unsqueeze(-1)
        out[i : i + chunk] = 0.5 * _rowdot(p, dz.square_())
    return out


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a_tv b_tv per row, as a batched matrix product: no temporary of a's size."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _triton_kernel():
    if not _TRITON:
        try:
            from logra_core.kl_triton import kl_terms_triton
        except ImportError:  # triton is optional
            kl_terms_triton = None
        _TRITON.append(kl_terms_triton)
    return _TRITON[0]


def kl_terms(h: torch.Tensor, W: torch.Tensor, g: Factors, U: Factors, chunk: int = 256,
             softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token ½ Var_p(δz) [T] (fp32; fp64 for fp64 inputs); see :func:`kl_terms_reference`.

    On CUDA with triton importable and no fp64 input, runs the fused kernel (online softmax over
    vocabulary tiles); elsewhere, and for softcapped logits, the chunked torch reference. The two
    agree to 1e-4 relative.
    """
    pairs = _pairs(g, U)
    tensors = [h, W] + [t for pair in pairs for t in pair]
    if not softcap and h.is_cuda and _acc_dtype(*tensors) == torch.float32 and _triton_kernel() is not None:
        return _triton_kernel()(h, W, [gi for gi, _ in pairs], [Ui for _, Ui in pairs])
    return kl_terms_reference(h, W, g, U, chunk, softcap)


def head_tangent_factors(h: torch.Tensor, h_dot: torch.Tensor, W: torch.Tensor, delta=None
                         ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(g, U) with δz = ḣ Wᵀ + h ΔWᵀ = Σ_i g_i U_iᵀ, never forming ΔW or a concatenated head.

    h, ḣ: T × d; W: V × d. ``delta``: None (head unchanged), a dense ΔW (V × d), a low-rank
    ``(D, A)`` with ΔW = D A (D: V × r, A: r × d), or a list of those (their ΔW add up).
    """
    items = [] if delta is None else list(delta) if isinstance(delta, list) else [delta]
    g, U = [h_dot], [W]
    for item in items:
        if isinstance(item, torch.Tensor):  # dense: h ΔWᵀ
            g.append(h)
            U.append(item)
        else:  # low rank: (h Aᵀ) Dᵀ
            D, A = item
            g.append(h.to(A.dtype) @ A.t())
            U.append(D)
    return tuple(g), tuple(U)


def _decoder(model: nn.Module) -> nn.Module:
    """The transformer without its head (``model.model`` for HF causal LMs): returns last_hidden_state."""
    get = getattr(model, "get_decoder", None)
    return get() if callable(get) else model.base_model


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None, positions=None) -> torch.Tensor:
    """Last hidden states h[positions] (T × d; all B·L positions when ``positions`` is None), no grad; a
    row-sharded model runs without gathering it whole (:func:`logra_core.layerwise.sharded_forward`)."""
    from logra_core.layerwise import sharded_forward  # layerwise imports this module

    decoder = _decoder(model)
    with torch.no_grad(), sharded_forward(decoder):
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
    return out.reshape(-1, out.shape[-1]) if positions is None else out[positions]


def owners_by_weight(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(weight) → the model's nn.Linear/nn.Embedding modules holding it, by one scan of the modules
    (a scan per looked-up weight cost SmolLM2's 210 sketched linears 0.09 s per probe)."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            owners.setdefault(id(m.weight), []).append(m)
    return owners


def _lowrank_hook(D: torch.Tensor, A: torch.Tensor):
    """Adds (x Aᵀ) Dᵀ (D[ids] A for an embedding) to the tangent of the module's output.

    The output's tangent along ε is ẋ Wᵀ (from the input's tangent, if any) plus x ΔWᵀ; the second
    term uses the primal of x only (ε·(x + ε ẋ) ΔWᵀ = ε x ΔWᵀ + O(ε²)).
    """
    def hook(module, args, out):
        x = args[0]
        if isinstance(module, nn.Embedding):
            delta = D[x].to(A.dtype) @ A
        else:
            x = fwAD.unpack_dual(x).primal
            delta = (x.to(A.dtype) @ A.t()) @ D.to(A.dtype).t()
        primal, tangent = fwAD.unpack_dual(out)
        delta = delta.to(primal.dtype)
        return fwAD.make_dual(primal, delta if tangent is None else tangent + delta)
    return hook


def _linear_jvp(module: nn.Linear, lowrank_factors: list[tuple[torch.Tensor, torch.Tensor]]):
    """A forward for ``module`` that returns y = x Wᵀ + b with tangent ẏ = ẋ Wᵀ + x Ẇᵀ + ḃ + Σ (x Aᵀ)Dᵀ.

    Written out instead of left to forward AD, whose rule for a linear materializes zero tangents
    for the weight and bias (a zero tensor and an add per layer); the low-rank terms of the update
    join the same sum instead of going through a hook.
    """
    def forward(x):
        xp, xt = fwAD.unpack_dual(x)
        wp, wt = fwAD.unpack_dual(module.weight)
        bp, bt = fwAD.unpack_dual(module.bias) if module.bias is not None else (None, None)
        y = nn.functional.linear(xp, wp, bp)
        terms = [] if xt is None else [nn.functional.linear(xt, wp)]
        if wt is not None:
            terms.append(nn.functional.linear(xp, wt))
        if bt is not None:
            terms.append(bt.expand_as(y))
        for D, A in lowrank_factors:
            terms.append(((xp.to(A.dtype) @ A.t()) @ D.to(A.dtype).t()).to(y.dtype))
        return y if not terms else fwAD.make_dual(y, sum(terms[1:], terms[0]))
    return forward


def hidden_and_tangent(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                       position_ids: Optional[torch.Tensor] = None, lowrank: Optional[LowRank] = None,
                       dense: Optional[dict[str, torch.Tensor]] = None, positions=None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, ḣ) of the last hidden state at ``positions`` (T × d each), ḣ = d h(θ + εΔ)/dε at ε = 0.

    Forward-mode AD along one scalar step ε (tangents are d/dε at ε = 0), through the decoder only
    (the head is :func:`head_tangent_factors`' job):

    * ``lowrank[name] = (D, A)``: a forward hook on every ``nn.Linear`` / ``nn.Embedding`` holding
      that weight adds (x Aᵀ)Dᵀ (D[ids] A) to its output's tangent: no tensor of the weight's size
      is formed.
    * ``dense[name] = Δ``: the parameter enters ``torch.func.functional_call`` as the dual p + εΔ,
      built by ``make_dual(p, Δ)`` — a view of p whose tangent is Δ itself, so nothing is copied
      (Δ is cast to p's dtype first if they differ, then that cast copy is the cost).

    Beyond Δ, the memory is one tangent per activation of a no-grad forward (about 2× its peak).
    Attention runs with the MATH SDPA backend: the CPU flash kernel has no forward AD.
    """
    lowrank, dense = lowrank or {}, dense or {}
    decoder = _decoder(model)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = out_emb.weight if out_emb is not None else None
    names_in_decoder = {id(p): n for n, p in decoder.named_parameters()}
    owners_of, seen = owners_by_weight(decoder), set()
    with ExitStack() as stack, torch.no_grad(), fwAD.dual_level():
        factors: dict[int, list] = {}  # module id -> low-rank factors of its weight
        for name, (D, A) in lowrank.items():
            weight = model.get_submodule(name).weight
            if id(weight) in seen:
                raise ValueError(f"lowrank names the weight of {name!r} twice (a tied head and its embedding?)")
            seen.add(id(weight))
            owners = owners_of.get(id(weight), [])
            if not owners and weight is not head:
                raise ValueError(f"lowrank[{name!r}]: its weight is used by no nn.Linear/nn.Embedding of the model")
            for module in owners:
                factors.setdefault(id(module), []).append((D, A))
        for module in decoder.modules():
            pairs = factors.get(id(module), [])
            if isinstance(module, nn.Linear) and "forward" not in vars(module):
                module.forward = _linear_jvp(module, pairs)
                stack.callback(vars(module).pop, "forward")
            else:  # an embedding, or a linear whose forward someone else already replaced
                for D, A in pairs:
                    stack.callback(module.register_forward_hook(_lowrank_hook(D, A)).remove)
        params = {}
        for name, delta in dense.items():
            p = model.get_parameter(name)
            if id(p) in names_in_decoder:
                params[names_in_decoder[id(p)]] = fwAD.make_dual(p.detach(), delta.to(p.dtype))
            elif p is not head:
                raise ValueError(f"dense[{name!r}]: a parameter neither of the decoder nor of the LM head")
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        out = torch.func.functional_call(
            decoder, params, args=(),
            kwargs=dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False)).last_hidden_state
        primal, tangent = fwAD.unpack_dual(out)
        tangent = torch.zeros_like(primal) if tangent is None else tangent
    flat = (lambda x: x.reshape(-1, x.shape[-1])) if positions is None else (lambda x: x[positions])
    return flat(primal), flat(tangent)


def head_delta(model: nn.Module, lowrank: Optional[LowRank] = None, dense: Optional[dict] = None) -> list:
    """The update's pieces of the LM head weight (found by identity, so a tied embedding's count)."""
    W = model.get_output_embeddings().weight
    found = [(D, A) for n, (D, A) in (lowrank or {}).items() if model.get_submodule(n).weight is W]
    return found + [d for n, d in (dense or {}).items() if model.get_parameter(n) is W]


def predict_kl_terms(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, lowrank: Optional[LowRank] = None,
                     dense: Optional[dict[str, torch.Tensor]] = None, positions=None, chunk: int = 256,
                     temperature: float = 1.0) -> torch.Tensor:
    """The per-token terms ½ Var_{p_t}(δz_t) [T] of :func:`predict_kl`, in the order of ``positions``
    (row-major: all of row 0's positions first); at ``temperature`` T the logits are z/T (h/T, ḣ/T)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("predict_kl assumes an LM head without bias")
    h, h_dot = hidden_and_tangent(model, input_ids, attention_mask, position_ids, lowrank, dense, positions)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if temperature != 1.0:
        if softcap:  # softmax(c·tanh(z/c) / T) is not a function of h / T
            raise ValueError("predict_kl: a sampling temperature != 1 with final-logit softcapping is not supported")
        h, h_dot = h / temperature, h_dot / temperature
    g, U = head_tangent_factors(h, h_dot, head.weight.detach(), head_delta(model, lowrank, dense))
    return kl_terms(h, head.weight.detach(), g, U, chunk, softcap)


def predict_kl(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               position_ids: Optional[torch.Tensor] = None, lowrank: Optional[LowRank] = None,
               dense: Optional[dict[str, torch.Tensor]] = None, positions=None, chunk: int = 256,
               temperature: float = 1.0) -> float:
    """KL̂(1) = ½ mean_t Var_{p_t}(δz_t) on the tokens predicted at ``positions``, for θ ← θ + Δ.

    The head is ``model.get_output_embeddings()`` with logits h Wᵀ (no bias, no logit scaling),
    capped to c·tanh(h Wᵀ/c) where the model's config sets ``final_logit_softcapping`` = c.
    With a sampling temperature T the policy is softmax(z / T): z and δz are linear in (h, ḣ), so
    both are divided by T through h and ḣ.
    For a step s·Δ the prediction is s²·KL̂(1). The model runs as it is: eval mode (no dropout) for a
    deterministic prediction.
    """
    return predict_kl_terms(model, input_ids, attention_mask, position_ids, lowrank, dense, positions, chunk,
                            temperature).mean().item()


def sampled_mean(terms: torch.Tensor, rows: torch.Tensor, population: int,
                 row_weights: Optional[torch.Tensor] = None, weight_mean: float = 1.0) -> tuple[float, float]:
    """The batch's mean token KL from the probe's per-token terms, and its standard error.

    The probe holds n of the batch's ``population`` sequences, drawn at random without replacement;
    ``rows[t]`` is token t's probe row. With S_i the sum of row i's terms and x_i an auxiliary size
    known for every row of the batch, the estimate is the ratio estimator

        mean = (Σ_i S_i / Σ_i x_i) · X / N_tok

    (X: the batch's Σ x, N_tok: its token count). x_i = n_i (row i's token count, the default) gives
    the probe's token mean. ``row_weights`` = w (one per probe row) gives x_i = w_i n_i, with
    ``weight_mean`` = X / N_tok the batch's token mean of w: a size that tracks S_i cuts the sampling
    error (docs/speed.md: w = |advantage|). Its standard error as an estimate of the same mean over
    every sequence of the batch (Cochran, *Sampling Techniques*, 1977, §6.4: ratio estimator, finite
    population) is

        se = √((1 − n/N) / n) · sd_i(S_i − R̂·x_i) / mean_i(x_i) · X / N_tok,   R̂ = Σ S_i / Σ x_i.

    Rows, not tokens, are the sampled units (the tokens of one sequence are correlated). n = N gives
    se = 0 (the whole batch is probed: the weights cancel); n = 1 gives NaN (one row says nothing
    about the spread).
    """
    terms = terms.double()
    n = int(rows.max()) + 1 if rows.numel() else 0
    if n == 0:
        return 0.0, 0.0
    S = torch.zeros(n, dtype=torch.float64, device=terms.device).index_add_(0, rows, terms)
    x = torch.bincount(rows, minlength=n).to(torch.float64)
    if n >= population:
        return float(S.sum() / x.sum()), 0.0
    if row_weights is not None:
        x = x * row_weights.to(device=x.device, dtype=torch.float64)
        if not float(x.sum()) > 0:
            raise ValueError("sampled_mean: the probe rows' weights sum to zero")
    ratio = float(S.sum() / x.sum())
    mean = ratio * weight_mean
    if n < 2:
        return mean, float("nan")
    resid = S - ratio * x
    se = ((1 - n / population) / n) ** 0.5 * float(resid.std()) / float(x.mean()) * weight_mean
    return mean, se


# The per-token terms of KL̂(1), by predictor: "exact" (the second-order term, a forward-mode tangent:
# this module) or "secant" (the KL measured at a trial scale ε, divided by ε²: logra_core/kl_secant.py).
PREDICTORS = {"exact": "logra_core.kl_predictor:predict_kl_terms", "secant": "logra_core.kl_secant:trial_kl_terms"}


def predictor_terms(name: str):
    """The per-token terms function registered as ``name`` in :data:`PREDICTORS`."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown KL predictor {name!r}; known: {sorted(PREDICTORS)}")
    module, attr = PREDICTORS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def predict_kl_sampled(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                       position_ids: Optional[torch.Tensor] = None, lowrank: Optional[LowRank] = None,
                       dense: Optional[dict[str, torch.Tensor]] = None, positions=None, chunk: int = 256,
                       population: Optional[int] = None, temperature: float = 1.0, predictor: str = "exact",
                       at: float = 1.0, h_old: Optional[torch.Tensor] = None,
                       row_weights: Optional[torch.Tensor] = None, weight_mean: float = 1.0,
                       share_context: bool = True) -> tuple[float, float]:
    """(KL̂(1), its standard error) for a probe of ``input_ids.shape[0]`` sequences drawn from a batch
    of ``population`` (default: the probe is the batch, se = 0); see :func:`sampled_mean`.

    ``predictor``: "exact" (:func:`predict_kl`'s second-order term) or "secant" (the KL measured at the
    trial scale ``at``, divided by at²: :func:`logra_core.kl_secant.trial_kl_terms`, which takes the
    probe's hidden states at θ as ``h_old`` when the caller has them, and with ``share_context`` runs the
    probe's shared context once: :mod:`logra_core.shared_context`). Reading the probe's value as the
    batch's KL carries a sampling error, stated by se; ``row_weights`` /
    ``weight_mean`` choose the ratio estimator's size variable (:func:`sampled_mean`). ``positions`` is
    required (the response tokens).
    """
    if positions is None:
        raise ValueError("predict_kl_sampled needs positions (the probe's response tokens)")
    extra = {} if predictor == "exact" else {"at": at, "h_old": h_old, "share_context": share_context}
    terms = predictor_terms(predictor)(model, input_ids, attention_mask, position_ids, lowrank, dense, positions,
                                       chunk, temperature, **extra)
    rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1).expand_as(positions)[positions]
    return sampled_mean(terms, rows.to(terms.device), population or positions.shape[0], row_weights, weight_mean)


VOCAB_BLOCK = 1024  # head rows per block of streamed_kl's vocabulary pass: the block stays in cache while every token of a chunk reads it


def streamed_kl(h_old: torch.Tensor, W_old: torch.Tensor, h_new: torch.Tensor, W_new: torch.Tensor,
                chunk: int = 256, softcap: Optional[float] = None, pieces: Sequence = (), at: float = 1.0,
                block: int = VOCAB_BLOCK) -> torch.Tensor:
    """Per-token KL(p_old ‖ p_new) [T] for z_old = h_old W_oldᵀ and z_new = h_new (W_new + at·ΔW)ᵀ, ΔW the
    sum of ``pieces`` (dense V × d tensors or low-rank (D, A); none: z_new = h_new W_newᵀ), in one pass
    over the vocabulary in blocks of ``block`` rows.

    KL = log Σ_v p_v e^{δ_v} − μ with δ = z_new − z_old, μ = Σ_v p_v δ_v, p = softmax(z_old). With
    B = Σ_v p_v expm1(δ_v) and β = B − μ = Σ_v p_v (expm1(δ_v) − δ_v) (a sum of terms ≥ 0):

        KL = log1p(B) − μ = β − (B − log1p(B)),

    no first-order terms left to cancel, so a tiny step's KL (≈ ½ Var(δ)) keeps its relative precision,
    which the difference of log-softmaxes loses. p's normalisation and the two sums are accumulated
    block by block with a running maximum (the online softmax, :func:`kl_stats`); the last combination
    is in fp64 (:func:`kl_from_stats`). A vocabulary split over ranks (a row-sharded head) computes
    :func:`kl_stats` on each rank's rows and merges them (:func:`merge_kl_stats`).
    ``softcap`` = c: both logits capped, z = c·tanh(u/c) (Gemma-2's final logits).

    Time and memory: each block of the head is read once per token chunk and stays in cache while the
    chunk's tokens read it (SmolLM2's fp32 head, 640 tokens on 2 CPU cores: 186 GFLOP/s against 97 for
    64 tokens × the whole vocabulary; docs/speed.md); a chunk holds ⌊chunk·V / block⌋ tokens, so the
    temporaries keep chunk × V elements, as a chunk of ``chunk`` tokens × the vocabulary would.

    Dense pieces with W_new in fp32/fp64 are added to each block of W_new (one product for z_new); in bf16
    (where W + at·ΔW would round a small ΔW away) and for low-rank pieces ((h Aᵀ)·at Dᵀ, r columns) they
    enter as products of their own.
    """
    return kl_from_stats(*kl_stats(h_old, W_old, h_new, W_new, chunk, softcap, pieces, at, block))


def kl_stats(h_old: torch.Tensor, W_old: torch.Tensor, h_new: torch.Tensor, W_new: torch.Tensor,
             chunk: int = 256, softcap: Optional[float] = None, pieces: Sequence = (), at: float = 1.0,
             block: int = VOCAB_BLOCK) -> tuple[torch.Tensor, ...]:
    """The online-softmax sums of :func:`streamed_kl` over the vocabulary rows of ``W_old``/``W_new``
    (and of the pieces): per token (m, s, a, b) with m the running maximum of z_old and, relative to
    it, s = Σ_v e^{z_old,v − m}, a = Σ_v e^{z_old,v − m} δ_v, b = Σ_v e^{z_old,v − m} (expm1 δ_v − δ_v).
    A token over no rows has m = −∞ and zero sums."""
    acc = _acc_dtype(h_old, W_old, h_new, W_new)
    wide = W_new.dtype in (torch.float32, torch.float64)  # W + at·ΔW keeps a small ΔW only in a wide dtype
    merged = [p for p in pieces if wide and isinstance(p, torch.Tensor)]
    separate = [p for p in pieces if not (wide and isinstance(p, torch.Tensor))]
    V = W_new.shape[0]
    block = max(1, min(block, V))
    tokens = max(1, chunk * V // block)
    T = h_old.shape[0]
    m_all = torch.full((T,), -torch.inf, dtype=acc, device=h_old.device)
    s_all, a_all, b_all = torch.zeros_like(m_all), torch.zeros_like(m_all), torch.zeros_like(m_all)
    for i in range(0, T if V else 0, tokens):
        ho, hn = h_old[i : i + tokens].to(W_old.dtype), h_new[i : i + tokens].to(W_new.dtype)
        low = [(hn.to(p[1].dtype) @ p[1].t(), p[0]) for p in separate if not isinstance(p, torch.Tensor)]
        m = torch.full((ho.shape[0],), -torch.inf, dtype=acc, device=ho.device)
        s, a, b = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        for j in range(0, V, block):
            z_old = _capped((ho @ W_old[j : j + block].t()).to(acc), softcap)
            Wn = W_new[j : j + block]
            if merged:
                Wn = Wn.clone()
                for d in merged:
                    Wn.add_(d[j : j + block].to(Wn.dtype), alpha=at)
            u = (hn @ Wn.t()).to(acc)
            for d in separate:
                if isinstance(d, torch.Tensor):
                    u.add_((hn.to(d.dtype) @ d[j : j + block].t()).to(acc), alpha=at)
            for g, D in low:
                u.add_((g.to(D.dtype) @ D[j : j + block].t()).to(acc), alpha=at)
            delta = _capped(u, softcap).sub_(z_old)
            top = torch.maximum(m, z_old.amax(-1))
            rescale = torch.exp(m - top)
            e = z_old.sub_(top.unsqueeze(-1)).exp_()  # p · Σ_v e^{z_old,v − top}, unnormalised
            s = s.mul_(rescale).add_(e.sum(-1))
            a = a.mul_(rescale).add_(_rowdot(e, delta))
            b = b.mul_(rescale).add_(_rowdot(e, torch.expm1(delta).sub_(delta)))
            m = top
        m_all[i : i + tokens], s_all[i : i + tokens], a_all[i : i + tokens], b_all[i : i + tokens] = m, s, a, b
    return m_all, s_all, a_all, b_all


def merge_kl_stats(stats: Sequence[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The (m, s, a, b) of the union of disjoint vocabulary parts, from each part's :func:`kl_stats`:
    m = max_k m_k and each part's sums rescaled by e^{m_k − m} (a part with m_k = −∞ adds nothing)."""
    m = torch.stack([st[0] for st in stats]).amax(0)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = [m]
    for idx in (1, 2, 3):
        total = torch.zeros_like(m)
        for st in stats:
            w = torch.where(torch.isfinite(st[0]), torch.exp(st[0] - safe), torch.zeros_like(m))
            total += st[idx] * w
        out.append(total)
    return tuple(out)


def kl_from_stats(m: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token KL = β − (B − log1p B) from the sums of :func:`kl_stats` (μ = a/s, β = b/s, B = μ + β),
    in fp64, returned in the sums' dtype."""
    mu, beta = a.double() / s.double(), b.double() / s.double()
    B = mu + beta
    return (beta - (B - torch.log1p(B))).to(m.dtype)


def exact_kl(h_old: torch.Tensor, W_old: torch.Tensor, h_new: torch.Tensor, W_new: torch.Tensor,
             chunk: int = 256, softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token KL(p_old ‖ p_new) = Σ_v p_old,v (log p_old,v − log p_new,v) [T] for z_old = h_old W_oldᵀ,
    z_new = h_new W_newᵀ: :func:`streamed_kl` (one pass over the vocabulary, a tiny step's KL in
    relative precision). ``softcap`` = c: both logits capped, z = c·tanh(h Wᵀ/c) (Gemma-2's final logits).
    Row-sharded heads (DTensors, this rank's rows): vocabulary-parallel, a collective
    (:func:`logra_core.layerwise.vocab_parallel_kl`).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(W_new, DTensor):
        from logra_core.layerwise import head_group, vocab_parallel_kl

        old = W_old.to_local() if isinstance(W_old, DTensor) else W_old
        return vocab_parallel_kl(h_old, old, h_new, W_new.to_local(), chunk, softcap, group=head_group(W_new))
    return streamed_kl(h_old, W_old, h_new, W_new, chunk, softcap)
