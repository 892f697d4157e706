"""A hierarchical model of two methods' per-problem outcomes over seeds × problems, fitted to committed
runs and simulated from: the ground truth of the interval coverage study (``analysis/coverage.py``).

Two methods (the reference r, e.g. dense, and the other o, e.g. logra), m seeds each, the same n
problems. Outcome x[k, s, p] ∈ {0, 1} of method k's run with seed s on problem p (greedy pass@1):

    x[k, s, p] ~ Bernoulli(σ(α_k + u[k, s] + a_p + [k = o] · c_p)),
    a_p ~ N(0, σ_a²)     the problem's difficulty (logit), shared by both methods,
    c_p ~ N(0, σ_c²)     the problem's extra logit for the other method (method × problem),
    u[k, s] ~ N(0, σ_u²) the seed's shift of method k's run, independent across methods and seeds,

σ the logistic function; given (u, a, c) the outcomes are independent: the Bernoulli draw is the
seed × problem noise. The estimands are population means, over seeds and problems:

    A_k = E[σ(α_k + u + a + [k = o] c)] = ∫ σ(α_k + τ_k z) φ(z) dz,  τ_r² = σ_u² + σ_a², τ_o² = τ_r² + σ_c²,
    Δ = A_o − A_r,

by Gauss–Hermite quadrature; :meth:`OutcomeModel.fixed_problems` gives the same means over a drawn
set of problems (the seeds' population only), the other estimand the study reports.

Fit (:func:`fit`): the six run intercepts β[k, s] = α_k + u[k, s] are free parameters with (σ_a, σ_c),
maximizing the marginal likelihood over (a_p, c_p) (a K × K Gauss–Hermite grid per problem; L-BFGS on
the log-likelihood). Then α_k = mean_s β[k, s] and σ_u² = the within-method variance of the β[k, s],
pooled over the two methods (2(m − 1) degrees of freedom: with 3 seeds per method an uncertain value,
which is why the study also runs σ_u halved and doubled). The intercepts' own estimation error (about
0.1 on the logit scale at n = 500) is left in σ_u (it inflates it slightly).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

NODES = 40  # Gauss–Hermite nodes for the 1-D expectations
FIT_NODES = 24  # per dimension for the fit's 2-D (a, c) integral


def _hermite(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of ∫ f(z) φ(z) dz ≈ Σ w_i f(z_i) (probabilists' Hermite, weights summing to 1)."""
    z, w = np.polynomial.hermite_e.hermegauss(k)
    return z, w / w.sum()


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=float)))


@dataclass(frozen=True)
class OutcomeModel:
    """The fitted parameters (module docstring); ``alpha`` = (α_r, α_o)."""

    alpha_ref: float
    alpha_other: float
    sigma_seed: float
    sigma_problem: float
    sigma_method_problem: float

    def scaled(self, seed_factor: float) -> "OutcomeModel":
        """The same model with σ_u × ``seed_factor`` (a sensitivity scenario)."""
        return OutcomeModel(self.alpha_ref, self.alpha_other, self.sigma_seed * seed_factor, self.sigma_problem,
                            self.sigma_method_problem)

    def accuracy(self, other: bool) -> float:
        """A_k, the population accuracy of the reference (``other`` False) or the other method."""
        z, w = _hermite(NODES)
        tau2 = self.sigma_seed**2 + self.sigma_problem**2 + (self.sigma_method_problem**2 if other else 0.0)
        alpha = self.alpha_other if other else self.alpha_ref
        return float(w @ sigmoid(alpha + math.sqrt(tau2) * z))

    def difference(self) -> float:
        """Δ = A_o − A_r over the population of seeds and problems."""
        return self.accuracy(True) - self.accuracy(False)

    def fixed_problems(self, a: np.ndarray, c: np.ndarray) -> tuple[float, float]:
        """(A_r, Δ) averaged over the given problems' (a_p, c_p), expected over seeds only."""
        z, w = _hermite(NODES)
        u = self.sigma_seed * z[:, None]
        ref = w @ sigmoid(self.alpha_ref + u + a[None, :])
        other = w @ sigmoid(self.alpha_other + u + a[None, :] + c[None, :])
        return float(ref.mean()), float((other - ref).mean())

    def simulate(self, rng: np.random.Generator, seeds: int, problems: int, replicates: int) -> dict:
        """``replicates`` data sets: ``ref`` and ``other`` (replicates, seeds, problems) int8 outcomes,
        and per replicate the fixed-problems truths ``fixed_accuracy`` and ``fixed_difference``."""
        a = rng.normal(0.0, self.sigma_problem, (replicates, problems))
        c = rng.normal(0.0, self.sigma_method_problem, (replicates, problems))
        u = rng.normal(0.0, self.sigma_seed, (2, replicates, seeds))
        ref = rng.random((replicates, seeds, problems)) < sigmoid(self.alpha_ref + u[0][:, :, None] + a[:, None, :])
        other = rng.random((replicates, seeds, problems)) < sigmoid(
            self.alpha_other + u[1][:, :, None] + (a + c)[:, None, :])
        truths = np.array([self.fixed_problems(a[i], c[i]) for i in range(replicates)])
        return {"ref": ref.astype(np.int8), "other": other.astype(np.int8),
                "fixed_accuracy": truths[:, 0], "fixed_difference": truths[:, 1]}

    def as_dict(self) -> dict:
        return asdict(self)


