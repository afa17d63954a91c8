r"""The curvature warm-up measures: the largest eigenvalue of the minibatch Hessian in the sampler's metric.

Warm-up (:mod:`.adaptation`) chooses a step size from :math:`\lambda = \max|\mathrm{eig}(S^{1/2} H S^{1/2})|`,
with :math:`H` the minibatch Hessian of the negative log joint and :math:`S` the sampler's metric (preconditioner or
inverse mass; :math:`S = I` for plain SGLD/SGHMC). It estimates :math:`\lambda` by power iteration: from a
direction :math:`v`, the product :math:`u = S^{1/2} H S^{1/2} v` (a Hessian-vector product, the vjp of the gradient:
two backward passes), then :math:`v \leftarrow u / \lVert u\rVert`; :math:`\lVert u\rVert \to \lambda` as
:math:`v` turns to the top eigenvector. :func:`power_iterations` spends a few products at the first warm-up step,
then one on every :data:`~.base.CURVATURE_EVERY`-th step, each continuing from the last step's direction (the
minibatch and the point move little in a few steps). With ``chains=True`` every chain's product comes from one pass
over all chains (:func:`~pyro_scalable.infer.gradients.batched.batched_hvp`: the Hessian of the sum of the chains'
log densities is block-diagonal), normalised chain by chain.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pyro_scalable.infer.autodiff import hvp
from pyro_scalable.infer.gradients import MinibatchDensity
from pyro_scalable.infer.gradients.batched import batched_hvp
from pyro_scalable.infer.sgmcmc.base import CURVATURE_EVERY, Latents

__all__ = [
    "chainwise",
    "curvature_measurements",
    "hessian_product",
    "normalised",
    "power_iterations",
    "start_direction",
]

_FIRST_ITERATIONS = 8  # power iterations at the first warm-up step; then one on every CURVATURE_EVERY-th step


def power_iterations(warmup_step: int) -> int:
    """Hessian-vector products warm-up step ``warmup_step`` spends on the curvature: a few, then one every 4th step."""
    if warmup_step == 0:
        return _FIRST_ITERATIONS
    return int(warmup_step % CURVATURE_EVERY == 0)


def curvature_measurements(count: Tensor) -> Tensor:
    """How many curvature measurements :func:`power_iterations` has made in the first ``count`` warm-up steps.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.sgmcmc.curvature import curvature_measurements
        >>> curvature_measurements(torch.tensor([1, 4, 5, 9]))  # steps 0, 4, 8 measure
        tensor([1, 1, 2, 3])

    """
    return torch.div(count - 1, CURVATURE_EVERY, rounding_mode="floor") + 1


def hessian_product(
    log_posterior_fn: MinibatchDensity,
    latents: Latents,
    batch: Any,
    direction: Latents,
    metric: Latents | None,
    *,
    iterations: int,
    chains: bool = False,
) -> Latents:
    """:math:`S^{1/2} H S^{1/2} v` on ``batch`` after ``iterations - 1`` power iterations from ``direction``.

    ``chains``: every chain's at once (a leading chain dimension), normalised per chain.
    """
    for k in range(iterations):
        product = _metric_hvp(log_posterior_fn, latents, batch, direction, metric, chains)
        if k + 1 < iterations:
            direction = normalised(product, chains)
    return product


def start_direction(x: Tensor) -> Tensor:
    """The power iteration's start: fixed and irregular.

    Neither random (no generator needed) nor special (a constant vector can be orthogonal to the top eigenvector of a
    symmetric problem).
    """
    k = torch.arange(x.numel(), dtype=x.dtype, device=x.device).reshape(x.shape)
    return torch.cos(1.3 * k + 0.7) + 1.5 + 0.0 * x


def _metric_hvp(
    log_posterior_fn: MinibatchDensity,
    latents: Latents,
    batch: Any,
    direction: Latents,
    metric: Latents | None,
    chains: bool = False,
) -> Latents:
    root = {name: torch.sqrt(m) for name, m in metric.items()} if metric is not None else None
    tangent = {name: v * root[name] for name, v in direction.items()} if root is not None else direction
    if chains:
        product = batched_hvp(log_posterior_fn, latents, batch, tangent)
    else:
        (product,) = hvp(lambda z: log_posterior_fn(z, batch), (latents,), (tangent,))
    if root is not None:
        product = {name: p * root[name] for name, p in product.items()}
    return product


def normalised(vector: Latents, chains: bool = False) -> Latents:
    """``vector`` over its norm (``chains``: each chain's over its own)."""
    lead = 1 if chains else 0
    norm = torch.sqrt(sum(p.square().reshape(*p.shape[:lead], -1).sum(-1) for p in vector.values()))
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return {name: p / chainwise(safe, p) for name, p in vector.items()}


def chainwise(x: Tensor, like: Tensor) -> Tensor:
    """A stacked per-chain ``x`` ``(C, *s)`` shaped to broadcast per chain against ``like`` ``(C, ...)``."""
    return x.reshape(x.shape[:1] + (1,) * (like.dim() - x.dim()) + x.shape[1:])
