"""GaLore baselines: the authors' ``galore_torch.GaLoreAdamW`` (Zhao et al., 2024) in our loop.

``galore``: one optimizer; the attention and MLP projections sit in GaLore param groups (their
gradients are projected onto the top-``rank`` singular subspace, refreshed every
``update_proj_gap`` steps), every other trainable tensor in a plain AdamW group.

``galore_layerwise``: the per-layer mode of the GaLore paper — one optimizer per parameter,
stepped inside the parameter's post-accumulate-grad hook, and the gradient freed right away, so
at most one layer's dense gradient exists at a time. Such a hook fires once per backward, so with
gradient accumulation over several micro-batches it cannot step per micro-batch without changing
the update. We accumulate honestly: the hook steps only during the backward of the *last*
micro-batch (the trainer says which through :meth:`Method.backward`); the earlier micro-batches'
gradients are held as usual. The saving therefore shrinks with accumulation — with one micro-batch
per update it is the paper's; with k micro-batches the full gradients of the first k−1 exist. A
global gradient-norm clip needs every gradient at once, so the layerwise mode does not clip.
Non-finite guard (``experiments/rl/guard.py``): a hook never steps a parameter from a gradient with a
NaN/Inf; from the first such gradient on, the rest of that backward steps nothing, and a non-finite
loss steps nothing at all. The parameters whose hooks ran before the bad gradient was met have
stepped, though: the layerwise update cannot be skipped as a whole after the fact.

Ranks are capped at the smaller dimension of each matrix (with a message), so ``rank=256`` works
on SmolLM2's 192-wide k/v projections. GaLore's projector objects are stored in checkpoints as
plain tensors and numbers, so every checkpoint file still loads with ``weights_only=True``.

On a bf16/fp16 model ``precision="mixed"`` (default) gives GaLoreAdamW fp32 masters to step (fp32
gradient, projector and moments; the bf16 weight is the rounded master), ``"bf16"`` steps the bf16
weights themselves (:mod:`baselines.precision`).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from baselines.base import Method, first_nonfinite, register_method
from baselines.precision import MasterWeights, check_precision
from baselines.memory_terms import MemoryTerms, PlanContext, Term, adamw_temporaries, master_gradients
from logra_core.sketch import DEFAULT_TARGETS, select_linears

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


@dataclass
class GaLoreConfig:
    lr: float = 4e-5  # Adam learning rate of every parameter (GaLore scales its projected update by `scale`)
    rank: int = 64  # GaLore rank r of each projected matrix (capped at min(m, n))
    update_proj_gap: int = 200  # recompute the SVD subspace every N steps (GaLore's default)
    scale: float = 0.25  # GaLore's alpha: multiplier of the projected-back update (authors' default)
    proj_type: str = "std"  # std | reverse_std | left | right | full (galore_torch's projector types)
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    eps: float = 1e-6  # Adam epsilon (galore_torch's default)
    weight_decay: float = 0.0  # decoupled weight decay
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # regexes of the nn.Linear names GaLore projects
    max_grad_norm: float = 1.0  # clip the global gradient norm before the step; 0 = off (galore_layerwise: never)
    precision: str = "mixed"  # bf16/fp16 model: mixed (GaLore steps fp32 masters: fp32 gradient, SVD and moments) | bf16 (on the bf16 weights); fp32 models ignore it

    def __post_init__(self):
        check_precision("galore", self.precision)
        if self.proj_type not in PROJ_TYPES:
            raise ValueError(f"galore.proj_type must be one of {PROJ_TYPES}, got {self.proj_type!r}")
        if self.rank < 1 or self.update_proj_gap < 1:
            raise ValueError(f"galore.rank and galore.update_proj_gap must be >= 1, got {self.rank} and {self.update_proj_gap}")


def galore_param_groups(model: nn.Module, c: GaLoreConfig) -> list[dict]:
    """GaLore groups (one per effective rank) for the target projections, then one plain group."""
    by_rank: dict[int, list[nn.Parameter]] = defaultdict(list)
    capped = []
    projected = set()
    for name, module in select_linears(model, c.targets):
        w = module.weight
        if not w.requires_grad or id(w) in projected:
            continue
        r = min(c.rank, *w.shape)
        if r < c.rank:
            capped.append(f"{name} {tuple(w.shape)} -> {r}")
        by_rank[r].append(w)
        projected.add(id(w))
    if not projected:
        raise ValueError(f"galore: no nn.Linear matches galore.targets={c.targets}")
    if capped:
        warnings.warn(f"galore.rank={c.rank} exceeds the smaller dimension of {len(capped)} matrices; "
                      f"capped there, e.g. {capped[0]}", stacklevel=2)
    groups = [{"params": ps, "rank": r, "update_proj_gap": c.update_proj_gap, "scale": c.scale, "proj_type": c.proj_type}
              for r, ps in sorted(by_rank.items())]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in projected]
    if rest:
        groups.append({"params": rest})
    return groups


def _adamw(groups, c: GaLoreConfig):
    from galore_torch import GaLoreAdamW

    return GaLoreAdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
                       no_deprecation_warning=True)


# ---- checkpoints: GaLoreProjector objects <-> plain data ------------------------------------------
# Numbers only: Optimizer.load_state_dict casts nested iterables element-wise, which mangles strings.
_PROJECTOR_FIELDS = ("rank", "update_proj_gap", "scale")


def _plain_state(sd: dict) -> dict:
    """An optimizer state_dict with every GaLoreProjector replaced by a dict of tensors and numbers."""
    state = {}
    for k, s in sd["state"].items():
        s = dict(s)
        proj = s.pop("projector", None)
        if proj is not None:
            m = proj.ortho_matrix
            s["galore_projector"] = {
                **{f: getattr(proj, f) for f in _PROJECTOR_FIELDS},
                "proj_type": PROJ_TYPES.index(proj.proj_type),
                "ortho": [] if m is None else (list(m) if isinstance(m, (list, tuple)) else [m]),
                "ortho_is_pair": isinstance(m, (list, tuple)),
            }
        state[k] = s
    return {**sd, "state": state}


def _restore_projectors(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of a plain state: rebuild the GaLoreProjector objects."""
    from galore_torch.galore_projector import GaLoreProjector

    for s in optimizer.state.values():
        plain = s.pop("galore_projector", None)
        if plain is None:
            continue
        proj = GaLoreProjector(plain["rank"], update_proj_gap=plain["update_proj_gap"], scale=plain["scale"],
                               proj_type=PROJ_TYPES[plain["proj_type"]])
        ortho = plain["ortho"]
        proj.ortho_matrix = (list(ortho) if plain["ortho_is_pair"] else ortho[0]) if ortho else None
        s["projector"] = proj


