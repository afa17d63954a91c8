r"""Is a Gaussian approximation the Laplace approximation at its own mean? A check on the full data's curvature.

SWAG (and any engine that ends with a Gaussian :math:`\mathcal N(m, \Sigma)` over the unconstrained latents) is
judged here against the full data's log joint :math:`\ell` at :math:`m`: with :math:`g = \nabla\ell(m)` and
:math:`H = -\nabla^2\ell(m)`,

* **the mean**: :math:`s = H^{-1}g` is the Newton step to the mode. Where the posterior is near-Gaussian its mean is
  within a few hundredths of an sd of the mode, so :math:`\max_j |s_j| / \sqrt{(H^{-1})_{jj}}`, the step per
  latent in the Laplace posterior's sds, is how far :math:`m` is from where a Gaussian approximation belongs;
* **the spread**: with :math:`\Sigma = LL^\top`, the eigenvalues :math:`\mu` of :math:`L^\top H L` are all 1 where
  :math:`\Sigma = H^{-1}`; along the :math:`\mu`'s (generalised) eigenvector the approximation's sd is
  :math:`\sqrt\mu` times the Laplace posterior's, and every marginal sd's ratio lies between the smallest and the
  largest :math:`\sqrt\mu`.

Up to :data:`~pyro_scalable.infer.mode_search.EXACT_NEWTON` latents both are exact, from the dense full-data Hessian
(one pass of :math:`d` Hessian-vector products per chunk of the data). Above, the spread is compared on a subspace
:math:`W` of :data:`PROBES` directions (half the approximation's widest, from its low-rank factor, half random):
with :math:`W = \Sigma U` (:math:`U` orthonormal), the generalised Rayleigh-Ritz values of the pencil
:math:`(W^\top H W, U^\top\Sigma U)` (:math:`U^\top\Sigma U = W^\top\Sigma^{-1}W`) lie within the :math:`\mu`'s range
(Cauchy's interlacing), and
the mean's step is conjugate gradients' first iterate preconditioned by :math:`\Sigma`,
:math:`s \approx \alpha\Sigma g`, :math:`\alpha = g^\top\Sigma g / g^\top\Sigma H\Sigma g` (exact where
:math:`\Sigma = H^{-1}`), in the approximation's own sds. The probed path costs one batched pass of
:data:`PROBES` + 1 Hessian-vector products.

Where :math:`H` is not positive definite at :math:`m` (not a mode: a saddle or a ridge) there is no Laplace
approximation to compare with, and the check says so. A network's Hessian at SWAG's mean is rarely definite (its
flat and negative directions are why SWAG is used there), so on the probed path that figure is recorded only, and the
spread is compared only where the probed subspace is positively curved.

The reference is Laplace's: a posterior far from Gaussian (a skewed scale) has sds that differ from it by more than
the tolerances; on the regressions and GLMs the engines serve, they agree to a few hundredths.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.minibatches import points_per_chunk
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.full_data import full_data_gradient, full_data_hessian, full_data_hvps
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.mode_search import EXACT_NEWTON

__all__ = ["MEAN_TOLERANCE", "PROBES", "SPREAD_TOLERANCE", "ApproximationWarning", "GaussianCheck", "check_gaussian"]

MEAN_TOLERANCE = 0.2  # Laplace sds between the mean and the mode
SPREAD_TOLERANCE = (0.8, 1.25)  # the range an sd ratio to the Laplace posterior's may take
PROBES = 8  # directions of the probed spread check (above EXACT_NEWTON latents)


class ApproximationWarning(UserWarning):
    """A Gaussian approximation that is not the posterior's Laplace approximation at its mean (this module's check)."""


class GaussianCheck(NamedTuple):
    """The check's figures (module docstring)."""

    mean_error: float  # the largest Newton step per latent, in sds (nan where H is not positive definite)
    spread_low: float  # the smallest and largest sqrt(mu): sd ratios to the Laplace posterior's
    spread_high: float
    positive_definite: bool  # whether H is (on the probed subspace, where probed)
    exact: bool  # dense (every direction) or probed
    num_params: int

    @property
    def passed(self) -> bool:
        low, high = SPREAD_TOLERANCE
        return (
            self.positive_definite
            and self.mean_error <= MEAN_TOLERANCE
            and low <= self.spread_low
            and self.spread_high <= high
        )

    def describe(self) -> str:
        """The figures in words, for a warning."""
        if not self.positive_definite:
            return (
                "the full data's log joint is not concave at its mean (its Hessian there is not negative definite: a "
                "saddle or a ridge, not a mode), so it is no Gaussian approximation of the posterior there"
            )
        where = "in every direction" if self.exact else f"on {PROBES} directions probed of {self.num_params}"
        return (
            f"against the full data's curvature at its mean ({where}), its sds are {self.spread_low:.3g}-"
            f"{self.spread_high:.3g} times the Laplace posterior's and its mean is {self.mean_error:.3g} sds from the "
            f"mode (within {SPREAD_TOLERANCE[0]}-{SPREAD_TOLERANCE[1]} and {MEAN_TOLERANCE} expected)"
        )


