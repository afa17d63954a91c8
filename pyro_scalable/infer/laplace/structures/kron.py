r"""The ``"kron"`` structure: per layer :math:`G_\ell \approx B_\ell \otimes A_\ell` (K-FAC), the rest diagonal.

In the GGN pass, :math:`B = \frac1N\sum_{i,c} g_{ic} g_{ic}^\top` and :math:`A = \sum_i \tilde a_i \tilde
a_i^\top` (Martens & Grosse 2015, with the bias folded into :math:`A`; exact when :math:`\sum_c
g_{ic}g_{ic}^\top` is the same for every example, e.g. a one-layer net with a Gaussian likelihood). A convolution's
factors sum over its :math:`L` locations too, with :math:`B` divided by :math:`NL` (KFC, Grosse & Martens 2016).
With per-point weights :math:`w_i` (``poutine.scale``, ``poutine.mask``; the roots already carry
:math:`\sqrt{w_i}`) the factors are those of the data with point :math:`i` repeated :math:`w_i` times:
:math:`A = \sum_i w_i \tilde a_i \tilde a_i^\top` and :math:`N = \sum_i w_i`.

A layer's prior must be :math:`I \otimes D` (equal across the layer's outputs; a scalar, or one value for the
weight and one for the bias). With :math:`\tilde A = D^{-1/2} A D^{-1/2} = Q_A \mathrm{diag}(\lambda) Q_A^\top`
and :math:`B = Q_B \mathrm{diag}(\mu) Q_B^\top`,

.. math::

    H_\ell = (I \otimes D^{1/2})(Q_B \otimes Q_A)(s\,\mu\lambda^\top + 1)(Q_B \otimes Q_A)^\top(I \otimes D^{1/2}),

which is exact (no further approximation of the prior), and needs no new eigendecomposition when :math:`D` is a
scalar. Vectors of a layer are ``(outputs, inputs + 1)`` matrices; :math:`(B\otimes A)\,\mathrm{vec}(V) =
\mathrm{vec}(B V A)`. In the predictive, with :math:`E = s\,\mu\lambda^\top + 1`, :math:`U = (\partial f/\partial
z) Q_B` and :math:`w_k = \sum_j (Q_A^\top D^{-1/2}\tilde a)_j^2 / E_{kj}`:
:math:`[J H_\ell^{-1} J^\top]_{cc'} = \sum_k U_{ck} U_{c'k} w_k`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from pyro_scalable.infer.gaussian_prior.kron import KronFactors, KronJoint
from pyro_scalable.infer.laplace.curvature import (
    CurvatureError,
    FitRequest,
    PassStructure,
    check_positive,
    gaussian_noise,
)
from pyro_scalable.infer.linearized.ggn import Chunk
from pyro_scalable.infer.linearized.glm import Moments
from pyro_scalable.infer.linearized.jacobians import OutputJacobian

__all__ = ["KronBlock", "KronBlockPrecision", "KronCurvature", "KronPrecision"]


@dataclass
class KronBlock:
    r"""One layer: flat indices ``index`` (``outputs x (inputs+1)``) and factors with :math:`G \approx B \otimes A`."""

    index: Tensor  # (out, in') long
    output_factor: Tensor  # B, (out, out)
    input_factor: Tensor  # A, (in', in')

    def __post_init__(self):
        # the evidence needs the eigenvalues only; the eigenvectors (a slower LAPACK call) on first use
        self.output_eigenvalues = _eigenvalues(self.output_factor)
        self.input_eigenvalues = _eigenvalues(self.input_factor)

    @cached_property
    def output_eigenvectors(self) -> Tensor:
        return _eigenvectors(self.output_factor)

    @cached_property
    def input_eigenvectors(self) -> Tensor:
        return _eigenvectors(self.input_factor)


# in float64: K-FAC factors of ReLU nets have many (near-)zero eigenvalues, where single precision loses the small
# ones (and float32 buys no speed here: LAPACK's float32 eigh can be the slower one on such matrices)
def _eigenvalues(matrix: Tensor) -> Tensor:
    return torch.linalg.eigvalsh(matrix.to(torch.float64)).clamp_min(0.0).to(matrix.dtype)


def _eigenvectors(matrix: Tensor) -> Tensor:
    return torch.linalg.eigh(matrix.to(torch.float64)).eigenvectors.to(matrix.dtype)


class KronCurvature(PassStructure):
    r"""K-FAC blocks for layers, and :math:`\mathrm{diag}(G)` for every other parameter (``rest``)."""

    name = "kron"
    per_parameter_prior = False  # a layer's prior precision is I (x) D

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

    def precision(self, prior_precision: Tensor, scale: Tensor | float = 1.0) -> KronPrecision:
        return KronPrecision(self, prior_precision, scale)

    @classmethod
    def accumulator(cls, request: FitRequest) -> _KronAccumulator:
        return _KronAccumulator()


class _KronAccumulator:
    uses_rows = True

    def start(self, net, theta: Tensor, plans, rest: Tensor) -> None:
        self.plans, self.rest, self.num_params = plans, rest, net.layout.num_params
        self.rest_diagonal = theta.new_zeros(rest.numel())
        self.input_factors = [theta.new_zeros(p.index.shape[1], p.index.shape[1]) for p in plans]
        self.output_factors = [theta.new_zeros(p.index.shape[0], p.index.shape[0]) for p in plans]
        self.locations = [1] * len(plans)
        self.count = theta.new_zeros(())  # N, or the sum of the points' weights

    def accumulate(self, chunk: Chunk) -> None:
        weights = chunk.point_weights  # None: every point once
        self.count += chunk.f.shape[0] if weights is None else weights.sum()
        for k, (plan, a) in enumerate(zip(self.plans, chunk.raw_inputs)):
            if plan.conv:
                a = chunk.inputs[k]
                weighted = a if weights is None else a * weights[:, None, None]
                self.input_factors[k] += torch.einsum("nil,njl->ij", weighted, a)
                self.locations[k] = a.shape[-1]
                continue
            # A = ã^T ã with ã = (a, 1), in place and by blocks: no (points, in + 1) copy with a column of ones
            factor, m = self.input_factors[k], a.shape[1]
            _add_lower_gram(factor[:m, :m], a if weights is None else a * weights.sqrt()[:, None])
            if plan.bias is not None:
                sums = a.sum(0) if weights is None else weights @ a
                factor[:m, m] += sums
                factor[m, :m] += sums
                factor[m, m] += a.shape[0] if weights is None else weights.sum()
        for grads, rest_rows in chunk.column_groups():
            # B summed over a group of columns (stacked by the pullback) in one product per layer
            for factor, g in zip(self.output_factors, grads):
                if g.dim() == 4:
                    factor += torch.einsum("cnol,cnpl->op", g, g)
                else:
                    g = g.reshape(-1, g.shape[-1])
                    factor.addmm_(g.T, g)
            if rest_rows is not None:
                self.rest_diagonal += rest_rows.square().sum((0, 1))

    def finish(self, num_points: int) -> KronCurvature:
        for plan, factor in zip(self.plans, self.input_factors):
            if not plan.conv:
                m = factor.shape[0] - (plan.bias is not None)
                _mirror_lower(factor[:m, :m])
        blocks = [
            KronBlock(p.index, b / (self.count * size), a)
            for p, b, a, size in zip(self.plans, self.output_factors, self.input_factors, self.locations)
        ]
        return KronCurvature(blocks, self.rest, self.rest_diagonal, self.num_params)


# a Gram matrix this wide is summed by its lower blocks only (3/4 of the products), mirrored once at the end
_GRAM_SPLIT = 256


def _add_lower_gram(factor: Tensor, a: Tensor) -> None:
    """Add ``a^T a`` to ``factor``: all of it, or for a wide ``a`` its lower blocks (then :func:`_mirror_lower`)."""
    m = a.shape[1]
    if m < _GRAM_SPLIT:
        factor.addmm_(a.T, a)
        return
    half = m // 2
    low, high = a[:, :half], a[:, half:]
    factor[:half, :half].addmm_(low.T, low)
    factor[half:, :half].addmm_(high.T, low)
    factor[half:, half:].addmm_(high.T, high)


def _mirror_lower(factor: Tensor) -> None:
    """Copy the lower off-diagonal block that :func:`_add_lower_gram` summed into the upper one."""
    m = factor.shape[0]
    if m >= _GRAM_SPLIT:
        half = m // 2
        factor[:half, half:] = factor[half:, :half].T


class KronBlockPrecision:
    """One K-FAC layer of :math:`H` in the eigenbasis of its factors."""

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
        check_positive(column.detach(), "the prior precision of a K-FAC layer", block.index[0])
        self.block, self.scale = block, scale
        self.root_prior = column.sqrt()
        self.scalar = bool((column.detach() == column.detach()[0]).all())
        if self.scalar:
            self.input_values = block.input_eigenvalues / column[0]
        else:
            self.scaled = block.input_factor / self.root_prior.unsqueeze(-1) / self.root_prior
            self.input_values = _eigenvalues(self.scaled)
        self.eigenvalues = scale * block.output_eigenvalues.unsqueeze(-1) * self.input_values + 1
        self.num_outputs = prior.shape[0]

    @cached_property
    def input_vectors(self) -> Tensor:
        return self.block.input_eigenvectors if self.scalar else _eigenvectors(self.scaled)

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


class KronPrecision:
    """:math:`H` block-diagonal: K-FAC layers, and a diagonal for the rest."""

    def __init__(self, curvature: KronCurvature, prior_precision: Tensor, scale: Tensor | float):
        self.curvature, self.prior_precision, self.scale = curvature, prior_precision, scale
        self.blocks = [KronBlockPrecision(b, prior_precision[b.index], scale) for b in curvature.blocks]
        self.rest = scale * curvature.rest_diagonal + prior_precision[curvature.rest_index]
        check_positive(self.rest.detach(), "its diagonal", curvature.rest_index)

    def logdet(self) -> Tensor:
        return sum((b.logdet() for b in self.blocks), self.rest.log().sum())

    def _apply(self, v: Tensor, block_fn, rest: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for block in self.blocks:
            out[..., block.block.index] = block_fn(block, v[..., block.block.index])
        out[..., self.curvature.rest_index] = v[..., self.curvature.rest_index] * rest
        return out

    def solve(self, v: Tensor) -> Tensor:
        return self._apply(v, KronBlockPrecision.solve, self.rest.reciprocal())

    def matvec(self, v: Tensor) -> Tensor:
        return self.scale * self.curvature.matvec(v) + self.prior_precision * v

    def sample(self, num_samples: int, generator=None) -> Tensor:
        noise = gaussian_noise((num_samples, self.curvature.num_params), self.prior_precision, generator)
        return self._apply(noise, KronBlockPrecision.sample, self.rest.rsqrt())

    def joint_gaussian(self, sites, mean: Tensor) -> KronJoint:
        r""":math:`\mathcal N(\text{mean}, H^{-1})` as a prior, layer by layer in the factors' eigenbases."""
        dtype = mean.dtype
        blocks = [
            KronFactors(
                b.block.index,
                b.block.output_eigenvectors.detach().to(dtype),
                b.input_vectors.detach().to(dtype),
                b.eigenvalues.detach().to(dtype),
                torch.broadcast_to(b.root_prior.detach(), b.block.index.shape[-1:]).to(dtype),
            )
            for b in self.blocks
        ]
        return KronJoint(sites, mean, blocks, self.curvature.rest_index, self.rest.detach().to(dtype))

    def inverse_diagonal(self) -> Tensor:
        out = torch.empty_like(self.prior_precision)
        for block in self.blocks:
            out[block.block.index] = block.inverse_diagonal()
        out[self.curvature.rest_index] = self.rest.reciprocal()
        return out

    def to_dense(self) -> Tensor:
        return self.matvec(torch.eye(self.curvature.num_params, dtype=self.rest.dtype, device=self.rest.device))

    def functional_covariance(self, net, theta: Tensor, batch, plans, rest: Tensor) -> Moments:
        jacobian = OutputJacobian(net, theta, plans, rest, batch)
        points, width = jacobian.f.shape
        covariance = jacobian.f.new_zeros(points, width, width)
        for number, (block, b, a, plan) in enumerate(zip(self.blocks, jacobian.derivatives, jacobian.inputs, plans)):
            if plan.conv:
                layer = jacobian.layer(number) / block.root_prior  # (points, outputs, out, in')
                rotated = block.block.output_eigenvectors.T @ layer @ block.input_vectors
                covariance += torch.einsum("pmkj,pnkj,kj->pmn", rotated, rotated, block.eigenvalues.reciprocal())
                continue
            rotated = b @ block.block.output_eigenvectors
            inner = ((a / block.root_prior) @ block.input_vectors) ** 2
            weights = inner @ block.eigenvalues.reciprocal().T
            covariance += torch.einsum("pmk,pnk,pk->pmn", rotated, rotated, weights)
        return jacobian.f, jacobian.add_rest(covariance, self.rest.reciprocal()), jacobian.likelihood
