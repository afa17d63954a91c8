r"""The ``"diag"`` structure: :math:`\mathrm{diag}(G)`, exact, with no per-example Jacobian.

In the GGN pass, :math:`\mathrm{diag}(G) = \sum_{i,c} g_{ic}^2 \otimes \tilde a_i^2` per recorded layer (one
product per layer and chunk; :class:`~pyro_scalable.infer.linearized.ggn.GGNDiagonal`). With :math:`H^{-1}`
diagonal with entries :math:`h_{kj}` on a layer and :math:`B = \partial f/\partial z`, the predictive is
:math:`[J H^{-1} J^\top]_{cc'} = \sum_k B_{ck}B_{c'k} w_k` with :math:`w_k = \sum_j h_{kj}\tilde a_j^2`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.infer.gaussian_prior import JointGaussian
from pyro_scalable.infer.laplace.curvature import FitRequest, PassStructure, check_positive, gaussian_noise
from pyro_scalable.infer.linearized.ggn import GGNDiagonal
from pyro_scalable.infer.linearized.glm import Moments
from pyro_scalable.infer.linearized.jacobians import OutputJacobian

__all__ = ["DiagCurvature", "DiagPrecision"]


class DiagCurvature(PassStructure):
    r""":math:`\mathrm{diag}(G)` (``d``)."""

    name = "diag"

    def __init__(self, diagonal: Tensor):
        self.diagonal = diagonal
        self.num_params = diagonal.shape[-1]

    def matvec(self, v: Tensor) -> Tensor:
        return v * self.diagonal

    def to_dense(self) -> Tensor:
        return torch.diag_embed(self.diagonal)

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> DiagPrecision:
        return DiagPrecision(scale * self.diagonal + prior_precision)

    @classmethod
    def accumulator(cls, request: FitRequest) -> _DiagAccumulator:
        return _DiagAccumulator()


class _DiagAccumulator(GGNDiagonal):
    # the floor's exact diagonal (sample-then-optimise's g-prior uses it too), finished into the structure
    def finish(self, num_points: int) -> DiagCurvature:
        return DiagCurvature(super().finish(num_points))


class DiagPrecision:
    """:math:`H` diagonal."""

    def __init__(self, diagonal: Tensor):
        check_positive(diagonal.detach(), "its diagonal")
        self.diagonal = diagonal

    def logdet(self) -> Tensor:
        return self.diagonal.log().sum()

    def solve(self, v: Tensor) -> Tensor:
        return v / self.diagonal

    def matvec(self, v: Tensor) -> Tensor:
        return v * self.diagonal

    def sample(self, num_samples: int, generator=None) -> Tensor:
        return gaussian_noise((num_samples, self.diagonal.shape[-1]), self.diagonal, generator) * self.diagonal.rsqrt()

    def inverse_diagonal(self) -> Tensor:
        return self.diagonal.reciprocal()

    def joint_gaussian(self, sites, mean: Tensor) -> JointGaussian:
        r""":math:`\mathcal N(\text{mean}, H^{-1})` as a prior: independent Normals (the EWC prior)."""
        return JointGaussian.diagonal(sites, mean, self.diagonal.detach().reciprocal())

    def to_dense(self) -> Tensor:
        return torch.diag_embed(self.diagonal)

    def functional_covariance(self, net, theta: Tensor, batch, plans, rest: Tensor) -> Moments:
        jacobian = OutputJacobian(net, theta, plans, rest, batch)
        return jacobian.f, jacobian.diagonal_covariance(self.diagonal.reciprocal()), jacobian.likelihood
