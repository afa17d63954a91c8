r"""The joint Gaussian over a model's flat unconstrained latent sites, as a chain of per-site conditionals.

The forms and the conditionals each one gives are derived in :mod:`pyro_scalable.infer.gaussian_prior`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import Transform

__all__ = ["JointGaussian", "SiteSpec"]

_LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True)
class SiteSpec:
    """One latent site of the joint prior: its name, constrained and unconstrained shapes, and its support."""

    name: str
    shape: torch.Size
    unconstrained_shape: torch.Size
    support: Any

    @property
    def size(self) -> int:
        return self.unconstrained_shape.numel()

    @property
    def transform(self) -> Transform:
        return biject_to(self.support)

    @property
    def has_jacobian(self) -> bool:
        support = self.support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        return support is not constraints.real


# ---------------------------------------------------------------------------- flat conditionals
def _mv(matrix: Tensor, vector: Tensor) -> Tensor:
    return (matrix @ vector.unsqueeze(-1)).squeeze(-1)


class _Flat:
    """A Gaussian over a flat vector, ``loc`` possibly batched; ``log_prob`` and ``rsample`` only."""

    loc: Tensor

    def rsample(self, shape: torch.Size) -> Tensor:
        raise NotImplementedError

    def log_prob(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def noise(self, shape: torch.Size, size: int) -> Tensor:
        return torch.randn(
            tuple(shape) + tuple(self.loc.shape[:-1]) + (size,), dtype=self.loc.dtype, device=self.loc.device
        )


class _Tril(_Flat):
    def __init__(self, loc: Tensor, scale_tril: Tensor):
        self.loc, self.scale_tril = loc, scale_tril

    def rsample(self, shape):
        return self.loc + _mv(self.scale_tril, self.noise(shape, self.loc.shape[-1]))

    def log_prob(self, x):
        diff = (x - self.loc).unsqueeze(-1)
        z = torch.linalg.solve_triangular(self.scale_tril, diff, upper=False).squeeze(-1)
        n = x.shape[-1]
        return -0.5 * z.square().sum(-1) - self.scale_tril.diagonal().log().sum() - 0.5 * n * _LOG_2PI


class _LowRankCovariance(_Flat):
    r""":math:`\mathcal N(\text{loc}, \mathrm{diag}(D) + FF^\top)`."""

    def __init__(self, loc: Tensor, diag: Tensor, factor: Tensor):
        self.loc, self.diag, self.factor = loc, diag, factor
        scaled = factor / diag.unsqueeze(-1)
        capacitance = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device) + factor.mT @ scaled
        self.scaled, self.cholesky = scaled, torch.linalg.cholesky(capacitance)

    def rsample(self, shape):
        n, k = self.factor.shape
        return self.loc + self.diag.sqrt() * self.noise(shape, n) + _mv(self.factor, self.noise(shape, k))

    def log_prob(self, x):
        diff = x - self.loc
        projected = (diff.unsqueeze(-2) @ self.scaled).squeeze(-2)
        whitened = torch.linalg.solve_triangular(self.cholesky, projected.unsqueeze(-1), upper=False).squeeze(-1)
        maha = (diff.square() / self.diag).sum(-1) - whitened.square().sum(-1)
        logdet = self.diag.log().sum() + 2 * self.cholesky.diagonal().log().sum()
        return -0.5 * (maha + logdet + x.shape[-1] * _LOG_2PI)


class _LowRankPrecision(_Flat):
    r""":math:`\mathcal N(\text{loc}, (\mathrm{diag}(P) + VV^\top)^{-1})`."""

    def __init__(self, loc: Tensor, precision: Tensor, factor: Tensor):
        self.loc, self.precision, self.factor = loc, precision, factor
        capacitance = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
        capacitance = capacitance + factor.mT @ (factor / precision.unsqueeze(-1))
        self.cholesky = torch.linalg.cholesky(capacitance)

    def solve(self, y: Tensor) -> Tensor:
        r""":math:`\Lambda^{-1} y` by Woodbury."""
        scaled = y / self.precision
        inner = torch.cholesky_solve((scaled.unsqueeze(-2) @ self.factor).mT, self.cholesky).mT.squeeze(-2)
        return scaled - _mv(self.factor, inner) / self.precision

    def rsample(self, shape):
        n, k = self.factor.shape
        # P^{1/2} e1 + V e2 has covariance Λ, so Λ^{-1} of it has covariance Λ^{-1}
        root = self.precision.sqrt() * self.noise(shape, n) + _mv(self.factor, self.noise(shape, k))
        return self.loc + self.solve(root)

    def log_prob(self, x):
        diff = x - self.loc
        maha = (self.precision * diff.square()).sum(-1) + (diff.unsqueeze(-2) @ self.factor).squeeze(-2).square().sum(
            -1
        )
        logdet = self.precision.log().sum() + 2 * self.cholesky.diagonal().log().sum()
        return -0.5 * (maha - logdet + x.shape[-1] * _LOG_2PI)


# ---------------------------------------------------------------------------- the joint forms
class JointGaussian:
    r"""A Gaussian over the flat unconstrained sites, in the model's order, as a chain of per-site conditionals.

    Build one with :meth:`diagonal`, :meth:`dense`, :meth:`low_rank_covariance` or :meth:`low_rank_precision`.
    ``conditional(s, state)`` is the flat conditional of site ``s`` given the deviations the ``state`` holds;
    ``update(s, state, delta)`` adds site ``s``'s deviation :math:`\delta_s = u_s - \mu_s`.
    """

    kind: str
    shrinkage: float | None = None  # from draws: the intensity towards the diagonal (gaussian_prior.shrinkage)

    def __init__(self, sites: list[SiteSpec], mean: Tensor):
        self.sites, self.mean = list(sites), mean.detach()
        self.index = {site.name: i for i, site in enumerate(self.sites)}
        starts = [0]
        for site in self.sites:
            starts.append(starts[-1] + site.size)
        if starts[-1] != mean.shape[-1]:
            raise ValueError(f"the sites hold {starts[-1]} numbers, the mean {mean.shape[-1]}.")
        self.slices = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]

    @property
    def num_params(self) -> int:
        return self.mean.shape[-1]

    # each form fills these
    def start(self) -> Any:
        return None

    def conditional(self, s: int, state: Any) -> _Flat | None:
        raise NotImplementedError

    def update(self, s: int, state: Any, delta: Tensor) -> Any:
        return state

    # a form defines at least one of these two; the other inverts it
    def covariance_matrix(self) -> Tensor:
        """The dense ``d x d`` covariance (for tests and small models)."""
        return _inverse(self.precision_matrix())

    def precision_matrix(self) -> Tensor:
        """The dense ``d x d`` precision (read by the ``full`` Laplace structure)."""
        return _inverse(self.covariance_matrix())

    def precision_diagonal(self) -> Tensor:
        """The diagonal of the precision: one over each coordinate's variance given all the others."""
        raise NotImplementedError

    @staticmethod
    def diagonal(sites, mean: Tensor, variance: Tensor) -> JointGaussian:
        return _Diagonal(sites, mean, variance)

    @staticmethod
    def dense(sites, mean: Tensor, covariance: Tensor) -> JointGaussian:
        return _Dense(sites, mean, covariance)

    @staticmethod
    def low_rank_covariance(sites, mean: Tensor, diag: Tensor, factor: Tensor) -> JointGaussian:
        return _LowRankCovarianceJoint(sites, mean, diag, factor)

    @staticmethod
    def low_rank_precision(sites, mean: Tensor, precision: Tensor, factor: Tensor) -> JointGaussian:
        return _LowRankPrecisionJoint(sites, mean, precision, factor)


