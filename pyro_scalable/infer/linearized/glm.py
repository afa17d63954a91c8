r"""The linearised (GLM) predictive: :math:`f(x) \sim \mathcal N(f_* + J(\bar\theta - \theta_*),\ J \Sigma J^\top)`.

:math:`\Sigma` is a posterior covariance over the flat parameters, known either as an operator or by draws; the
Jacobian :math:`J` at the test points is never formed over all weights except where :math:`\Sigma` is dense:

* by draws :math:`\zeta_j` (sample-then-optimise, Laplace's ``"sampled"``): :math:`J\Sigma J^\top \approx
  \frac1K\sum_j (J\zeta_j)(J\zeta_j)^\top`, with :math:`J\zeta_j` from one batched Jacobian-vector product (the
  mean shift :math:`J(\bar\theta - \theta_*)` rides in the same product), :func:`draws_moments`;
* by a covariance-vector product :math:`v \mapsto \Sigma v` applied to the rows of :math:`J`:
  :func:`covariance_from_products` (a dense :math:`\Sigma`, e.g. a Cholesky solve);
* by structure: each Laplace curvature structure contracts :math:`J`'s layer pieces
  (:class:`~pyro_scalable.infer.linearized.jacobians.OutputJacobian`) with its own factors.

:func:`glm_predictive` walks the test points in chunks and turns the moments into the law of ``y`` with the
likelihood (probit or Monte Carlo for classification; a Normal adds its noise). :func:`linearized_draws` samples
``y`` instead: one draw per posterior draw :math:`\theta_j`, at :math:`f_* + J(\theta_j - \theta_*)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch
from pyro_scalable.infer.linearized.likelihoods import Likelihood, LinkApprox
from pyro_scalable.infer.linearized.network import NetworkFunction

__all__ = [
    "GLMPredictive",
    "covariance_from_draws",
    "covariance_from_products",
    "draws_moments",
    "glm_predictive",
    "linearized_draws",
    "linearized_posterior_predictive",
]

# draws per batched JVP: vmap over tangents keeps one copy of the network's activations per draw
_DRAWS_PER_JVP = 64

Moments = tuple[Tensor, Tensor, Likelihood]  # mean (points, outputs), covariance (.., outputs), likelihood


class _GLMPredictiveFields(NamedTuple):
    mean: Tensor  # (points, outputs)
    covariance: Tensor  # (points, outputs, outputs)
    distribution: Any  # a Pyro distribution shaped like the observed site


class GLMPredictive(_GLMPredictiveFields):
    """The linearised predictive at some inputs: the outputs' mean and covariance, and the law of ``y``."""

    __slots__ = ()

    def __new__(cls, mean: Tensor, covariance: Tensor, distribution: Any):
        if not isinstance(mean, Tensor) or mean.dim() != 2:
            raise ValueError(f"mean must be a (points, outputs) tensor, got {_describe(mean)}.")
        if not isinstance(covariance, Tensor) or covariance.shape != mean.shape + mean.shape[-1:]:
            raise ValueError(
                f"covariance must be a tensor of shape (points, outputs, outputs) = "
                f"{tuple(mean.shape + mean.shape[-1:])}, got {_describe(covariance)}."
            )
        return super().__new__(cls, mean, covariance, distribution)


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def covariance_from_draws(products: Tensor) -> Tensor:
    r""":math:`\frac1K\sum_j (J\zeta_j)(J\zeta_j)^\top` from ``products`` :math:`J\zeta_j`, ``(K, points, outputs)``."""
    return torch.einsum("kpm,kpn->pmn", products, products) / products.shape[0]


def covariance_from_products(rows: Tensor, covariance_vp: Callable[[Tensor], Tensor]) -> Tensor:
    r""":math:`J\Sigma J^\top` from the Jacobian rows ``(points, outputs, d)`` and :math:`v \mapsto \Sigma v`."""
    return rows @ covariance_vp(rows).mT


