"""``LoGRA``: RowAdam on gradient sketches for the big projections, AdamW for everything else.

For each sketched weight W (m × n) with sketch S = G Aᵀ (m × r, :mod:`logra_core.sketch`):

    v_i ← β₂ v_i + (1 − β₂) · mean_j S_ij²          one second moment per output row
    v̂ = v / (1 − β₂ᵗ)                               bias correction
    N = S                  (or m̂, Adam's first moment in sketch space, with ``first_moment``)
    D = N / (√v̂ + ε)                               (m × r)
    W ← W − η·λ·W − η · D A                         decoupled weight decay, then the update

A is regenerated from (seed, layer, step) and a fresh one drawn every ``refresh_every`` steps
(default 1: every step; the first-moment variant needs A held while m̂ lives in its space).
For fp32 weights ``D A`` is added with one in-place ``addmm_``, so no tensor of W's size is ever
allocated. Weights in bf16/fp16 take it as ``master`` says (:mod:`logra_core.precision`): an fp32
master copy (``fp32``, the reference), a bf16 Kahan compensation (``kahan``), stochastic rounding
(``stochastic``) or round-to-nearest (``none``), merged one row block at a time.
Every other trainable tensor (norms, embeddings, biases) gets plain AdamW (Loshchilov & Hutter,
2019), the same formula as ``torch.optim.AdamW``; with ``dense_precision="mixed"`` a bf16/fp16
tensor keeps an fp32 master and fp32 moments (as FSDP MixedPrecision and DeepSpeed bf16 do), with
``"bf16"`` AdamW runs on the low-precision tensor itself. fp32 models ignore both settings.

Drop-in: ``LoGRA(model, rank=64, lr=1e-5)`` installs the sketch on the model's attention and MLP
projections (with ``embeddings=True`` also on the input embedding and a head tied to it) and
optimizes all of its trainable parameters; ``zero_grad`` clears the sketches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from logra_core.distributed import all_reduce_sum, local, local_rows
from logra_core.precision import BUFFERED, MASTERS, compute_dtype, full_precision, new_buffer
from logra_core.sketch import DEFAULT_TARGETS, SketchedEmbedding, SketchedLinear, install
from logra_core.svd_projector import MOMENTS, SVDProjector
from logra_core.sync import LowRankOp, apply_lowrank
from logra_core.update import Update

PROJECTIONS = ("rademacher", "gaussian", "svd")
DENSE_PRECISIONS = ("mixed", "bf16")  # AdamW of the unsketched tensors of a bf16/fp16 model


@dataclass
class PendingLowRank:
    """A sketched weight's proposed step, kept by :meth:`LoGRA.propose` for :meth:`LoGRA.apply`:
    W ← (1 − s·decay)·W + s·alpha·left·right (``decay_first``: decay before the low-rank add)."""

    param: torch.Tensor
    left: torch.Tensor  # D, m × r
    right: torch.Tensor  # A, r × n (rebuilt from its seed where it is a random projection)
    alpha: float  # −η, folded into D at apply time
    decay: float  # lr · weight decay
    decay_first: bool


@dataclass
class PendingDense:
    """An unsketched tensor's proposed AdamW step Δ = α·m/(√v̂ + ε) − ηλ·θ: θ ← θ + s·Δ."""

    param: torch.Tensor
    delta: torch.Tensor  # the same tensor as the Update's ``dense`` entry (formed in place: no copy)