def galore_state(ctx: PlanContext) -> list[Term]:
    """GaLoreAdamW's state: a projector and two r-row moments per projection, AdamW on the rest."""
    s, r, prec = ctx.shapes, ctx.rank, ctx.options.get("precision")
    mb = ctx.moment_bytes(prec)  # fp32 masters (mixed) or an fp32 model: fp32 gradients, SVD and moments
    projector, moments = 0, 0
    for m, n in s.proj:
        rr = min(r, m, n)
        # galore_torch keeps Vh[:r] / U[:, r] of the fp32 SVD: a view, so the whole min(m,n)^2 factor
        # stays alive; for bf16/fp16 weights it keeps a cast copy (min side x r)
        projector += (min(m, n) ** 2 * 4) if mb == 4 else min(m, n) * rr * mb
        moments += max(m, n) * rr * 2 * mb
    rest = s.n_rest * ctx.adam_bytes(prec) + s.n_proj * ctx.master_bytes(prec)
    return [Term("optimizer", "GaLore projectors", projector // ctx.shard_optimizer,
                 "fp32: the whole min(m,n)^2 SVD factor (galore_torch keeps a view of it); else min(m,n) x r"),
            Term("optimizer", "GaLore moments + AdamW of the rest", (moments + rest) // ctx.shard_optimizer,
                 f"two moments of max(m,n) x min(r,m,n) per projection; AdamW ({ctx.adam_bytes(prec)} B) for "
                 "embedding/norms" + ("; fp32 masters of the projections" if ctx.mixed(prec) else ""))]


