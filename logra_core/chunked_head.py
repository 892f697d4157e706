"""Per-token log-probs through the LM head without a tokens × vocabulary tensor in memory.

For hidden states h (N × d), head weight W (V × d) and targets y (N):

    z = h Wᵀ,   log p(y) = z_y − logsumexp(z)

computed ``chunk`` tokens at a time. Forward keeps only logsumexp (N floats); backward recomputes
each chunk's logits and, with g = ∂L/∂log p(y) and p = softmax(z),

    ∂L/∂z = g · (onehot(y) − p),   ∂L/∂h = (∂L/∂z) W,   ∂L/∂W = (∂L/∂z)ᵀ h.

So the peak holds one chunk × V block instead of several N × V ones (logits, their softmax, and
their gradient).

Final-logit softcapping (Gemma-2: ``final_logit_softcapping`` = c) caps each chunk's logits,
z = c·tanh(u/c) with u = h Wᵀ, and the backward chains through it,
∂L/∂u = ∂L/∂z · (1 − tanh²(u/c)) = ∂L/∂z · (1 − (z/c)²), so a capped head never forms N × V either. When the head weight is sketched (:mod:`logra_core.sketch`, e.g. a tied
embedding under LoGRA), ∂L/∂W is never formed either: the sketch receives (∂L/∂z)ᵀ (h Aᵀ).
"""

from __future__ import annotations

import torch

from logra_core.sketch import SketchState


def capped_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """z = h Wᵀ in ``dtype``, then c·tanh(z/c) when ``softcap`` = c is set (Gemma-2's final logits)."""
    z = (hidden @ weight.t()).to(dtype)
    if softcap:
        z = torch.tanh(z.div_(softcap)).mul_(softcap)
    return z


class _ChunkedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, state: SketchState | None, softcap: float | None = None):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked = torch.empty_like(lse)
        for i in range(0, hidden.shape[0], chunk):
            z = capped_logits(hidden[i : i + chunk], weight, softcap)
            lse[i : i + chunk] = torch.logsumexp(z, dim=-1)
            picked[i : i + chunk] = z.gather(-1, targets[i : i + chunk, None]).squeeze(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.state, ctx.softcap = chunk, state, softcap
        return picked - lse

    @staticmethod
    def backward(ctx, grad_logprob):
        hidden, weight, targets, lse = ctx.saved_tensors
        state = ctx.state
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        want_w = ctx.needs_input_grad[1] and state is None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        basis = state.projection(weight.shape[1], weight.device) if state is not None else None
        for i in range(0, hidden.shape[0], ctx.chunk):
            h, g = hidden[i : i + ctx.chunk], grad_logprob[i : i + ctx.chunk].float()
            z = capped_logits(h, weight, ctx.softcap) if ctx.softcap else None  # kept for ∂z/∂u
            p = torch.exp((z if ctx.softcap else capped_logits(h, weight)) - lse[i : i + ctx.chunk, None])
            dz = p.mul_(-g[:, None])
            dz.scatter_add_(-1, targets[i : i + ctx.chunk, None], g[:, None])  # + g at the target
            if ctx.softcap:  # through the cap: ∂z/∂u = 1 − (z/c)²
                dz.mul_(z.div_(ctx.softcap).square_().neg_().add_(1))
            del z
            if grad_h is not None:
                grad_h[i : i + ctx.chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h.float())
            if state is not None:
                contribution = dz.t() @ (h.float() @ basis.t())  # V × r
                state.sketch = contribution if state.sketch is None else state.sketch.add_(contribution)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk: int = 1024, softcap: float | None = None,
                           state: SketchState | None = None) -> torch.Tensor:
    """log softmax(z)[targets], z = hidden Wᵀ (capped to c·tanh(z/c) with ``softcap`` = c), for
    hidden [..., d], weight [V, d], targets [...] -> [...] (fp32).

    With a sketch ``state`` (a LoGRA-sketched embedding or head: the head module's ``sketch_state``),
    or a weight that carries one, the weight's gradient arrives as a sketch; otherwise as an ordinary
    ``.grad``. Pass the module's state where the weight may be another tensor than the one the sketch
    was installed on (FSDP2 swaps an unsharded parameter into the module during its forward).
    """
    state = state if state is not None else getattr(weight, "sketch_state", None)
    shape = targets.shape
    out = _ChunkedHeadLogprob.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk, state,
                                    softcap)
    return out.view(shape)