class _Diagonal(JointGaussian):
    kind = "diagonal"

    def __init__(self, sites, mean, variance):
        super().__init__(sites, mean)
        self.scale = variance.detach().sqrt()

    def covariance_matrix(self):
        return torch.diag(self.scale.square())

    def precision_matrix(self):
        return torch.diag(self.scale.pow(-2))

    def precision_diagonal(self):
        return self.scale.pow(-2)


def _inverse(matrix: Tensor) -> Tensor:
    """The inverse of a symmetric positive-definite matrix, through its Cholesky factor in float64."""
    return torch.cholesky_inverse(torch.linalg.cholesky(matrix.double())).to(matrix.dtype)


def _concatenate(parts: list[Tensor]) -> Tensor:
    """Flat pieces with (possibly different) leading batch dimensions, joined along the last."""
    batch = torch.broadcast_shapes(*(p.shape[:-1] for p in parts))
    return torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], -1)


class _Dense(JointGaussian):
    kind = "dense"

    def __init__(self, sites, mean, covariance):
        super().__init__(sites, mean)
        covariance = covariance.detach()
        self.covariance = covariance
        tril = torch.linalg.cholesky(covariance.double()).to(covariance.dtype)
        # per site, contiguous: a strided slice would be copied by every triangular solve
        self.blocks = [(tril[rows, rows].contiguous(), tril[rows, : rows.start].contiguous()) for rows in self.slices]

    def start(self):
        return []

    def conditional(self, s, state):
        block, before = self.blocks[s]
        loc = self.mean[self.slices[s]]
        if state:
            loc = loc + _mv(before, _concatenate(state))
        return _Tril(loc, block)

    def update(self, s, state, delta):
        block, before = self.blocks[s]
        rest = delta - _mv(before, _concatenate(state)) if state else delta
        z = torch.linalg.solve_triangular(block, rest.unsqueeze(-1), upper=False).squeeze(-1)
        return [*state, z]

    def covariance_matrix(self):
        return self.covariance

    def precision_diagonal(self):
        return torch.linalg.inv(self.covariance.double()).diagonal().to(self.mean.dtype)