def galore_grads(ctx: PlanContext) -> Term:
    return Term("grads", "gradients", ctx.shapes.total * ctx.weight_bytes // ctx.shard_grads, "every weight, weight dtype")


def galore_assumption(ctx: PlanContext) -> str:
    return f"galore: rank min({ctx.rank}, m, n), proj_type std (projector on the smaller side)"


@register_method("galore")
class GaLore(Method):
    """GaLoreAdamW: projections train in their top-r gradient subspace, the rest by AdamW."""

    config_cls = GaLoreConfig
    rank_key = "rank"
    plan_option_names = frozenset({"precision"})  # the planner's precision=mixed|bf16 (from galore.precision)

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """Projectors and low-rank moments, every weight's gradient; at the step AdamW's temporaries and
        the projected-back full-size update of the largest projection."""
        s, prec = ctx.shapes, ctx.options.get("precision")
        m, n = max(s.proj, key=lambda x: x[0] * x[1])
        mixed = ctx.mixed(prec)
        step = ([master_gradients(ctx, s.total)] if mixed else []) + [
            adamw_temporaries(ctx, max([s.embed] + [a * b for a, b in s.proj]), prec),
            Term("activations", "GaLore project-back", 2 * m * n * ctx.moment_bytes(prec) // ctx.shard_optimizer,
                 "the full-size update and its scaled copy")]
        return MemoryTerms(state=galore_state(ctx), grads=[galore_grads(ctx)], step=step, grads_at_step=not mixed,
                           assumptions=[galore_assumption(ctx)] + (["galore with bf16 masters (mixed): UNCHECKED against "
                                                                    "the profiler"] if mixed else []))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.params = self.trainable_parameters(model)
        self.master_weights = MasterWeights.build(self.cfg.precision, model, self.params)
        groups = galore_param_groups(model, self.cfg)
        self.optimizer = _adamw(self.master_weights.substitute(groups) if self.master_weights else groups, self.cfg)
        return self.optimizer

    def step(self) -> dict[str, float]:
        return self.clipped_step(self.params, self.cfg.max_grad_norm)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "optimizer": _plain_state(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        _restore_projectors(self.optimizer)
        self.load_master_weights(state)


@register_method("galore_layerwise")
class GaLoreLayerwise(Method):
    """One GaLoreAdamW per parameter, stepped in its post-accumulate-grad hook (see module doc)."""

    config_cls = GaLoreConfig
    rank_key = "rank"
    plan_option_names = frozenset({"precision"})  # the planner's precision=mixed|bf16 (from galore.precision)
    supports_step_control = False  # each layer's update is applied inside backward: nothing left to scale
    supports_data_parallel = False  # ... and before the ranks' gradients could be summed
    metrics = {"step/params_stepped": "parameters stepped inside backward hooks in the update"}

    @classmethod
    def memory_terms(cls, ctx: PlanContext) -> MemoryTerms:
        """GaLore's state; with one micro-batch per update one gradient at a time (each weight steps in
        its hook and frees its gradient), else every gradient of the earlier micro-batches; nothing is
        left to step after backward."""
        s = ctx.shapes
        notes = [galore_assumption(ctx)]
        if ctx.micro_batches == 1:
            grads = [Term("grads", "one gradient at a time",
                          max(max(m * n for m, n in s.proj), s.embed) * ctx.weight_bytes // ctx.shard_grads,
                          "galore_layerwise steps each weight in its grad hook and frees the gradient")]
        else:
            grads = [galore_grads(ctx)]
            notes.append("galore_layerwise with several micro-batches: the hooks step only in the last micro-batch's "
                         "backward, so the earlier micro-batches' gradients are all alive (as in galore)")
        return MemoryTerms(state=galore_state(ctx), grads=grads, grads_at_step=False, assumptions=notes)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._last = True  # True while the backward of an update's last micro-batch runs
        self._stepped = 0
        self._bad: str | None = None  # the first non-finite tensor met in this update's last backward
        names = {id(p): n for n, p in model.named_parameters()}
        self.master_weights = MasterWeights.build(self.cfg.precision, model, self.trainable_parameters(model))
        for group in galore_param_groups(model, self.cfg):
            for p in group["params"]:
                stepped = self.master_weights.master(p) if self.master_weights else p
                opt = _adamw([{**group, "params": [stepped]}], self.cfg)
                self.optimizers[names[id(p)]] = opt
                p.register_post_accumulate_grad_hook(self._hook(opt, names[id(p)]))
        # The trainer's handle: zero_grad / state_dict go through this method, not a single optimizer.
        self.optimizer = next(iter(self.optimizers.values()))
        return self.optimizer

    def _hook(self, opt: torch.optim.Optimizer, name: str):
        def hook(p: torch.Tensor) -> None:
            if self._last:
                if self._bad is None:
                    self._bad = first_nonfinite([(f"{name}.grad", p.grad)])
                if self._bad is None:
                    mw = self.master_weights
                    if mw is not None:
                        mw.grads_to_masters([p])
                    opt.step()
                    if mw is not None:
                        mw.masters_to_params([p])
                    self._stepped += 1
                p.grad = None
        return hook

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        self._last = last
        if last and self._bad is None and not bool(torch.isfinite(loss.detach()).all()):
            self._bad = "loss"  # nothing steps
        try:
            loss.backward()
        finally:
            self._last = True

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        self._bad = None

    def nonfinite(self) -> str | None:
        """What the hooks met (their parameters' gradients are gone by now), else the gradients held
        from earlier micro-batches."""
        if self._bad is not None:
            stepped = f"; {self._stepped} parameters had stepped before it" if self._stepped else ""
            return self._bad + stepped
        return super().nonfinite()

    def discard(self) -> None:
        self.zero_grad()
        self._stepped = 0

    def step(self) -> dict[str, float]:
        stepped, self._stepped = self._stepped, 0
        return {"step/params_stepped": float(stepped)}

    def state_dict(self) -> dict:
        out = {"optimizers": {n: _plain_state(o.state_dict()) for n, o in self.optimizers.items()}}
        if self.master_weights is not None:
            out["master_weights"] = self.master_weights.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        saved = state["optimizers"]
        if set(saved) != set(self.optimizers):
            raise RuntimeError("galore_layerwise: the checkpoint's parameters differ from the model's")
        for n, opt in self.optimizers.items():
            opt.load_state_dict(saved[n])
            _restore_projectors(opt)
        self.load_master_weights(state)
