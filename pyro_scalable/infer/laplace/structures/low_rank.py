r"""The ``"low_rank"`` structure: :math:`G \approx U \Lambda U^\top`, the top-:math:`k` eigenpairs, matrix-free.

The eigenpairs come from a randomised eigendecomposition (Halko et al. 2011) built from GGN-vector products
:math:`J^\top \Lambda J v` (``torch.func`` ``jvp`` then ``vjp``); the GGN pass only keeps each chunk's roots of
:math:`\Lambda`. With :math:`W = P^{-1/2} U (s\Lambda)^{1/2} = Q \Sigma V^\top`,
:math:`H = P^{1/2}(I + W W^\top) P^{1/2}`, so :math:`\log\det H = \sum\log P + \sum\log(1 + \sigma_j^2)` and
:math:`(I + WW^\top)^{-1/2} = I + Q((1+\Sigma^2)^{-1/2} - I)Q^\top` (matrix determinant lemma, Woodbury). In the
predictive :math:`H^{-1} = P^{-1} - V V^\top`, so :math:`J H^{-1}J^\top = J P^{-1} J^\top - (JV)(JV)^\top` with
:math:`JV` from :math:`k` Jacobian-vector products.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.infer.gaussian_prior import JointGaussian
from pyro_scalable.infer.laplace.curvature import FitRequest, PassStructure, check_positive, gaussian_noise
from pyro_scalable.infer.linearized.ggn import Chunk
from pyro_scalable.infer.linearized.glm import Moments
from pyro_scalable.infer.linearized.jacobians import OutputJacobian

__all__ = ["LowRankCurvature", "LowRankPrecision"]


class LowRankCurvature(PassStructure):
    r""":math:`G \approx U \mathrm{diag}(\lambda) U^\top`, ``U`` with orthonormal columns (``d x k``)."""

    name = "low_rank"

    def __init__(self, eigenvectors: Tensor, eigenvalues: Tensor):
        keep = eigenvalues > 0
        self.eigenvectors = eigenvectors[:, keep]
        self.eigenvalues = eigenvalues[keep]
        self.num_params = eigenvectors.shape[0]

    def matvec(self, v: Tensor) -> Tensor:
        return ((v @ self.eigenvectors) * self.eigenvalues) @ self.eigenvectors.T

    def to_dense(self) -> Tensor:
        return (self.eigenvectors * self.eigenvalues) @ self.eigenvectors.T

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> LowRankPrecision:
        return LowRankPrecision(self, prior_precision, scale)

    @classmethod
    def accumulator(cls, request: FitRequest) -> _LowRankAccumulator:
        return _LowRankAccumulator(request.rank, request.generator)


class _LowRankAccumulator:
    uses_rows = False  # matrix-free: the chunks' roots of Lambda are kept for the GGN-vector products

    def __init__(self, rank: int, generator, oversampling: int = 10, power_iterations: int = 2):
        self.rank, self.generator = rank, generator
        self.oversampling, self.power_iterations = oversampling, power_iterations

    def start(self, net, theta: Tensor, plans, rest: Tensor) -> None:
        self.net, self.theta, self.roots = net, theta.detach(), []

    def accumulate(self, chunk: Chunk) -> None:
        self.roots.append(chunk.roots)

    def finish(self, num_points: int) -> LowRankCurvature:
        net, theta, roots = self.net, self.theta, self.roots
        d = theta.numel()
        width = min(d, self.rank + self.oversampling)
        probe = torch.randn(width, d, generator=self.generator, dtype=theta.dtype, device=theta.device)
        basis = torch.linalg.qr(net.ggn_vp(theta, probe, roots).T).Q
        for _ in range(self.power_iterations):
            basis = torch.linalg.qr(net.ggn_vp(theta, basis.T.contiguous(), roots).T).Q
        projected = basis.T @ net.ggn_vp(theta, basis.T.contiguous(), roots).T
        values, vectors = torch.linalg.eigh((projected + projected.T) / 2)
        order = values.argsort(descending=True)[: min(self.rank, width)]
        return LowRankCurvature(basis @ vectors[:, order], values[order])


class LowRankPrecision:
    r""":math:`H = P^{1/2}(I + W W^\top) P^{1/2}` by the SVD of :math:`W`."""

    def __init__(self, curvature: LowRankCurvature, prior_precision: Tensor, scale: Tensor | float):
        check_positive(prior_precision.detach(), "the prior precision (low_rank needs a proper prior everywhere)")
        self.curvature, self.prior_precision, self.scale = curvature, prior_precision, scale
        self.root_prior = prior_precision.sqrt()
        factor = curvature.eigenvectors / self.root_prior.unsqueeze(-1) * (scale * curvature.eigenvalues).sqrt()
        self.basis, singular, _ = torch.linalg.svd(factor, full_matrices=False)
        self.squares = singular**2

    def logdet(self) -> Tensor:
        return self.prior_precision.log().sum() + self.squares.log1p().sum()

    def _inner(self, u: Tensor, power: float) -> Tensor:
        # (I + W W^T)^power u, with W = Q diag(sigma) V^T
        coefficients = (1 + self.squares) ** power - 1
        return u + ((u @ self.basis) * coefficients) @ self.basis.T

    def solve(self, v: Tensor) -> Tensor:
        return self._inner(v / self.root_prior, -1.0) / self.root_prior

    def matvec(self, v: Tensor) -> Tensor:
        return self.scale * self.curvature.matvec(v) + self.prior_precision * v

    def sample(self, num_samples: int, generator=None) -> Tensor:
        noise = gaussian_noise((num_samples, self.curvature.num_params), self.prior_precision, generator)
        return self._inner(noise, -0.5) / self.root_prior

    def joint_gaussian(self, sites, mean: Tensor) -> JointGaussian:
        r""":math:`\mathcal N(\text{mean}, H^{-1})` as a prior, in the precision form :math:`P + VV^\top` (rank k)."""
        factor = self.curvature.eigenvectors * (self.scale * self.curvature.eigenvalues).sqrt()
        return JointGaussian.low_rank_precision(sites, mean, self.prior_precision.detach(), factor.detach())

    def inverse_diagonal(self) -> Tensor:
        shrink = (self.basis**2 * (self.squares / (1 + self.squares))).sum(-1)
        return (1 - shrink) / self.prior_precision

    def to_dense(self) -> Tensor:
        return self.scale * self.curvature.to_dense() + torch.diag_embed(self.prior_precision)

    def functional_covariance(self, net, theta: Tensor, batch, plans, rest: Tensor) -> Moments:
        jacobian = OutputJacobian(net, theta, plans, rest, batch)
        covariance = jacobian.diagonal_covariance(self.prior_precision.reciprocal())
        shrink = (self.squares / (1 + self.squares)).sqrt()
        factors = (self.basis * shrink / self.root_prior.unsqueeze(-1)).T.contiguous()
        _, products = net.jvp(theta.detach(), factors, batch)  # (k, points, outputs)
        covariance -= torch.einsum("kpm,kpn->pmn", products, products)
        return jacobian.f, covariance, jacobian.likelihood
