r"""Step-size warm-up: choose the step size from the estimated curvature and gradient noise.

During warm-up each step also measures, on its own minibatch,

* the **gradient noise** :math:`\hat V` (diagonal, from per-example gradients; see :mod:`.base`), averaged over
  the warm-up steps with an exponential moving average, and
* the **curvature** :math:`\lambda = \max|\mathrm{eig}(S^{1/2} H S^{1/2})|` of the minibatch Hessian
  :math:`H` of the negative log joint in the sampler's metric :math:`S` (the preconditioner or inverse mass;
  :math:`S = I` for plain SGLD/SGHMC), by power iteration with Hessian-vector products (``torch.func.jvp`` of
  the gradient), one iteration per warm-up step after a few at the first.

Each sampler turns the two into a step size with a stability bound (:math:`\epsilon\lambda \le c` for Langevin,
:math:`\epsilon\sqrt\lambda \le c` for the momentum samplers, which keeps the discretisation bias of the
stationary variance to a few per cent) and a **noise bound**: the gradient noise a step adds must stay below a
fraction :math:`\rho = 1/2` of the noise the sampler is meant to inject in every coordinate, so that the
noise correction is possible and the draws are calibrated (for SGLD :math:`\epsilon S_j \hat V_j \le 2 T \rho`).
At the end of warm-up the step size is frozen; the values chosen are in ``sample_stats``.

**Burn-in.** The first part of warm-up (the driver's ``burn_in`` steps) only has to bring the chains to the
typical set, so it uses the stability bound alone: a larger step, with the gradient noise uncorrected and the
chains spread too wide around the mode. The calibrated rest of warm-up starts each chain at the moving average of
its burn-in positions (:func:`settle`; momenta zeroed): near the mode and *narrower* than the posterior, which
the calibrated sampler widens to the posterior at its own relaxation rate — from a cloud many times too wide it
would have to shrink instead, which at a small minibatch takes several times longer.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.infer.autodiff import hvp
from pyro_scalable.infer.sgmcmc.base import GradientEstimate, Latents, LogPosteriorFn

__all__ = [
    "NOISE_FRACTION",
    "Adaptation",
    "hessian_product",
    "init_adaptation",
    "momentum_step_size",
    "settle",
    "noise_bound",
    "observe",
    "power_iterations",
]

NOISE_FRACTION = 0.5  # ρ: the largest share of the wanted noise that the gradient noise may supply
_FIRST_ITERATIONS = 8  # power iterations at the first warm-up step; one per step after it
_WINDOW = 50  # steps: the moving averages forget older warm-up steps at this rate


class Adaptation(NamedTuple):
    """What warm-up has learnt so far. Every field is a tensor (the state of a chain carries it)."""

    step_size: Tensor  # 0-d: the step size in use (NaN until the first warm-up step when it is chosen)
    noise: Latents  # moving average of the diagonal gradient-noise variance
    curvature: Tensor  # 0-d moving average of the largest |eigenvalue| of the minibatch Hessian in the metric
    direction: Latents  # the power-iteration vector (unit norm over all sites)
    count: Tensor  # 0-d: warm-up steps seen
    centre: Latents  # moving average of the burn-in's positions: where the calibrated half of warm-up starts
    burning: Tensor  # 0-d bool: the last warm-up step was a burn-in step


def init_adaptation(latents: Latents, step_size: Any = None) -> Adaptation:
    """A fresh record: ``step_size`` is the user's constant, or NaN where warm-up must choose it."""
    first = next(iter(latents.values()))
    value = float("nan") if step_size is None or callable(step_size) else float(step_size)
    zero = torch.zeros((), dtype=first.dtype, device=first.device)
    direction = {name: _spread(x) for name, x in latents.items()}
    norm = torch.sqrt(sum(v.square().sum() for v in direction.values()))
    direction = {name: v / norm for name, v in direction.items()}
    noise = {name: torch.zeros_like(x) for name, x in latents.items()}
    centre = {name: x.clone() for name, x in latents.items()}
    return Adaptation(zero + value, noise, zero, direction, zero.to(torch.int64), centre, zero.to(torch.bool))


def _spread(x: Tensor) -> Tensor:
    # a fixed, irregular start for the power iteration: neither random (no generator needed) nor special
    # (a constant vector can be orthogonal to the top eigenvector of a symmetric problem)
    k = torch.arange(x.numel(), dtype=x.dtype, device=x.device).reshape(x.shape)
    return torch.cos(1.3 * k + 0.7) + 1.5 + 0.0 * x


def power_iterations(warmup_step: int) -> int:
    """Hessian-vector products warm-up step ``warmup_step`` spends on the curvature: a few first, then one."""
    return _FIRST_ITERATIONS if warmup_step == 0 else 1


def hessian_product(
    log_posterior_fn: LogPosteriorFn,
    latents: Latents,
    batch: Any,
    adaptation: Adaptation,
    metric: Latents | None,
    *,
    iterations: int,
) -> Latents:
    """:math:`S^{1/2} H S^{1/2} v` on ``batch`` after ``iterations - 1`` power iterations from the stored vector."""
    direction = adaptation.direction
    for k in range(iterations):
        product = _metric_hvp(log_posterior_fn, latents, batch, direction, metric)
        if k + 1 < iterations:
            direction = _normalised(product)
    return product