class _LowRankCovarianceJoint(JointGaussian):
    kind = "low_rank_covariance"

    def __init__(self, sites, mean, diag, factor):
        super().__init__(sites, mean)
        self.diag, self.factor = diag.detach(), factor.detach()
        k = self.factor.shape[-1]
        capacitance = torch.eye(k, dtype=self.factor.dtype, device=self.factor.device)
        self.factors = []  # per site: U_s W_s with W_s W_s^T = C_s^{-1}, and C_s^{-1}
        for rows in self.slices:
            inverse = torch.cholesky_inverse(torch.linalg.cholesky(capacitance))
            root = torch.linalg.cholesky(0.5 * (inverse + inverse.mT))
            self.factors.append((self.factor[rows] @ root, inverse))
            u = self.factor[rows]
            capacitance = capacitance + u.mT @ (u / self.diag[rows].unsqueeze(-1))

    def start(self):
        return None

    def conditional(self, s, state):
        rows = self.slices[s]
        factor, inverse = self.factors[s]
        loc = self.mean[rows]
        if state is not None:
            loc = loc + _mv(self.factor[rows] @ inverse, state)
        return _LowRankCovariance(loc, self.diag[rows], factor)

    def update(self, s, state, delta):
        rows = self.slices[s]
        r = _mv((self.factor[rows] / self.diag[rows].unsqueeze(-1)).mT, delta)
        return r if state is None else state + r

    def covariance_matrix(self):
        return torch.diag(self.diag) + self.factor @ self.factor.mT

    def precision_diagonal(self):
        # Woodbury: (D + UU^T)^{-1} = D^{-1} - D^{-1} U C^{-1} U^T D^{-1}, C = I + U^T D^{-1} U
        scaled = self.factor / self.diag.unsqueeze(-1)
        capacitance = torch.eye(scaled.shape[-1], dtype=scaled.dtype, device=scaled.device) + self.factor.mT @ scaled
        whitened = torch.linalg.solve_triangular(torch.linalg.cholesky(capacitance), scaled.mT, upper=False)
        return self.diag.reciprocal() - whitened.square().sum(0)


class _LowRankPrecisionJoint(JointGaussian):
    kind = "low_rank_precision"

    def __init__(self, sites, mean, precision, factor):
        super().__init__(sites, mean)
        self.precision, self.factor = precision.detach(), factor.detach()
        k = self.factor.shape[-1]
        later = torch.eye(k, dtype=self.factor.dtype, device=self.factor.device)
        self.factors: list[tuple[Tensor, Tensor]] = [None] * len(self.slices)  # type: ignore[list-item]
        for s in reversed(range(len(self.slices))):  # M_s = (I + sum_{t>s} V_t^T P_t^{-1} V_t)^{-1}
            rows = self.slices[s]
            m = torch.cholesky_inverse(torch.linalg.cholesky(later))
            m = 0.5 * (m + m.mT)
            self.factors[s] = (self.factor[rows] @ torch.linalg.cholesky(m), self.factor[rows] @ m)
            v = self.factor[rows]
            later = later + v.mT @ (v / self.precision[rows].unsqueeze(-1))

    def conditional(self, s, state):
        rows = self.slices[s]
        root, vm = self.factors[s]
        flat = _LowRankPrecision(self.mean[rows], self.precision[rows], root)
        if state is not None:
            flat.loc = self.mean[rows] - flat.solve(_mv(vm, state))
        return flat

    def update(self, s, state, delta):
        r = _mv(self.factor[self.slices[s]].mT, delta)
        return r if state is None else state + r

    def precision_matrix(self):
        return torch.diag(self.precision) + self.factor @ self.factor.mT

    def precision_diagonal(self):
        return self.precision + self.factor.square().sum(-1)
