"""LoGRA in the harness: the gradient-sketch optimizer of :mod:`logra_core` behind the method interface."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from baselines.base import Method, first_nonfinite, register_method
from baselines.memory_terms import MemoryTerms, PlanContext, Term
from logra_core.clip import clip_sketches_and_grads
from logra_core.optimizer import LoGRA
from logra_core.precision import CHUNK_ELEMENTS
from logra_core.sketch import DEFAULT_TARGETS

# bytes per sketched element that a bf16/fp16 weight's ``master`` mode keeps beside it, given the
# weight's bytes b (logra_core/precision.py, docs/precision.md)
MASTER_BYTES = {"fp32": lambda b: 4, "kahan": lambda b: b, "stochastic": lambda b: 0, "none": lambda b: 0}
# bytes per element of one row block (CHUNK_ELEMENTS) that the merge holds at once: fp32 updates the
# master in place; none: X = fp32(W); kahan: X and fp32(W) for C ← X − W; stochastic: X, int64 element
# indices and their shifted hash (8 + 8), the int32 bits
MERGE_TEMP_BYTES = {"fp32": 0, "kahan": 8, "stochastic": 24, "none": 4}


@dataclass
class LoGRAConfig:
    rank: int = 64  # sketch rank r of every sketched projection; 64 fits the CPU budget here (NeMo AutoModel's default is 256; the LoGRA paper's is not public)
    lr: float = 1e-5  # learning rate of the sketched update ΔW = −lr·D·A
    beta2: float = 0.9  # RowAdam second-moment decay, one moment per output row
    eps: float = 1e-8  # RowAdam denominator epsilon
    weight_decay: float = 0.0  # decoupled weight decay of sketched weights
    first_moment: bool = False  # Adam's first moment in sketch space (needs refresh_every > 1)
    beta1: float = 0.9  # first-moment decay (with first_moment)
    refresh_every: int = 1  # draw a new projection A every N steps
    projection: str = "rademacher"  # rademacher | gaussian | svd (GaLore's top-r gradient subspace, Zhao et al., 2024)
    moments: str = "keep"  # svd: what Adam's moments do when the subspace is refreshed: keep | reset | rotate
    svd_scale: float = 1.0  # svd: scale of the projected-back update (GaLore's `scale`)
    seed: int = 0  # seeds A = f(seed, layer, step)
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # regexes of the nn.Linear names to sketch
    embeddings: bool = False  # also sketch the input embedding and an LM head tied to it (else they train by AdamW)
    dense_lr: float = 5e-6  # AdamW learning rate of the unsketched tensors (embeddings, norms); untuned (half the best dense rate seen), tuned with lr by the lr sweep (docs/design.md §3.1, "Learning rates")
    max_grad_norm: float = 1.0  # clip the estimated global norm √(Σ‖S‖² + Σ‖g‖²) of sketches and dense gradients (logra_core/clip.py); 0 = off
    master: str = "fp32"  # how a bf16/fp16 sketched weight takes W ← W − lr·D·A: fp32 (fp32 master) | kahan (bf16 compensation) | stochastic (stochastic rounding) | none (round to nearest); fp32 models ignore it (docs/precision.md)
    dense_precision: str = "mixed"  # AdamW of the unsketched tensors of a bf16/fp16 model: mixed (fp32 master + moments) | bf16 (on the tensor itself); fp32 models ignore it


@register_method("logra")
class LoGRAMethod(Method):
    """Attention and MLP projections learn through sketches (no dense gradient); the rest via AdamW."""

    config_cls = LoGRAConfig
    step_control_default = True  # docs/design.md §3.2: predicted-KL step control is part of the method
    rank_key = "rank"
    plan_option_names = frozenset({"embeddings", "master", "dense_precision"})  # planner options from logra.*

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """Projections learn through m x r fp32 sketches (no dense gradient, no saved input: the layer
        keeps X A^T instead of X), with one fp32 second moment per row; the unsketched tensors
        (norms, biases, the embedding/head unless ``embeddings``) train by AdamW under
        ``dense_precision``. A bf16/fp16 sketched weight keeps, by ``master`` (logra_core/precision.py):
        ``fp32`` an fp32 master (4 B per element), ``kahan`` a compensation in the weight dtype (2 B),
        ``stochastic`` / ``none`` nothing. Kept on the layers: the last applied D (m x r) for weight sync
        and the projection A (r x n). At the step, the update (D and its scaled copy, AdamW's step per
        unsketched tensor) is held until ``apply``, which merges one row block at a time."""
        s, r, b, o = ctx.shapes, ctx.rank, ctx.weight_bytes, ctx.shard_optimizer
        emb = bool(ctx.options.get("embeddings", False))
        master = str(ctx.options.get("master", "fp32"))
        dprec = ctx.options.get("dense_precision")
        if master not in MASTER_BYTES:
            raise ValueError(f"logra master must be one of {sorted(MASTER_BYTES)}, got {master!r}")
        head_sketched = emb and s.tied
        embed_dense, head_dense = not emb, not head_sketched
        V, h = s.vocab, s.hidden
        dense_rest = s.norms + s.biases + (s.embed if embed_dense else 0) + (s.head if head_dense and not s.tied else 0)
        rows = sum(m for m, _ in s.proj) + (V if emb else 0)
        max_rows = max([m for m, _ in s.proj] + ([V] if emb else []))
        sketched = s.n_proj + (s.embed if emb else 0)
        state = [Term("optimizer", "LoGRA row second moments", rows * 4 // o, f"{rows:,} rows, fp32")]
        per = MASTER_BYTES[master](b) if ctx.low else 0
        if per:
            state.append(Term("optimizer", f"LoGRA {master} buffers of the sketched weights", sketched * per // o,
                              f"{sketched:,} elements x {per} B: " + ("an fp32 master copy" if master == "fp32"
                                                                      else "a Kahan compensation in the weight dtype")))
        state.append(Term("optimizer", "AdamW state of the unsketched tensors", dense_rest * ctx.adam_bytes(dprec) // o,
                          "embedding/head (unless sketched), norms, biases"
                          + (": fp32 master + two fp32 moments" if ctx.mixed(dprec) else "")))
        state.append(Term("activations", "LoGRA's last applied D factors", rows * r * 4 // o,
                          f"m x {r} fp32 per sketched weight, kept for weight sync (logra_core.optimizer last_lowrank)"))
        bases = (sum(n for _, n in s.proj) + (h if emb else 0)) * r * 4
        state.append(Term("activations", "LoGRA projections A", bases // o,
                          f"{r} x n fp32 per sketched weight, regenerated once per step and cached on the layer"))
        if emb:
            state.append(Term("optimizer", "LoGRA embedding sketch", V * r * 4 // o,
                              f"V x {r} fp32 (the first micro-batch creates it, zero-filled)"))
        grads = [Term("grads", "gradients of the unsketched tensors", dense_rest * b // ctx.shard_grads),
                 Term("optimizer", "LoGRA sketches", sum(m for m, _ in s.proj) * r * 4 // o, f"m x {r} fp32 per projection")]
        biggest_dense = max([s.embed if embed_dense else 0, s.head if head_dense else 0, h])
        mb = ctx.moment_bytes(dprec)
        step = [Term("activations", "update of the unsketched tensors", dense_rest * mb // o,
                     "AdamW's step per tensor (in the moments' dtype, formed in place of its direction), held in the Update until apply"),
                Term("activations", "D and its scaled copy", 2 * rows * r * 4 // o,
                     f"m x {r} fp32 per sketched weight, held in the Update until apply")]
        if ctx.mixed(dprec):
            step.append(Term("activations", "the largest dense gradient in fp32", biggest_dense * 4 // o,
                             "a bf16/fp16 gradient cast to its fp32 moments' dtype while they advance"))
        if ctx.low and MERGE_TEMP_BYTES[master]:
            shapes = list(s.proj) + ([(V, h)] if emb else [])
            block = max(min(m, max(1, CHUNK_ELEMENTS // n)) * n for m, n in shapes)
            step.append(Term("activations", f"merge temporaries ({master})", block * MERGE_TEMP_BYTES[master] // o,
                             f"one row block of at most {CHUNK_ELEMENTS:,} elements x {MERGE_TEMP_BYTES[master]} B"))
        head = [Term("activations", "head sketch contribution", V * r * 4, f"V x {r} fp32, added to the embedding sketch")] \
            if head_sketched else []
        return MemoryTerms(
            state=state, grads=grads, step=step, saves_inputs=False, embed_grad=embed_dense, head_grad=head_dense, head=head,
            dense_layer_grads=False, sketched_rows=rows, sketched_max_rows=max_rows, receiver_bytes=per,
            layer_extra=[(7 * r, 4, f"X A^T (tokens x {r}, fp32) per sketched projection instead of X")],
            assumptions=[f"logra: projections learn through m x r sketches (r={r}), no dense gradient; embedding "
                         + ("and tied head sketched" if emb else "and head trained by AdamW with a dense gradient")
                         + (f"; sketched weights in the model dtype with master={master} ({per} B per element beside them)"
                            if ctx.low else "")])

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        c = self.cfg
        self.optimizer = LoGRA(
            model, rank=c.rank, lr=c.lr, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay,
            first_moment=c.first_moment, beta1=c.beta1, refresh_every=c.refresh_every,
            projection=c.projection, moments=c.moments, svd_scale=c.svd_scale, seed=c.seed, targets=c.targets, embeddings=c.embeddings, dense_lr=c.dense_lr,
            master=c.master, dense_precision=c.dense_precision,
        )
        self.dense_params = [p for g in self.optimizer.param_groups if g["kind"] == "dense" for p in g["params"]]
        return self.optimizer

    def clip(self) -> dict[str, float]:
        """One coefficient for sketches and dense gradients from the estimated global norm
        √(Σ‖S‖² + Σ‖g‖²) (:mod:`logra_core.clip`); ``step/grad_norm`` is that estimate."""
        pairs = [(m.weight, m.sketch_state.sketch) for m in self.optimizer._unique_modules()]
        return {"step/grad_norm": clip_sketches_and_grads(pairs, self.dense_params, self.cfg.max_grad_norm)}

    def step(self) -> dict[str, float]:
        stats = self.clip()
        self.optimizer.step()
        return stats

    def propose(self):
        """Low-rank factors (D, A) for sketched weights, AdamW's Δ for the rest; nothing applied."""
        stats = self.clip()
        return self.optimizer.propose(), stats

    def reduce_gradients(self, group=None) -> int:
        """Sketches (m × r per sketched weight) and the small dense gradients, not m × n gradients."""
        return self.optimizer.reduce_gradients(group)

    def nonfinite(self) -> str | None:
        """First non-finite sketch (m × r, or the dense gradient on an svd refresh step) or small dense gradient."""
        opt, seen, named = self.optimizer, set(), []
        for name, m in opt.modules_by_name.items():
            if id(m.sketch_state) not in seen:  # a tied head shares its embedding's sketch
                seen.add(id(m.sketch_state))
                named.append((f"{name} (sketch)", m.sketch_state.sketch))
        named += [(f"{opt.param_name[id(p)]}.grad", p.grad) for p in self.dense_params]
        return first_nonfinite(named)

    def full_precision_parameters(self) -> dict[str, torch.Tensor]:
        """Masters where kept (fp32 master, W + C under kahan), else the parameters."""
        opt = self.optimizer
        return {n: opt.full_precision(p) for n, p in self.model.named_parameters() if p.requires_grad}

    def apply(self, update, scale: float = 1.0) -> None:
        self.optimizer.apply(update, scale)

    def sync_entries(self):
        """Sketched weights as low-rank ops (L, and the seed that rebuilds A); the rest by value."""
        opt = self.optimizer
        return dict(getattr(opt, "last_lowrank", {})), list(getattr(opt, "last_changed", [])), opt.masters()