def fit(ref, other, nodes: int = FIT_NODES) -> OutcomeModel:
    """Maximum marginal likelihood of the model from two methods' outcomes ``ref``, ``other``
    (seeds × problems each, the same problems in the same column order; module docstring)."""
    import torch

    xr = torch.as_tensor(np.asarray(ref), dtype=torch.float64)
    xo = torch.as_tensor(np.asarray(other), dtype=torch.float64)
    if xr.ndim != 2 or xo.ndim != 2 or xr.shape[1] != xo.shape[1] or min(xr.shape[0], xo.shape[0]) < 2:
        raise ValueError(f"need (seeds >= 2, problems) outcomes of both methods on the same problems, got "
                         f"{tuple(xr.shape)} and {tuple(xo.shape)}")
    z, w = _hermite(nodes)
    z, logw = torch.as_tensor(z), torch.as_tensor(np.log(w))

    def logit(x):
        p = x.mean(dim=1).clamp(0.02, 0.98)
        return torch.log(p / (1 - p))

    beta_r = logit(xr).clone().requires_grad_(True)
    beta_o = logit(xo).clone().requires_grad_(True)
    log_sa = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    log_sc = torch.tensor(-0.5, dtype=torch.float64, requires_grad=True)
    params = [beta_r, beta_o, log_sa, log_sc]

    def bernoulli(x, eta):  # log P(x | logit eta), summed over the seeds (dim 0)
        return (x * torch.nn.functional.logsigmoid(eta) + (1 - x) * torch.nn.functional.logsigmoid(-eta)).sum(0)

    def negative_loglik():
        sa, sc = log_sa.exp(), log_sc.exp()
        a = sa * z  # (K,)
        ll_r = bernoulli(xr[:, :, None], beta_r[:, None, None] + a[None, None, :])  # (n, K_a)
        eta_o = beta_o[:, None, None, None] + a[None, None, :, None] + (sc * z)[None, None, None, :]
        ll_o = bernoulli(xo[:, :, None, None], eta_o)  # (n, K_a, K_c)
        joint = ll_r[:, :, None] + ll_o + logw[None, :, None] + logw[None, None, :]
        return -torch.logsumexp(joint.reshape(joint.shape[0], -1), dim=1).sum()

    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = negative_loglik()
        loss.backward()
        return loss

    opt.step(closure)
    br, bo = beta_r.detach().numpy(), beta_o.detach().numpy()
    within = np.concatenate([br - br.mean(), bo - bo.mean()])
    sigma_seed = math.sqrt((within**2).sum() / (br.size + bo.size - 2))
    return OutcomeModel(float(br.mean()), float(bo.mean()), sigma_seed, log_sa.exp().item(), log_sc.exp().item())