def check_gaussian(
    bridge: ModelBridge,
    layout: ParameterLayout,
    mean: Tensor,
    diagonal: Tensor,
    factor: Tensor,
    *,
    generator: torch.Generator | None = None,
) -> GaussianCheck:
    """The module docstring's figures for the Gaussian over the flat unconstrained latents of ``bridge``.

    Its mean is ``mean`` ``(d,)`` and its covariance ``diag(diagonal) + factor factorᵀ`` (``factor`` ``(d, K)``).
    """
    sites = bridge.sites
    dtype = next(iter(sites.values())).dtype

    def unflatten(flat: Tensor):
        return layout.unflatten(flat.to(dtype))

    size = points_per_chunk(bridge, None)
    x = mean.detach().double()
    d = x.numel()
    g = layout.flatten(full_data_gradient(bridge, unflatten(x)).gradient).double()
    diagonal, factor = diagonal.double(), factor.double()
    if d <= EXACT_NEWTON:
        return _dense(-full_data_hessian(bridge, unflatten, x, size, None), g, diagonal, factor)
    return _probed(bridge, unflatten, x, g, diagonal, factor, size, generator)


def _dense(h: Tensor, g: Tensor, diagonal: Tensor, factor: Tensor) -> GaussianCheck:
    d = len(g)
    sigma = torch.diag(diagonal) + factor @ factor.T
    eigenvalues, vectors = torch.linalg.eigh(h)
    if float(eigenvalues.min()) <= 0:
        return GaussianCheck(math.nan, math.nan, math.nan, False, True, d)
    inverse = (vectors / eigenvalues) @ vectors.T
    step = inverse @ g
    mean_error = float((step.abs() / inverse.diagonal().sqrt()).max())
    jitter = 1e-12 * float(sigma.diagonal().max()) * torch.eye(d, dtype=sigma.dtype, device=sigma.device)
    root = torch.linalg.cholesky(sigma + jitter)
    mu = torch.linalg.eigvalsh(root.T @ h @ root).clamp_min(0.0).sqrt()
    return GaussianCheck(mean_error, float(mu.min()), float(mu.max()), True, True, d)


def _probed(bridge, unflatten, x, g, diagonal, factor, size, generator) -> GaussianCheck:
    d = len(g)
    k = min(PROBES, d)
    half = min(k // 2, factor.shape[1])
    wide = torch.linalg.svd(factor, full_matrices=False).U[:, :half] if half else factor[:, :0]
    random = torch.randn(d, k - wide.shape[1], dtype=x.dtype, generator=generator, device="cpu").to(x.device)
    u = torch.linalg.qr(torch.cat([wide, random], 1)).Q

    def sigma_times(v: Tensor) -> Tensor:
        return diagonal[:, None] * v + factor @ (factor.T @ v)

    w = sigma_times(u)  # the subspace W = ΣU: WᵀΣ⁻¹W = UᵀΣU needs no inverse of Σ
    sigma_g = sigma_times(g[:, None])[:, 0]
    products = full_data_hvps(bridge, unflatten, x, torch.cat([w, sigma_g[:, None]], 1).T, size).T
    hw, h_sigma_g = -products[:, :k], -products[:, k]
    a = w.T @ hw
    b = u.T @ w
    values, vectors = torch.linalg.eigh(0.5 * (b + b.T))
    keep = values > 1e-12 * float(values.max().clamp_min(1e-300))
    root = vectors[:, keep] / values[keep].sqrt()  # B^(-1/2) on the directions Σ spans
    mu = torch.linalg.eigvalsh(root.T @ (0.5 * (a + a.T)) @ root)
    curvature = float(sigma_g @ h_sigma_g)
    if not bool(keep.any()) or float(mu.min()) <= 0 or curvature <= 0:
        return GaussianCheck(math.nan, math.nan, math.nan, False, False, d)
    step = (float(g @ sigma_g) / curvature) * sigma_g
    sds = (diagonal + (factor**2).sum(1)).sqrt()
    mean_error = float((step.abs() / sds.clamp_min(torch.finfo(sds.dtype).tiny)).max())
    return GaussianCheck(mean_error, float(mu.min().sqrt()), float(mu.max().sqrt()), True, False, d)