def observe(adaptation: Adaptation, estimate: GradientEstimate) -> Adaptation:
    """Fold a step's noise estimate (and, in warm-up, its Hessian-vector product) into the moving averages.

    The noise average goes on through sampling (the noise correction uses it: a moving average over about
    ``_WINDOW`` steps is steadier than one minibatch's estimate, whose clipping at 0 would bias the correction);
    the curvature is measured only in warm-up.
    """
    if not estimate.noise_variance:
        return adaptation
    count = adaptation.count + 1
    weight = torch.clamp(1.0 / count.to(adaptation.curvature.dtype), min=1.0 / _WINDOW)
    keep = estimate.diverging
    noise = {
        name: torch.where(keep, v, v + weight * (estimate.noise_variance[name] - v))
        for name, v in adaptation.noise.items()
    }
    curvature, direction = adaptation.curvature, adaptation.direction
    if estimate.hessian_product:
        curvature_now = torch.sqrt(sum(p.square().sum() for p in estimate.hessian_product.values()))
        finite = torch.isfinite(curvature_now) & (curvature_now > 0) & ~keep
        curvature = torch.where(finite, curvature + weight * (curvature_now - curvature), curvature)
        turned = _normalised(estimate.hessian_product)
        direction = {name: torch.where(finite, turned[name], d) for name, d in direction.items()}
    return adaptation._replace(noise=noise, curvature=curvature, direction=direction, count=count)


def _metric_hvp(
    log_posterior_fn: LogPosteriorFn, latents: Latents, batch: Any, direction: Latents, metric: Latents | None
) -> Latents:
    root = {name: torch.sqrt(m) for name, m in metric.items()} if metric is not None else None
    tangent = {name: v * root[name] for name, v in direction.items()} if root is not None else direction
    (product,) = hvp(lambda z: log_posterior_fn(z, batch), (latents,), (tangent,))
    if root is not None:
        product = {name: p * root[name] for name, p in product.items()}
    return product


def _normalised(vector: Latents) -> Latents:
    norm = torch.sqrt(sum(p.square().sum() for p in vector.values()))
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return {name: p / safe for name, p in vector.items()}


def noise_bound(noise: Latents, metric: Latents | None, target: Tensor) -> Tensor:
    """The largest ε with ε · S_j · V_j ≤ ρ · ``target`` in every coordinate (inf where there is no noise)."""
    scaled = [(v * metric[name] if metric is not None else v).max() for name, v in noise.items()]
    largest = torch.stack(scaled).max()
    return torch.where(largest > 0, NOISE_FRACTION * target / largest, torch.full_like(largest, math.inf))


_LEAST_DECAY = 0.5  # a momentum sampler's per-step decay 1 - ε α / m stays at or above this
_DEFAULT_DECAY = 0.9  # the friction chosen where the gradient noise does not ask for more (SGD's momentum 0.9)


def momentum_step_size(
    adaptation: Adaptation, friction: float | None, temp: Tensor, masses: Latents | None, curvature_bound: float
) -> tuple[Tensor, Tensor]:
    """ε (and the friction α where not given) for a momentum sampler with injected noise 2αεT (SGHMC, SGNHT).

    ε ≤ ``curvature_bound``/√λ; the gradient noise must stay within ρ of 2αεT, i.e. α ≥ ε V̄ₘₐₓ / (2Tρ); with
    ``friction=None`` α is the larger of that and a per-step decay of 0.9, and ε small enough that α leaves a decay
    of at least 0.5 in every coordinate; a given friction instead bounds ε. ``masses=None`` is the unit mass.
    """
    eps = curvature_bound / torch.sqrt(adaptation.curvature)
    if masses is None:
        least_mass = mean_mass = torch.ones_like(eps)
    else:
        least_mass = torch.stack([m.min() for m in masses.values()]).min()
        mean_mass = torch.cat([m.reshape(-1) for m in masses.values()]).mean()
    largest_noise = torch.stack([v.max() for v in adaptation.noise.values()]).max()
    noise_rate = largest_noise / (2.0 * temp * NOISE_FRACTION)  # α must be at least ε times this
    noise_rate = torch.where(temp > 0, noise_rate, torch.zeros_like(noise_rate))
    if friction is None:
        eps = torch.minimum(eps, torch.sqrt((1.0 - _LEAST_DECAY) * least_mass / noise_rate))
        alpha = torch.maximum(eps * noise_rate, (1.0 - _DEFAULT_DECAY) * mean_mass / eps)
        alpha = torch.minimum(alpha, (1.0 - _LEAST_DECAY) * least_mass / eps)
        return eps, alpha
    alpha = torch.full_like(eps, float(friction))
    eps = torch.minimum(eps, alpha / noise_rate)
    return torch.minimum(eps, (1.0 - _LEAST_DECAY) * least_mass / alpha), alpha


_CENTRE_WINDOW = 20  # steps: the burn-in's position average forgets older positions at this rate


def settle(
    adaptation: Adaptation, latents: Latents, burn_in: bool, adapting: bool
) -> tuple[Latents, Tensor, Adaptation]:
    """Average the burn-in's positions; at the first calibrated warm-up step, move the chain to that average.

    Returns the (possibly moved) latents, whether the chain moved (0-d bool: zero the momenta then), and the
    updated record. Outside warm-up (``adapting`` False) nothing changes.
    """
    no = torch.zeros((), dtype=torch.bool, device=adaptation.count.device)
    if not adapting:
        return latents, no, adaptation
    if burn_in:
        weight = torch.clamp(1.0 / adaptation.count.to(adaptation.curvature.dtype), min=1.0 / _CENTRE_WINDOW)
        centre = {name: c + weight * (latents[name] - c) for name, c in adaptation.centre.items()}
        return latents, no, adaptation._replace(centre=centre, burning=~no)
    jump = adaptation.burning
    moved = {name: torch.where(jump, adaptation.centre[name], x) for name, x in latents.items()}
    return moved, jump, adaptation._replace(burning=no)