def draws_moments(
    net: NetworkFunction, theta: Tensor, draws: Tensor, batch: Batch, shift: Tensor | None = None
) -> Moments:
    r"""Mean :math:`f_* + J\,\mathrm{shift}` and covariance of zero-mean ``draws`` ``(K, d)`` on ``batch``."""
    rows = draws if shift is None else torch.cat([shift.unsqueeze(0), draws])
    f, products = net.jvp(theta, rows, batch)  # (rows, points, outputs)
    if shift is not None:
        f, products = f + products[0], products[1:]
    return f.detach(), covariance_from_draws(products).detach(), net.outputs(theta, batch).likelihood


def glm_predictive(
    batches: Iterable[Batch],
    moments: Callable[[Batch], Moments],
    *,
    link_approx: LinkApprox,
    num_samples: int,
    generator: torch.Generator | None,
    fitted: Callable[[Likelihood], Likelihood] | None = None,
) -> GLMPredictive:
    """The predictive over every point of ``batches``, from the per-chunk ``moments`` (and a ``fitted`` noise)."""
    means, covariances, likelihoods = [], [], []
    for batch in batches:
        mean, covariance, likelihood = moments(batch)
        means.append(mean)
        covariances.append(covariance.detach())
        likelihoods.append(likelihood)
    mean, covariance = torch.cat(means), torch.cat(covariances)
    likelihood = Likelihood.concatenate(likelihoods)
    if fitted is not None:
        likelihood = fitted(likelihood)
    return GLMPredictive(mean, covariance, likelihood.predictive(mean, covariance, link_approx, num_samples, generator))


def linearized_draws(
    net: NetworkFunction,
    theta: Tensor,
    batches: Iterable[Batch],
    *,
    fitted: Callable[[Likelihood], Likelihood] | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""One draw of the observed site per row of ``theta`` (flat draws, ``(S, d)``) through the linearised network.

    Returns ``(S, *site shape)`` over the points of ``batches`` (chunks along the site's first dim), each draw at
    :math:`f(x, \theta_*) + J(x)(\theta_j - \theta_*)`, the likelihood ``fitted`` (e.g. a Normal's tuned noise).
    """
    chunks = []
    with torch.no_grad():
        for batch in batches:
            likelihood = net.outputs(net.theta_star, batch).likelihood
            likelihood = fitted(likelihood) if fitted is not None else likelihood
            parts = []
            for start in range(0, theta.shape[0], _DRAWS_PER_JVP):
                f, tangent = net.jvp(net.theta_star, theta[start : start + _DRAWS_PER_JVP] - net.theta_star, batch)
                parts.append(_sample(likelihood.distribution(f + tangent), generator))
            chunks.append(torch.cat(parts))
    return torch.cat(chunks, dim=1)


def linearized_posterior_predictive(
    net: NetworkFunction,
    theta: Tensor,
    samples: dict[str, Tensor],
    batches: Iterable[Batch],
    *,
    return_sites: Sequence[str] | None = None,
    fitted: Callable[[Likelihood], Likelihood] | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """``return_sites`` (default: the observed site) from flat draws ``theta`` and their constrained ``samples``.

    The observed site is drawn by :func:`linearized_draws`; a latent site gives its posterior draws.
    """
    sites = [net.site] if return_sites is None else list(return_sites)
    if isinstance(return_sites, str) or not all(isinstance(name, str) for name in sites):
        raise TypeError(f"return_sites must be a list of site names or None, got {return_sites!r}.")
    unknown = [name for name in sites if name != net.site and name not in samples]
    if unknown:
        raise ValueError(f"return_sites {unknown} are neither the observed site '{net.site}' nor latent.")
    out = {name: samples[name] for name in sites if name != net.site}
    if net.site in sites:
        out[net.site] = linearized_draws(net, theta, batches, fitted=fitted, generator=generator)
    return out


def _sample(fn: Any, generator: torch.Generator | None) -> Tensor:
    if generator is None:
        return fn.sample()
    # torch.distributions take no generator: draw under a fork of the global one, seeded from ours
    device = generator.device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(int(torch.randint(0, 2**62, (), generator=generator, device=device)))
        return fn.sample()
