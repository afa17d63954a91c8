r"""The ``"full"`` structure: :math:`G` dense (``d x d``), :math:`H` by its Cholesky factor.

Only feasible for small :math:`d`, and the reference for the others. When every parameter is in a linear layer
(rows :math:`g_{ic}^{(k)} \otimes \tilde a_i^{(k)}`), the block of layers :math:`k, l` is a sum of Kronecker
products,

.. math::

    G_{kl} = \sum_i M_i^{(kl)} \otimes \tilde a_i^{(k)} \tilde a_i^{(l)\top}, \qquad
    M_i^{(kl)} = \sum_c g_{ic}^{(k)} g_{ic}^{(l)\top},

computed one output unit :math:`o` of layer :math:`k` at a time as :math:`\tilde A_k^\top T_o`, with
:math:`(T_o)_{i,(p,j)} = M_i^{(kl)}[o, p]\,\tilde a^{(l)}_{ij}`: :math:`2Nd^2` flops rather than the
:math:`2NCd^2` of summing :math:`R_c^\top R_c` over the :math:`C` columns of :math:`\Lambda^{1/2}`
(:math:`R_c` the per-example rows of column :math:`c`), and half of it again by symmetry (only the blocks of units
at or after :math:`o`). Any other parameter (a convolution, a site outside the recorded layers) takes the sum of
:math:`R_c^\top R_c`.
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
        matrix = scale * self.matrix
        if prior.dim() == 2:
            matrix = matrix + prior
        else:
            matrix.diagonal().add_(prior)  # in place on a new matrix: one d x d pass fewer (autograd keeps it)
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
        # Kronecker blocks when every parameter is in a linear layer; self.matrix is then in the plans' order
        # (layer by layer, each (out, in') row-major), upper blocks of units only, until finish
        self.kronecker = bool(plans) and not rest.numel() and not any(p.conv for p in plans)
        self.plans = plans

    def accumulate(self, chunk: Chunk) -> None:
        if self.kronecker:
            self._accumulate_blocks(chunk)
            return
        for grads, rest_rows in chunk.columns():
            rows = chunk.rows(grads, rest_rows).to(torch.float64)
            self.matrix += rows.T @ rows

    def _accumulate_blocks(self, chunk: Chunk) -> None:
        # g: (C, points, out_k) per layer; a: (points, in'_k); float64, as the rows were
        columns = [[g.to(torch.float64) for g in grads] for grads, _ in chunk.columns()]
        grads = [torch.stack(per_layer) for per_layer in zip(*columns)]
        inputs = [a.to(torch.float64) for a in chunk.inputs]
        points, start = inputs[0].shape[0], 0
        for k, a in enumerate(inputs):
            units, width = grads[k].shape[-1], a.shape[1]
            ahead = torch.cat(grads[k:], dim=-1)  # (C, points, units of this layer and the later ones)
            sizes = [(g.shape[-1], b.shape[1]) for g, b in zip(grads[k + 1 :], inputs[k + 1 :])]
            # T for unit o: columns (p, j) of this layer's units p >= o, then every (p, j) of the later layers
            buffer = a.new_empty(points, units * width + sum(u * w for u, w in sizes))
            for o in range(units):
                m = (ahead[..., o : o + 1] * ahead[..., o:]).sum(0)  # (points, units from o on)
                column = o * width
                torch.mul(m[:, : units - o, None], a[:, None, :], out=_view(buffer, column, units - o, width))
                column, unit = units * width, units - o
                for (count, size), b in zip(sizes, inputs[k + 1 :]):
                    torch.mul(m[:, unit : unit + count, None], b[:, None, :], out=_view(buffer, column, count, size))
                    column, unit = column + count * size, unit + count
                row = start + o * width
                self.matrix[row : row + width, row:].addmm_(a.T, buffer[:, o * width :])
            start += units * width

    def finish(self, num_points: int) -> FullCurvature:
        if self.kronecker:
            self.matrix = self._from_blocks(self.matrix)
        return FullCurvature(self.matrix, self.dtype)

    def _from_blocks(self, matrix: Tensor) -> Tensor:
        # mirror each unit's blocks of later units into its columns (in place: below them it holds zeros), then
        # back to the flat order through one d x d buffer (two, not four, d x d matrices at the peak)
        start = 0
        for plan in self.plans:
            units, width = plan.index.shape
            for _ in range(units):
                end = start + width
                matrix[end:, start:end] = matrix[start:end, end:].T
                start = end
        order = torch.cat([plan.index.flatten() for plan in self.plans])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        rows = torch.index_select(matrix, 0, inverse)
        return torch.index_select(rows, 1, inverse, out=matrix)


def _view(buffer: Tensor, column: int, units: int, width: int) -> Tensor:
    """Columns ``column`` onwards of ``buffer`` as ``(points, units, width)``."""
    return buffer[:, column : column + units * width].view(buffer.shape[0], units, width)


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
