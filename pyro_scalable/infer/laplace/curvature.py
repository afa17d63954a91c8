r"""Curvature structures for the Laplace posterior precision :math:`H = s\,G + \mathrm{diag}(P)`.

:math:`G` is the generalised Gauss-Newton matrix (or empirical Fisher) of the data over a flat vector of
:math:`d` parameters, :math:`P` a diagonal prior precision and :math:`s` a scale (:math:`\sigma_0^2/\sigma^2`
when the observation noise of a Normal likelihood changes). Each structure stores :math:`G` once and returns a
:class:`Precision` for any :math:`(P, s)`, differentiable in both, with the log-determinant, solves, matrix
products, samples of :math:`\mathcal N(0, H^{-1})` and the marginal variances :math:`\mathrm{diag}(H^{-1})`:

* ``full``: :math:`G` dense; Cholesky of :math:`H`.
* ``diag``: :math:`\mathrm{diag}(G)`.
* ``low_rank``: :math:`G \approx U \Lambda U^\top` (top-:math:`k` eigenpairs). With
  :math:`W = P^{-1/2} U (s\Lambda)^{1/2} = Q \Sigma V^\top`,
  :math:`H = P^{1/2}(I + W W^\top) P^{1/2}`, so :math:`\log\det H = \sum\log P + \sum\log(1 + \sigma_j^2)` and
  :math:`(I + WW^\top)^{-1/2} = I + Q((1+\Sigma^2)^{-1/2} - I)Q^\top` (matrix determinant lemma, Woodbury).
* ``kron``: per layer, :math:`G_\ell \approx B_\ell \otimes A_\ell` (K-FAC; Martens & Grosse 2015, with the bias
  folded into :math:`A_\ell`), the other parameters diagonal. A layer's prior must be
  :math:`I \otimes D` (equal across the layer's outputs; a scalar, or one value for the weight and one for the
  bias). With :math:`\tilde A = D^{-1/2} A D^{-1/2} = Q_A \mathrm{diag}(\lambda) Q_A^\top` and
  :math:`B = Q_B \mathrm{diag}(\mu) Q_B^\top`,

  .. math::

      H_\ell = (I \otimes D^{1/2})(Q_B \otimes Q_A)(s\,\mu\lambda^\top + 1)(Q_B \otimes Q_A)^\top(I \otimes D^{1/2}),

  which is exact (no further approximation of the prior), and needs no new eigendecomposition when :math:`D`
  is a scalar. Vectors of a layer are ``(outputs, inputs + 1)`` matrices; :math:`(B\otimes A)\,\mathrm{vec}(V)
  = \mathrm{vec}(B V A)`.

A precision that is not positive definite raises :class:`CurvatureError` with the offending flat indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError

__all__ = [
    "Curvature",
    "CurvatureError",
    "DiagCurvature",
    "FullCurvature",
    "KronBlock",
    "KronCurvature",
    "LowRankCurvature",
    "Precision",
]


class CurvatureError(ModelError):
    """The posterior precision is not positive definite; ``index`` holds the flat parameter indices involved."""

    def __init__(self, message: str, index: Tensor | None = None):
        super().__init__(message)
        self.index = index


class Precision(Protocol):
    r""":math:`H = sG + \mathrm{diag}(P)` for one choice of ``(P, s)``."""

    def logdet(self) -> Tensor: ...
    def solve(self, v: Tensor) -> Tensor: ...
    def matvec(self, v: Tensor) -> Tensor: ...
    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor: ...
    def inverse_diagonal(self) -> Tensor: ...
    def to_dense(self) -> Tensor: ...


class Curvature(Protocol):
    """The data part :math:`G` of the posterior precision, in one structure."""

    num_params: int

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> Precision: ...
    def matvec(self, v: Tensor) -> Tensor: ...
    def to_dense(self) -> Tensor: ...


def _randn(shape, like: Tensor, generator) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=like.dtype, device=like.device)


def _check_positive(values: Tensor, what: str, index: Tensor | None = None, *, dense: bool = False) -> None:
    # the eigenvalues of a dense matrix count as zero below d * eps relative to the largest (numpy's matrix_rank)
    floor = 0.0
    if dense and values.numel():
        floor = float(values.abs().max()) * values.numel() * torch.finfo(values.dtype).eps
    bad = ~(values > floor)
    if bool(bad.any()):
        where = torch.nonzero(bad).flatten()
        where = where if index is None else index[where]
        raise CurvatureError(
            f"the posterior precision is singular: {what} has {int(bad.sum())} non-positive value(s) "
            f"(smallest {float(values.min()):.3g}). Give those parameters a proper prior, raise the prior "
            "precision, or pass jitter=... to laplace_approximation.",
            where,
        )


# ---------------------------------------------------------------------------------------------------- full
class FullCurvature:
    """Dense :math:`G` (``d x d``)."""

    def __init__(self, matrix: Tensor):
        self.matrix = matrix
        self.num_params = matrix.shape[-1]

    def matvec(self, v: Tensor) -> Tensor:
        return v @ self.matrix

    def to_dense(self) -> Tensor:
        return self.matrix

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> _FullPrecision:
        return _FullPrecision(scale * self.matrix + torch.diag_embed(prior_precision))


class _FullPrecision:
    def __init__(self, matrix: Tensor):
        self.matrix = matrix
        cholesky, info = torch.linalg.cholesky_ex(matrix)
        pivots = cholesky.diagonal().detach() ** 2
        if int(info) > 0 or not bool(
            (pivots > float(pivots.max()) * len(pivots) * torch.finfo(pivots.dtype).eps).all()
        ):
            eigenvalues, vectors = torch.linalg.eigh(matrix.detach())
            _check_positive(eigenvalues, "its eigen-decomposition", dense=True)
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
        noise = _randn((self.matrix.shape[-1], num_samples), self.matrix, generator)
        return torch.linalg.solve_triangular(self.cholesky.mT, noise, upper=True).mT

    def inverse_diagonal(self) -> Tensor:
        return torch.cholesky_inverse(self.cholesky).diagonal()

    def to_dense(self) -> Tensor:
        return self.matrix


# ---------------------------------------------------------------------------------------------------- diag
class DiagCurvature:
    r""":math:`\mathrm{diag}(G)` (``d``)."""

    def __init__(self, diagonal: Tensor):
        self.diagonal = diagonal
        self.num_params = diagonal.shape[-1]

    def matvec(self, v: Tensor) -> Tensor:
        return v * self.diagonal

    def to_dense(self) -> Tensor:
        return torch.diag_embed(self.diagonal)

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> _DiagPrecision:
        return _DiagPrecision(scale * self.diagonal + prior_precision)


class _DiagPrecision:
    def __init__(self, diagonal: Tensor):
        _check_positive(diagonal.detach(), "its diagonal")
        self.diagonal = diagonal

    def logdet(self) -> Tensor:
        return self.diagonal.log().sum()

    def solve(self, v: Tensor) -> Tensor:
        return v / self.diagonal

    def matvec(self, v: Tensor) -> Tensor:
        return v * self.diagonal

    def sample(self, num_samples: int, generator=None) -> Tensor:
        return _randn((num_samples, self.diagonal.shape[-1]), self.diagonal, generator) * self.diagonal.rsqrt()

    def inverse_diagonal(self) -> Tensor:
        return self.diagonal.reciprocal()

    def to_dense(self) -> Tensor:
        return torch.diag_embed(self.diagonal)


# ---------------------------------------------------------------------------------------------------- low rank
class LowRankCurvature:
    r""":math:`G \approx U \mathrm{diag}(\lambda) U^\top`, ``U`` with orthonormal columns (``d x k``)."""

    def __init__(self, eigenvectors: Tensor, eigenvalues: Tensor):
        keep = eigenvalues > 0
        self.eigenvectors = eigenvectors[:, keep]
        self.eigenvalues = eigenvalues[keep]
        self.num_params = eigenvectors.shape[0]

    def matvec(self, v: Tensor) -> Tensor:
        return ((v @ self.eigenvectors) * self.eigenvalues) @ self.eigenvectors.T

    def to_dense(self) -> Tensor:
        return (self.eigenvectors * self.eigenvalues) @ self.eigenvectors.T

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> _LowRankPrecision:
        return _LowRankPrecision(self, prior_precision, scale)


class _LowRankPrecision:
    def __init__(self, curvature: LowRankCurvature, prior_precision: Tensor, scale: Tensor | float):
        _check_positive(prior_precision.detach(), "the prior precision (low_rank needs a proper prior everywhere)")
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
        noise = _randn((num_samples, self.curvature.num_params), self.prior_precision, generator)
        return self._inner(noise, -0.5) / self.root_prior

    def inverse_diagonal(self) -> Tensor:
        shrink = (self.basis**2 * (self.squares / (1 + self.squares))).sum(-1)
        return (1 - shrink) / self.prior_precision

    def to_dense(self) -> Tensor:
        return self.scale * self.curvature.to_dense() + torch.diag_embed(self.prior_precision)


# ---------------------------------------------------------------------------------------------------- kron
@dataclass
class KronBlock:
    r"""One layer: flat indices ``index`` (``outputs x (inputs+1)``) and factors with :math:`G \approx B \otimes A`."""

    index: Tensor  # (out, in') long
    output_factor: Tensor  # B, (out, out)
    input_factor: Tensor  # A, (in', in')

    def __post_init__(self):
        self.output_eigenvalues, self.output_eigenvectors = _eigh(self.output_factor)
        self.input_eigenvalues, self.input_eigenvectors = _eigh(self.input_factor)


def _eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    # in float64: K-FAC factors of ReLU nets have many (near-)zero eigenvalues, where single precision loses the
    # small ones, and where this build's float32 LAPACK path was up to 30x slower than its float64 one (measured)
    values, vectors = torch.linalg.eigh(matrix.to(torch.float64))
    return values.clamp_min(0.0).to(matrix.dtype), vectors.to(matrix.dtype)


class KronCurvature:
    r"""K-FAC blocks for layers, and :math:`\mathrm{diag}(G)` for every other parameter (``rest``)."""

    def __init__(self, blocks: list[KronBlock], rest_index: Tensor, rest_diagonal: Tensor, num_params: int):
        self.blocks = blocks
        self.rest_index = rest_index
        self.rest_diagonal = rest_diagonal
        self.num_params = num_params

    def matvec(self, v: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for block in self.blocks:
            out[..., block.index] = block.output_factor @ v[..., block.index] @ block.input_factor
        out[..., self.rest_index] = v[..., self.rest_index] * self.rest_diagonal
        return out

    def to_dense(self) -> Tensor:
        return self.matvec(torch.eye(self.num_params, dtype=self.rest_diagonal.dtype, device=self.rest_diagonal.device))

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> _KronPrecision:
        return _KronPrecision(self, prior_precision, scale)


class _KronBlockPrecision:
    def __init__(self, block: KronBlock, prior: Tensor, scale: Tensor | float):
        # prior: (out, in') in the block's layout; it must be I (x) D
        column = prior[0]
        if not bool((prior.detach() == column.detach()).all()):
            raise CurvatureError(
                "structure='kron' needs a layer's prior precision to be the same for all of the layer's outputs "
                "(a scalar, or one value for the weight and one for the bias); use structure='diag' or 'full' "
                "for a per-parameter prior precision.",
                block.index.flatten(),
            )
        _check_positive(column.detach(), "the prior precision of a K-FAC layer", block.index[0])
        self.block, self.scale = block, scale
        self.root_prior = column.sqrt()
        if bool((column.detach() == column.detach()[0]).all()):
            self.input_values = block.input_eigenvalues / column[0]
            self.input_vectors = block.input_eigenvectors
        else:
            scaled = block.input_factor / self.root_prior.unsqueeze(-1) / self.root_prior
            self.input_values, self.input_vectors = _eigh(scaled)
        self.eigenvalues = scale * block.output_eigenvalues.unsqueeze(-1) * self.input_values + 1
        self.num_outputs = prior.shape[0]

    def _rotate(self, matrix: Tensor) -> Tensor:
        return self.block.output_eigenvectors.T @ matrix @ self.input_vectors

    def _unrotate(self, matrix: Tensor) -> Tensor:
        return self.block.output_eigenvectors @ matrix @ self.input_vectors.T

    def logdet(self) -> Tensor:
        return self.num_outputs * self.root_prior.log().sum() * 2 + self.eigenvalues.log().sum()

    def solve(self, v: Tensor) -> Tensor:
        return self._unrotate(self._rotate(v / self.root_prior) / self.eigenvalues) / self.root_prior

    def sample(self, noise: Tensor) -> Tensor:
        return self._unrotate(noise * self.eigenvalues.rsqrt()) / self.root_prior

    def inverse_diagonal(self) -> Tensor:
        return (
            self.block.output_eigenvectors**2 @ self.eigenvalues.reciprocal() @ (self.input_vectors**2).T
        ) / self.root_prior**2


class _KronPrecision:
    def __init__(self, curvature: KronCurvature, prior_precision: Tensor, scale: Tensor | float):
        self.curvature, self.prior_precision, self.scale = curvature, prior_precision, scale
        self.blocks = [_KronBlockPrecision(b, prior_precision[b.index], scale) for b in curvature.blocks]
        self.rest = scale * curvature.rest_diagonal + prior_precision[curvature.rest_index]
        _check_positive(self.rest.detach(), "its diagonal", curvature.rest_index)

    def logdet(self) -> Tensor:
        return sum((b.logdet() for b in self.blocks), self.rest.log().sum())

    def _apply(self, v: Tensor, block_fn, rest: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for block in self.blocks:
            out[..., block.block.index] = block_fn(block, v[..., block.block.index])
        out[..., self.curvature.rest_index] = v[..., self.curvature.rest_index] * rest
        return out

    def solve(self, v: Tensor) -> Tensor:
        return self._apply(v, _KronBlockPrecision.solve, self.rest.reciprocal())

    def matvec(self, v: Tensor) -> Tensor:
        return self.scale * self.curvature.matvec(v) + self.prior_precision * v

    def sample(self, num_samples: int, generator=None) -> Tensor:
        noise = _randn((num_samples, self.curvature.num_params), self.prior_precision, generator)
        return self._apply(noise, _KronBlockPrecision.sample, self.rest.rsqrt())

    def inverse_diagonal(self) -> Tensor:
        out = torch.empty_like(self.prior_precision)
        for block in self.blocks:
            out[block.block.index] = block.inverse_diagonal()
        out[self.curvature.rest_index] = self.rest.reciprocal()
        return out

    def to_dense(self) -> Tensor:
        return self.matvec(torch.eye(self.curvature.num_params, dtype=self.rest.dtype, device=self.rest.device))
