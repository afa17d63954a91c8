r"""A covariance from K zero-mean Gaussian draws that keeps their correlations: shrinkage towards the diagonal.

Sample-then-optimise returns :math:`K` offsets :math:`x_k \sim \mathcal N(0, \Sigma)` (exactly zero-mean in law,
with the mean known), so :math:`S = \frac1K\sum_k x_k x_k^\top` is unbiased but has rank :math:`K`: with
:math:`K < d` it is singular, and each off-diagonal entry carries a Monte-Carlo error of order
:math:`\sqrt{(\Sigma_{ii}\Sigma_{jj} + \Sigma_{ij}^2)/K}`. The estimate used as the next episode's covariance is
Schäfer & Strimmer's (2005) shrinkage towards the diagonal (their "target D", a Ledoit-Wolf estimator),

.. math::

    \hat\Sigma = \rho\,\mathrm{diag}(S) + (1-\rho)\,S, \qquad
    \rho = \frac{\sum_{i\ne j}\widehat{\mathrm{Var}}(s_{ij})}{\sum_{i\ne j} s_{ij}^2}, \qquad
    \widehat{\mathrm{Var}}(s_{ij}) = \frac{1}{K(K-1)}\sum_k (x_{ki}x_{kj} - s_{ij})^2,

clipped to :math:`[1/K, 1]`: the variances are kept and every correlation is shrunk by the same factor, by as much
as its estimates are noise. :math:`\rho` minimises the estimated squared (Frobenius) error of :math:`\hat\Sigma`;
with few draws in many dimensions it goes to one (the diagonal), with many draws in few to zero (the draws'
covariance). The floor :math:`1/K` keeps :math:`\hat\Sigma` positive definite; it shrinks a correlation by at most
:math:`1/K` of itself, below its Monte-Carlo error :math:`1/\sqrt K`.

:math:`\hat\Sigma = \mathrm{diag}(\rho\, v) + FF^\top` with :math:`v = \mathrm{diag}(S)` and
:math:`F = \sqrt{(1-\rho)/K}\,X^\top` (``d x K``), a low-rank-plus-diagonal covariance; no ``d x d`` is formed.
The sums in :math:`\rho` come from the :math:`K\times K` Gram matrix :math:`G = XX^\top` and per-coordinate powers,
with :math:`\sum_{i\ne j}s_{ij}^2 = \|G\|_F^2/K^2 - \sum_i v_i^2` and
:math:`\sum_k\sum_{i\ne j}x_{ki}^2x_{kj}^2 = \sum_k G_{kk}^2 - \sum_{k,i}x_{ki}^4`: :math:`O(K^2 d)` time, in float64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pyro_scalable.infer.gaussian_prior.joint import JointGaussian, SiteSpec

__all__ = ["ShrunkCovariance", "gaussian_from_draws", "shrink_to_diagonal", "shrinkage_intensity"]

_CHUNK = 1 << 16  # coordinates per float64 block


class ShrunkCovariance(NamedTuple):
    r""":math:`\mathrm{diag}(D) + FF^\top` with the shrinkage intensity ``rho`` that gave it."""

    diag: Tensor
    factor: Tensor
    rho: float


def shrinkage_intensity(offsets: Tensor) -> float:
    """Schäfer-Strimmer's intensity towards the diagonal for zero-mean rows ``offsets`` ``(K, d)``, unclipped."""
    num, d = offsets.shape
    if num < 2 or d < 2:
        return 1.0
    gram = offsets.new_zeros((num, num), dtype=torch.float64)
    fourth, squares = 0.0, 0.0
    for start in range(0, d, _CHUNK):
        block = offsets[:, start : start + _CHUNK].to(torch.float64)
        gram += block @ block.T
        fourth += float(block.pow(4).sum())
        squares += float(block.square().mean(0).square().sum())  # sum_i v_i^2
    off_squares = float(gram.square().sum()) / num**2 - squares  # sum_{i != j} s_ij^2
    if off_squares <= 0:
        return 1.0
    products = float(gram.diagonal().square().sum()) - fourth  # sum_k sum_{i != j} x_ki^2 x_kj^2
    variance = (products - num * off_squares) / (num * (num - 1))  # sum_{i != j} Var(s_ij)
    return variance / off_squares


def shrink_to_diagonal(offsets: Tensor, rho: float | None = None) -> ShrunkCovariance:
    """The shrunk covariance of zero-mean draws ``offsets`` ``(K, d)`` (``rho``: the estimate, or a given value).

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.gaussian_prior.shrinkage import shrink_to_diagonal
        >>> line = torch.randn(500, 1) * torch.ones(1, 4)  # four perfectly correlated coordinates
        >>> shrunk = shrink_to_diagonal(line + 0.01 * torch.randn(500, 4))
        >>> shrunk.rho < 0.01, shrunk.factor.shape  # the correlations are kept: rank K plus a diagonal
        (True, torch.Size([4, 500]))

    """
    num = offsets.shape[0]
    if rho is None:
        rho = min(1.0, max(shrinkage_intensity(offsets), 1.0 / num))
    variance = offsets.square().mean(0)
    factor = offsets.mT * ((1.0 - rho) / num) ** 0.5
    return ShrunkCovariance(rho * variance, factor.contiguous(), float(rho))


def gaussian_from_draws(sites: list[SiteSpec], mean: Tensor, offsets: Tensor, correlations: str) -> JointGaussian:
    """The joint Gaussian of ``mean`` plus zero-mean draws ``offsets``: shrunk (``"shrinkage"``) or ``"diagonal"``.

    ``joint.shrinkage`` records the intensity (1 for the diagonal).
    """
    shrunk = shrink_to_diagonal(offsets.detach(), rho=1.0 if correlations == "diagonal" else None)
    if shrunk.rho >= 1.0:  # diag = the draws' variances
        joint = JointGaussian.diagonal(sites, mean, shrunk.diag)
    else:
        joint = JointGaussian.low_rank_covariance(sites, mean, shrunk.diag, shrunk.factor)
    joint.shrinkage = shrunk.rho
    return joint