class LoGRA(torch.optim.Optimizer):
    def __init__(
        self,
        model: nn.Module,
        rank: int = 64,
        lr: float = 1e-5,
        beta2: float = 0.9,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        first_moment: bool = False,
        beta1: float = 0.9,
        refresh_every: int = 1,
        projection: str = "rademacher",
        moments: str = "keep",
        svd_scale: float = 1.0,
        seed: int = 0,
        targets: Iterable[str] = DEFAULT_TARGETS,
        embeddings: bool = False,
        dense_lr: float | None = None,
        dense_betas: tuple[float, float] = (0.9, 0.999),
        dense_weight_decay: float | None = None,
        master: str = "fp32",
        dense_precision: str = "mixed",
    ):
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
        if rank < 1 or refresh_every < 1 or lr < 0:
            raise ValueError(f"need rank >= 1, refresh_every >= 1, lr >= 0 (got {rank}, {refresh_every}, {lr})")
        if projection == "svd" and embeddings:
            raise ValueError("projection='svd' sketches linear layers only: use embeddings=False")
        if master not in MASTERS:
            raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
        if dense_precision not in DENSE_PRECISIONS:
            raise ValueError(f"dense_precision must be one of {DENSE_PRECISIONS}, got {dense_precision!r}")
        if moments not in MOMENTS:
            raise ValueError(f"moments must be one of {MOMENTS}, got {moments!r}")
        if first_moment and refresh_every == 1:
            raise ValueError("first_moment needs A held for several steps: set refresh_every > 1")
        already = {n: m for n, m in model.named_modules() if isinstance(m, (SketchedLinear, SketchedEmbedding))}
        kind = "rademacher" if projection == "svd" else projection
        self.modules_by_name = already or install(model, rank, seed, targets, kind, embeddings)
        unique = {id(m.weight): m.weight for m in self.modules_by_name.values()}  # a tied head shares the embedding's
        sketched = [p for p in unique.values() if p.requires_grad]
        ids = set(unique)
        dense = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
        if master == "stochastic" and any(p.dtype == torch.float16 for p in sketched):
            raise ValueError("master='stochastic' rounds to bf16: use it with a bfloat16 model (fp16 weights: fp32 or kahan)")
        groups = [{"params": sketched, "kind": "sketch"}]
        if dense:
            groups.append({
                "params": dense, "kind": "dense",
                "lr": lr if dense_lr is None else dense_lr,
                "weight_decay": weight_decay if dense_weight_decay is None else dense_weight_decay,
                "betas": dense_betas, "precision": dense_precision,
            })
        defaults = dict(lr=lr, beta2=beta2, eps=eps, weight_decay=weight_decay, first_moment=first_moment,
                        beta1=beta1, refresh_every=refresh_every, betas=dense_betas, projection=projection,
                        moments=moments, svd_scale=svd_scale, master=master, precision=dense_precision)
        super().__init__(groups, defaults)
        self.module_of = {id(m.weight): m for m in self.modules_by_name.values()}
        self.module_name = {}
        for n, m in self.modules_by_name.items():
            self.module_name.setdefault(id(m.weight), n)  # a tied head goes by its embedding's name
        self.param_name = {id(p): n for n, p in model.named_parameters()}
        # LoGRA's own state lives outside ``self.state`` so that load_state_dict does not cast the
        # fp32 moments and masters of low-precision weights to the weights' dtype.
        self.sketch_step = 0
        if projection == "svd":
            small = [n for n, m in self.modules_by_name.items() if rank > min(m.weight.shape)]
            if small:
                raise ValueError(f"svd rank {rank} exceeds the smaller dimension of {small[:3]}")
        self._prepare_next_step()

    # ---- the update ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply(self.propose(), 1.0)
        return loss

    @torch.no_grad()
    def propose(self) -> Update:
        """Advance the moments and compute Δ without touching the weights (docs/design.md §3.2).

        Sketched weights: ΔW = D A as factors (``lowrank``, by module name); weight decay, when
        on, adds −ηλW to ``dense`` (weight-sized, so only then). Other tensors: AdamW's Δ (``dense``).
        """
        update = Update(pending=[])
        for group in self.param_groups:
            if group["kind"] == "sketch":
                propose = self._svd_update if group["projection"] == "svd" else self._sketch_update
                for p in group["params"]:
                    found = propose(p, group)
                    if found is None:
                        continue
                    left, right, alpha, decay, decay_first = found
                    update.pending.append(PendingLowRank(p, *found))
                    update.lowrank[self.module_name[id(p)]] = (left * alpha, right)
                    if decay:
                        update.dense[self.param_name[id(p)]] = p.detach().float() * -decay
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        delta = self._adamw_update(p, group)
                        update.pending.append(PendingDense(p, delta))
                        update.dense[self.param_name[id(p)]] = delta
        return update

    @torch.no_grad()
    def apply(self, update: Update, scale: float = 1.0) -> None:
        """θ ← θ + scale·Δ for an update from :meth:`propose`; then the next step's projections.

        Records what it did for weight sync (:mod:`logra_core.sync`): ``last_lowrank`` (parameter name
        -> the :class:`LowRankOp` applied) and ``last_changed`` (names of the other tensors it moved).
        """
        self.last_lowrank, self.last_changed = {}, []
        for item in update.pending:
            p = item.param
            if isinstance(item, PendingDense):
                target = self.state[p].get("master", p)  # mixed precision: the fp32 master
                target.add_(item.delta, alpha=scale)
                if target is not p:
                    p.copy_(target)
                self.last_changed.append(self.param_name[id(p)])
                continue
            left, right, alpha, decay, decay_first = item.left, item.right, item.alpha, item.decay, item.decay_first
            weight, rows = local(p), local_rows(p)  # a row-sharded weight: this rank's rows
            spec = self._basis_spec(p, right)
            master = self.defaults["master"]
            st = self.module_of[id(p)].sketch_state
            op = LowRankOp((left * (alpha * scale)).to(compute_dtype(weight)), spec, None if spec else right,
                           scale * decay, decay_first, master,
                           (st.seed, self.sketch_step, st.layer) if master == "stochastic" else None)
            offset = rows.start * weight.shape[1] if rows is not None else 0
            apply_lowrank(weight, op, right, self._buffer(p), offset)
            self.last_lowrank[self.param_name[id(p)]] = op
        self.sketch_step += 1
        self._prepare_next_step()

    def _basis_spec(self, p: torch.Tensor, right: torch.Tensor):
        """(seed, layer, step, kind, rows, cols) that rebuild ``right`` anywhere, or None (svd, a fixed A)."""
        st = self.module_of[id(p)].sketch_state
        if self.defaults["projection"] == "svd" or st.fixed_basis is not None:
            return None
        return st.seed, st.layer, st.step, st.kind, st.rank, right.shape[1]

    def _buffer(self, p: torch.Tensor):
        """The precision buffer of a sketched weight (fp32 master or Kahan compensation), or None."""
        st = self.state[p]
        return st.get("master", st.get("compensation"))

    def _init_buffer(self, p: torch.Tensor, state: dict) -> None:
        """At a sketched weight's first update: the buffer its ``master`` mode keeps (none for fp32 weights)."""
        buffer = new_buffer(local(p), self.defaults["master"])
        if buffer is not None:
            state[BUFFERED[self.defaults["master"]]] = buffer

    def full_precision(self, p: torch.Tensor) -> torch.Tensor:
        """p's value as the optimizer holds it: the fp32 master, W + C (kahan, in fp32), or p itself."""
        st = self.state.get(p, {})
        if "compensation" in st:
            return local(p).detach().float() + st["compensation"].float()
        return st.get("master", p).detach()

    def masters(self) -> dict[str, torch.Tensor]:
        """The buffers a weight-sync receiver mirrors, by parameter name: fp32 masters (``master="fp32"``)
        or bf16 compensations (``"kahan"``) of low-precision sketched weights."""
        sketched = {id(p) for p in self.param_groups[0]["params"]}
        return {self.param_name[id(p)]: self._buffer(p) for p in self.state
                if id(p) in sketched and self._buffer(p) is not None}

    def _prepare_next_step(self) -> None:
        """Clear the sketches and set what the next backward accumulates (A's step; the svd mode)."""
        svd, every = self.defaults["projection"] == "svd", self.defaults["refresh_every"]
        for m in self.modules_by_name.values():
            state = m.sketch_state
            state.sketch = None
            state.step = self.sketch_step // every
            if svd:
                st = self.state.get(m.weight, {})
                refresh = st.get("step", 0) % every == 0 or "svd_basis" not in st
                state.mode = "dense" if refresh else SVDProjector(m.weight.shape, state.rank).side
                state.fixed_basis = None if refresh else st["svd_basis"]

    def _sketch_update(self, p: torch.Tensor, group: dict):
        """RowAdam: advances the row moments; returns (D, A, −η, ηλ, decay first) or None."""
        module = self.module_of[id(p)]
        s = module.sketch_state.sketch
        if s is None:  # no backward reached this layer
            return
        rows = local_rows(p)  # W row-sharded (FSDP): S_k, D_k and the update stay on this rank's rows
        if rows is not None and s.shape[0] == p.shape[0] and rows != slice(0, p.shape[0]):
            s = s[rows]  # a whole sketch (one process, or not reduce-scattered): take this rank's rows
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["row_second_moment"] = torch.zeros(s.shape[0], dtype=torch.float32, device=s.device)
            self._init_buffer(p, state)
        state["step"] += 1
        t = state["step"]
        beta2, eps, lr = group["beta2"], group["eps"], group["lr"]
        v = state["row_second_moment"]
        v.mul_(beta2).add_(s.square().mean(dim=1), alpha=1 - beta2)
        numerator = s
        if group["first_moment"]:
            m = state.setdefault("first_moment", torch.zeros_like(s))
            if state.get("first_moment_step") != module.sketch_state.step:  # A changed: old m̂ lives in another space
                m.zero_()
                state["first_moment_step"] = module.sketch_state.step
                state["first_moment_t"] = 0
            state["first_moment_t"] += 1
            m.mul_(group["beta1"]).add_(s, alpha=1 - group["beta1"])
            numerator = m / (1 - group["beta1"] ** state["first_moment_t"])
        v_hat = v / (1 - beta2**t)
        d = numerator / (v_hat.sqrt().unsqueeze(1) + eps)
        basis = module.sketch_state.projection(p.shape[1], p.device)
        return d, basis, -lr, lr * group["weight_decay"], True

    def _svd_update(self, p: torch.Tensor, group: dict):
        """GaLoreAdamW's update on the svd subspace (:mod:`logra_core.svd_projector`): advances the
        moments; returns the project-back as factors (left, right, −step, ηλ, decay after) or None."""
        module = self.module_of[id(p)]
        s = module.sketch_state.sketch
        if s is None:
            return
        if local_rows(p) is not None:
            raise NotImplementedError("projection='svd' on a row-sharded weight: its SVD needs the whole gradient")
        state = self.state[p]
        proj = SVDProjector(p.shape, module.sketch_state.rank)
        proj.basis = state.get("svd_basis")
        if module.sketch_state.mode == "dense":  # a refresh step: s is the dense gradient
            old = proj.refresh(s)
            low = proj.project(s)
            state["svd_basis"] = proj.basis
            if "exp_avg" in state:
                proj.carry_moments(group["moments"], old, state["exp_avg"], state["exp_avg_sq"])
        else:
            low = s
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(low)
            state["exp_avg_sq"] = torch.zeros_like(low)
            self._init_buffer(p, state)
        state["step"] += 1
        beta1, beta2, lr, t = group["beta1"], group["beta2"], group["lr"], state["step"]
        state["exp_avg"].mul_(beta1).add_(low, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(low, low, value=1 - beta2)
        denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
        step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        normalized = state["exp_avg"] / denom
        left, right = (normalized, proj.basis) if proj.side == "right" else (proj.basis, normalized)
        return left, right, -step_size * group["svd_scale"], lr * group["weight_decay"], False

    def _adamw_update(self, p: torch.Tensor, group: dict):
        """torch.optim.AdamW's formula (a scheduler's changes to ``group['lr']`` apply): advances the
        moments, returns the step Δ = −η/(1−β₁ᵗ) · m/(√v̂+ε) − ηλ·θ, formed in one new tensor (no
        temporary of the tensor's size). ``precision="mixed"`` on a bf16/fp16 tensor: fp32 master and
        moments, the gradient cast to fp32; θ is the master."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            if group["precision"] == "mixed" and not full_precision(p):
                state["master"] = p.detach().float().clone()
            like = state.get("master", p)
            state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        lr, g = group["lr"], p.grad.to(state["exp_avg"].dtype)
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        delta = state["exp_avg_sq"].sqrt().div_(math.sqrt(1 - beta2**t)).add_(group["eps"])  # √v̂ + ε ...
        torch.div(state["exp_avg"], delta, out=delta).mul_(-lr / (1 - beta1**t))  # ... then the step, in place
        decay = lr * group["weight_decay"]
        if decay:
            delta.sub_(state.get("master", p.detach()), alpha=decay)
        return delta

    @torch.no_grad()
    def reduce_gradients(self, group=None) -> int:
        """Sum the step's sketches and the plain tensors' gradients over the data-parallel ranks of
        ``group`` (:mod:`logra_core.distributed`); call once per step, after the last micro-batch.
        Gradients that are DTensors were reduced by their sharding engine (FSDP) and are skipped;
        the sketch of a row-sharded weight is reduce-scattered, so each rank keeps the sum of its own
        rows S_k only. Returns the bytes one rank sent in: Σ m·r·4 over sketched weights (padded to
        whole row chunks where sharded) plus the small dense grads."""
        modules = self._unique_modules()
        states = [m.sketch_state for m in modules]
        rows = [local_rows(m.weight) if st.mode == "right" else None for m, st in zip(modules, states)]
        grads = [p for g in self.param_groups if g["kind"] == "dense" for p in g["params"] if not isinstance(p, DTensor)]
        sketch_like = [lambda st=st, m=m: self._empty_sketch(m, st) for m, st in zip(self._unique_modules(), states)]
        summed, nbytes = all_reduce_sum([st.sketch for st in states] + [p.grad for p in grads], group,
                                        like=sketch_like + [lambda p=p: p for p in grads],
                                        rows=rows + [None] * len(grads))
        for st, s in zip(states, summed):
            st.sketch = s
        for p, g in zip(grads, summed[len(states):]):
            p.grad = g
        return nbytes

    def _unique_modules(self) -> list[nn.Module]:
        """One sketched module per sketch state (a tied head shares its embedding's), in a fixed order."""
        seen, out = set(), []
        for m in self.modules_by_name.values():
            if id(m.sketch_state) not in seen:
                seen.add(id(m.sketch_state))
                out.append(m)
        return out

    @staticmethod
    def _empty_sketch(module: nn.Module, state) -> torch.Tensor:
        """Zeros of the sketch this module's backward would have accumulated on this rank."""
        m, n = module.weight.shape
        shape = {"right": (m, state.rank), "left": (state.rank, n), "dense": (m, n)}[state.mode]
        return torch.zeros(shape, dtype=torch.float32, device=module.weight.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for m in self.modules_by_name.values():
            m.sketch_state.sketch = None

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        out = super().state_dict()
        sketched = self.param_groups[0]["params"]
        dense = self.param_groups[1]["params"] if len(self.param_groups) > 1 else []
        out["logra"] = {
            "sketch_step": self.sketch_step,
            # sketches mid-step (accumulated micro-batches not yet applied), by sketched-param index
            "sketches": {i: self.module_of[id(p)].sketch_state.sketch for i, p in enumerate(sketched)
                         if self.module_of[id(p)].sketch_state.sketch is not None},
            # tensors of sketched weights (fp32 moments, masters, compensations), kept out of the dtype
            # cast of load_state_dict
            "fp32": {i: {k: v for k, v in self.state[p].items() if torch.is_tensor(v)} for i, p in enumerate(sketched)
                     if p in self.state},
            # the same for unsketched tensors with an fp32 master (mixed precision), by dense-group index
            "dense_fp32": {i: {k: v for k, v in self.state[p].items() if torch.is_tensor(v)} for i, p in enumerate(dense)
                           if "master" in self.state.get(p, {})},
        }
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("logra")
        super().load_state_dict(state_dict)
        self.sketch_step = extra["sketch_step"]
        sketched = self.param_groups[0]["params"]
        for i, p in enumerate(sketched):
            for k, v in extra["fp32"].get(i, {}).items():
                self.state[p][k] = v.to(p.device)
        dense = self.param_groups[1]["params"] if len(self.param_groups) > 1 else []
        for i, p in enumerate(dense):
            for k, v in extra.get("dense_fp32", {}).get(i, {}).items():
                self.state[p][k] = v.to(p.device)
        self._prepare_next_step()
        for i, p in enumerate(sketched):
            self.module_of[id(p)].sketch_state.sketch = extra["sketches"].get(i)
