r"""The ``"full"`` structure: :math:`G` dense (``d x d``), :math:`H` by its Cholesky factor.

Accumulated in the GGN pass as :math:`\sum_c R_c^\top R_c` over chunks, :math:`R_c` the per-example rows of
column :math:`c` of :math:`\Lambda^{1/2}`; only feasible for small :math:`d`, and the reference for the others.
The predictive assembles the rows of :math:`J` at the test points and solves with the Cholesky factor:
:math:`J H^{-1} J^\top`. It is the one structure with the exact GGN, so its evidence keeps the
:math:`b^\top H^{-1} b` term away from the fitted prior (:mod:`~pyro_scalable.infer.laplace.posterior`).
"""

from __future__ import annotations

import torch
from torch import Tensor

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

    def __init__(self, matrix: Tensor):
        self.matrix = matrix
        self.num_params = matrix.shape[-1]

    def matvec(self, v: Tensor) -> Tensor:
        return v @ self.matrix

    def to_dense(self) -> Tensor:
        return self.matrix

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> FullPrecision:
        return FullPrecision(scale * self.matrix + torch.diag_embed(prior_precision))

    @classmethod
    def accumulator(cls, request: FitRequest) -> _FullAccumulator:
        return _FullAccumulator()


class _FullAccumulator:
    uses_rows = True

    def start(self, net, theta: Tensor, plans, rest: Tensor) -> None:
        d = net.layout.num_params
        self.matrix = theta.new_zeros(d, d)

    def accumulate(self, chunk: Chunk) -> None:
        for grads, rest_rows in chunk.columns():
            rows = chunk.rows(grads, rest_rows)
            self.matrix += rows.T @ rows

    def finish(self, num_points: int) -> FullCurvature:
        return FullCurvature(self.matrix)


class FullPrecision:
    """:math:`H` dense, with its Cholesky factor."""

    def __init__(self, matrix: Tensor):
        self.matrix = matrix
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
        return 2 * self.cholesky.diagonal().log().sum()

    def solve(self, v: Tensor) -> Tensor:
        # one (d, many) right-hand side: a batch of vectors would broadcast the d x d factor to every one of them
        d = v.shape[-1]
        return torch.cholesky_solve(v.reshape(-1, d).T, self.cholesky).T.reshape(v.shape)

    def matvec(self, v: Tensor) -> Tensor:
        return v @ self.matrix

    def sample(self, num_samples: int, generator=None) -> Tensor:
        noise = gaussian_noise((self.matrix.shape[-1], num_samples), self.matrix, generator)
        return torch.linalg.solve_triangular(self.cholesky.mT, noise, upper=True).mT

    def inverse_diagonal(self) -> Tensor:
        return torch.cholesky_inverse(self.cholesky).diagonal()

    def to_dense(self) -> Tensor:
        return self.matrix

    def functional_covariance(self, net, theta: Tensor, batch, plans, rest: Tensor) -> Moments:
        jacobian = OutputJacobian(net, theta, plans, rest, batch)
        return jacobian.f, covariance_from_products(jacobian.rows, self.solve), jacobian.likelihood
