r"""The ``"full"`` structure: :math:`G` dense (``d x d``), :math:`H` by its Cholesky factor.

Accumulated in the GGN pass as :math:`\sum_c R_c^\top R_c` over chunks, :math:`R_c` the per-example rows of
column :math:`c` of :math:`\Lambda^{1/2}`; only feasible for small :math:`d`, and the reference for the others.
The predictive assembles the rows of :math:`J` at the test points and solves with the Cholesky factor:
:math:`J H^{-1} J^\top`.

:math:`G` is accumulated and :math:`H` factored in float64 whatever the model's dtype: with N points the GGN's
largest eigenvalue grows like N/σ², and in float32 its rounding (about that times d·2⁻²⁴) swamps a prior
precision of 1, so a well-posed float32 posterior would come out with negative eigenvalues. A ``d x d`` matrix in
float64 is cheap next to the pass that builds it; every product is returned in the model's dtype.

It is the one structure with the exact GGN, so its evidence keeps the :math:`b^\top H^{-1} b` term away from the
fitted prior (:mod:`~pyro_scalable.infer.laplace.posterior`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.infer.gaussian_prior import JointGaussian
from pyro_scalable.infer.laplace.curvature import (
    CurvatureError,
    FitRequest,
    PassStructure,
    check_positive,
    gaussian_noise,
)
from pyro_scalable.infer.linearized.ggn import Chunk
from pyro_scalable.infer.linearized.glm import Moments, covariance_from_products
from pyro_scalable.infer.linearized.jacobians import OutputJacobian

__all__ = ["FullCurvature", "FullPrecision"]


class FullCurvature(PassStructure):
    """Dense :math:`G` (``d x d``)."""

    name = "full"
    exact = True

    def __init__(self, matrix: Tensor, dtype: torch.dtype | None = None):
        self.dtype = dtype or matrix.dtype  # the model's
        self.matrix = matrix.to(torch.float64)
        self.num_params = matrix.shape[-1]

    def matvec(self, v: Tensor) -> Tensor:
        return (v.to(self.matrix.dtype) @ self.matrix).to(v.dtype)

    def to_dense(self) -> Tensor:
        return self.matrix.to(self.dtype)

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> FullPrecision:
        prior = prior_precision.to(self.matrix.dtype)
        matrix = scale * self.matrix + (prior if prior.dim() == 2 else torch.diag_embed(prior))
        return FullPrecision(matrix, prior_precision.dtype)

    @classmethod
    def accumulator(cls, request: FitRequest) -> _FullAccumulator:
        return _FullAccumulator()


class _FullAccumulator:
    uses_rows = True

    def start(self, net, theta: Tensor, plans, rest: Tensor) -> None:
        d = net.layout.num_params
        self.dtype = theta.dtype
        self.matrix = theta.new_zeros(d, d, dtype=torch.float64)

    def accumulate(self, chunk: Chunk) -> None:
        for grads, rest_rows in chunk.columns():
            rows = chunk.rows(grads, rest_rows).to(torch.float64)
            self.matrix += rows.T @ rows

    def finish(self, num_points: int) -> FullCurvature:
        return FullCurvature(self.matrix, self.dtype)


class FullPrecision:
    """:math:`H` dense, with its Cholesky factor, both float64; products in ``dtype``, the model's."""

    def __init__(self, matrix: Tensor, dtype: torch.dtype):
        self.matrix = matrix
        self.dtype = dtype
        cholesky, info = torch.linalg.cholesky_ex(matrix)
        pivots = cholesky.diagonal().detach() ** 2
        if int(info) > 0 or not bool(
            (pivots > float(pivots.max()) * len(pivots) * torch.finfo(pivots.dtype).eps).all()
        ):
            eigenvalues, vectors = torch.linalg.eigh(matrix.detach())
            check_positive(eigenvalues, "its eigen-decomposition", dense=True)
            raise CurvatureError("the posterior precision is numerically singular (Cholesky failed); pass jitter=.")
        self.cholesky = cholesky

    def logdet(self) -> Tensor:
        return (2 * self.cholesky.diagonal().log().sum()).to(self.dtype)

    def solve(self, v: Tensor) -> Tensor:
        # one (d, many) right-hand side: a batch of vectors would broadcast the d x d factor to every one of them
        d = v.shape[-1]
        rhs = v.reshape(-1, d).T.to(self.cholesky.dtype)
        return torch.cholesky_solve(rhs, self.cholesky).T.reshape(v.shape).to(v.dtype)

    def matvec(self, v: Tensor) -> Tensor:
        return (v.to(self.matrix.dtype) @ self.matrix).to(v.dtype)

    def sample(self, num_samples: int, generator=None) -> Tensor:
        # the noise in the model's dtype, so that a seed gives the same stream as the other structures' draws
        like = self.matrix.new_empty(0, dtype=self.dtype)
        noise = gaussian_noise((self.matrix.shape[-1], num_samples), like, generator)
        draws = torch.linalg.solve_triangular(self.cholesky.mT, noise.to(self.cholesky.dtype), upper=True).mT
        return draws.to(self.dtype)

    def inverse_diagonal(self) -> Tensor:
        return torch.cholesky_inverse(self.cholesky).diagonal().to(self.dtype)

    def joint_gaussian(self, sites, mean: Tensor) -> JointGaussian:
        r""":math:`\mathcal N(\text{mean}, H^{-1})` as a prior (dense: ``d x d``, as this structure is)."""
        return JointGaussian.dense(sites, mean, torch.cholesky_inverse(self.cholesky).to(self.dtype))

    def to_dense(self) -> Tensor:
        return self.matrix.to(self.dtype)

    def functional_covariance(self, net, theta: Tensor, batch, plans, rest: Tensor) -> Moments:
        jacobian = OutputJacobian(net, theta, plans, rest, batch)
        return jacobian.f, covariance_from_products(jacobian.rows, self.solve), jacobian.likelihood
