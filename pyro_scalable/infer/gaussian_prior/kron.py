r"""The Kronecker-factored (K-FAC) precision as a joint prior, without a ``d x d`` matrix.

The ``kron`` Laplace posterior's precision is block-diagonal: one block per layer, the rest diagonal. A layer's
block acts on its ``(outputs, inputs')`` matrix of deviations :math:`V` (the bias folded in as the last input) as

.. math::

    H V = r \odot Q_B\big(E \odot Q_B^\top (r \odot V)\, Q_A\big) Q_A^\top,

with :math:`r` the square root of the prior precision along the inputs, :math:`Q_B, Q_A` the eigenvectors of the
two factors and :math:`E` the eigenvalues of the whitened block (``laplace/structures/kron.py``): so
:math:`\log\det H = 2\,\mathrm{outputs}\sum\log r + \sum\log E` and a draw is
:math:`V = r^{-1}\odot Q_B (E^{-1/2}\odot Z) Q_A^\top`.

Blocks are independent of each other and of the rest, so a site's conditional is a product over the pieces of the
blocks it holds. A block within one site is its own Gaussian. A block split over two sites — a layer's weight
sampled first, its bias second — gives the earlier site the marginal of its part :math:`x_1` and the later site
the conditional of :math:`x_2`:

* :math:`x_2 \mid x_1 \sim \mathcal N(\mu_2 - H_{22}^{-1} b,\ H_{22}^{-1})` with :math:`b = [H(\delta_1, 0)]_2`,
  :math:`H_{22}` formed from :math:`|x_2|` products with :math:`H` (a bias: one per output);
* :math:`\log p(x_1) = -\tfrac12\big(\delta_1^\top[H(\delta_1,0)]_1 - b^\top H_{22}^{-1} b\big)
  + \tfrac12(\log\det H - \log\det H_{22}) - \tfrac{|x_1|}2\log 2\pi` (the Schur complement, never formed), and a
  draw of :math:`x_1` is the first part of a draw of the block.

The part that comes second must be small (:data:`LATER_LIMIT` numbers): a model that samples a layer's bias before
its weight gets an error naming the other structures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.gaussian_prior.joint import JointGaussian, SiteSpec, _Flat, _mv, _Tril

__all__ = ["LATER_LIMIT", "KronFactors", "KronJoint"]

LATER_LIMIT = 4096  # numbers of a K-FAC block's later part, whose precision H_22 is formed
_LOG_2PI = math.log(2 * math.pi)


@dataclass
class KronFactors:
    r"""One layer's block: flat ``index`` ``(outputs, inputs')`` and the factors of :math:`H` (module docstring)."""

    index: Tensor  # (out, in') long, positions in the flat vector of the sites
    output_vectors: Tensor  # Q_B (out, out)
    input_vectors: Tensor  # Q_A (in', in')
    eigenvalues: Tensor  # E (out, in')
    root_prior: Tensor  # r (in',)

    def matvec(self, v: Tensor) -> Tensor:
        """:math:`HV` for ``v`` ``(..., out, in')``."""
        rotated = self.output_vectors.mT @ (v * self.root_prior) @ self.input_vectors
        return (self.output_vectors @ (rotated * self.eigenvalues) @ self.input_vectors.mT) * self.root_prior

    def deviation(self, noise: Tensor) -> Tensor:
        r"""A draw of :math:`V - \mu` from standard-normal ``noise`` ``(..., out, in')``."""
        return (self.output_vectors @ (noise * self.eigenvalues.rsqrt()) @ self.input_vectors.mT) / self.root_prior

    def logdet(self) -> Tensor:
        return 2 * self.index.shape[0] * self.root_prior.log().sum() + self.eigenvalues.log().sum()

    def precision_diagonal(self) -> Tensor:
        """The diagonal of :math:`H`, ``(out, in')``."""
        return (self.output_vectors**2 @ self.eigenvalues @ (self.input_vectors**2).mT) * self.root_prior**2


class _Piece:
    """A Gaussian over some coordinates of a site: ``loc``, a draw's deviation from noise, ``log_prob``."""

    loc: Tensor
    noise_size: int

    def deviation(self, noise: Tensor) -> Tensor:
        raise NotImplementedError

    def log_prob(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class _WholeBlock(_Piece):
    def __init__(self, factors: KronFactors, mean: Tensor):
        self.factors, self.loc = factors, mean  # mean flat (out * in')
        self.shape = factors.index.shape
        self.noise_size = factors.index.numel()
        self.constant = 0.5 * factors.logdet() - 0.5 * self.noise_size * _LOG_2PI

    def deviation(self, noise):
        return self.factors.deviation(noise.reshape(noise.shape[:-1] + self.shape)).flatten(-2)

    def log_prob(self, x):
        delta = (x - self.loc).reshape(x.shape[:-1] + self.shape)
        return -0.5 * (delta * self.factors.matvec(delta)).sum((-2, -1)) + self.constant


class _SplitBlock:
    """A block whose coordinates ``first`` lie in an earlier site and ``second`` in a later one."""

    def __init__(self, factors: KronFactors, mean: Tensor, first: Tensor, second: Tensor):
        self.factors, self.mean, self.first, self.second = factors, mean, first, second
        self.shape = factors.index.shape
        self.inverse = torch.argsort(torch.cat([first, second]))
        size = factors.index.numel()
        basis = torch.zeros(len(second), size, dtype=mean.dtype, device=mean.device)
        basis[torch.arange(len(second), device=mean.device), second] = 1.0
        columns = factors.matvec(basis.reshape((len(second),) + self.shape)).flatten(-2)[:, second]
        precision = 0.5 * (columns + columns.mT)  # H_22
        cholesky = torch.linalg.cholesky(precision.double())
        self.precision_cholesky = cholesky.to(mean.dtype)
        self.covariance_tril = torch.linalg.cholesky(torch.cholesky_inverse(cholesky)).to(mean.dtype)
        self.logdet_second = 2 * cholesky.diagonal().log().sum().to(mean.dtype)

    def products(self, delta_first: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`[H(\delta_1, 0)]_1` and :math:`b = [H(\delta_1, 0)]_2`."""
        zeros = delta_first.new_zeros(delta_first.shape[:-1] + (len(self.second),))
        full = torch.cat([delta_first, zeros], -1)[..., self.inverse]  # no in-place writes: it runs under vmap
        product = self.factors.matvec(full.reshape(full.shape[:-1] + self.shape)).flatten(-2)
        return product[..., self.first], product[..., self.second]

    def solve_second(self, b: Tensor) -> Tensor:
        return torch.cholesky_solve(b.unsqueeze(-1), self.precision_cholesky).squeeze(-1)


class _Marginal(_Piece):
    """The earlier site's part of a split block, marginally."""

    def __init__(self, split: _SplitBlock):
        self.split = split
        self.loc = split.mean[split.first]
        self.noise_size = split.factors.index.numel()
        self.constant = 0.5 * (split.factors.logdet() - split.logdet_second) - 0.5 * len(split.first) * _LOG_2PI

    def deviation(self, noise):
        whole = self.split.factors.deviation(noise.reshape(noise.shape[:-1] + self.split.shape)).flatten(-2)
        return whole[..., self.split.first]

    def log_prob(self, x):
        delta = x - self.loc
        first, b = self.split.products(delta)
        quadratic = (delta * first).sum(-1) - (b * self.split.solve_second(b)).sum(-1)
        return -0.5 * quadratic + self.constant


class _Conditional(_Piece):
    """The later site's part of a split block given the earlier part's deviation."""

    def __init__(self, split: _SplitBlock, delta_first: Tensor | None):
        self.split = split
        loc = split.mean[split.second]
        if delta_first is not None:
            loc = loc - split.solve_second(split.products(delta_first)[1])
        self.flat = _Tril(loc, split.covariance_tril)
        self.loc, self.noise_size = loc, len(split.second)

    def deviation(self, noise):
        return _mv(self.split.covariance_tril, noise)

    def log_prob(self, x):
        return self.flat.log_prob(x)


class _DiagonalPiece(_Piece):
    def __init__(self, mean: Tensor, precision: Tensor):
        self.loc, self.precision = mean, precision
        self.noise_size = len(mean)
        self.constant = 0.5 * precision.log().sum() - 0.5 * len(mean) * _LOG_2PI

    def deviation(self, noise):
        return noise * self.precision.rsqrt()

    def log_prob(self, x):
        return -0.5 * (self.precision * (x - self.loc).square()).sum(-1) + self.constant


class _Product(_Flat):
    """A site's conditional: independent pieces, each over its own ``positions`` of the site."""

    def __init__(self, pieces: list[tuple[Tensor, _Piece]], size: int):
        self.pieces, self.size = pieces, size
        self.inverse = torch.argsort(torch.cat([positions for positions, _ in pieces]))
        if len(self.inverse) != size:
            raise ValueError(f"the pieces cover {len(self.inverse)} of the site's {size} numbers.")
        self.loc = self._join([piece.loc for _, piece in pieces])

    def _join(self, parts: list[Tensor]) -> Tensor:
        # the pieces side by side, then in the site's order (no in-place writes: it runs under vmap)
        batch = torch.broadcast_shapes(*(p.shape[:-1] for p in parts))
        return torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], -1)[..., self.inverse]

    def rsample(self, shape):
        batch = tuple(shape) + tuple(self.loc.shape[:-1])
        like = {"dtype": self.loc.dtype, "device": self.loc.device}
        draws = [
            piece.loc + piece.deviation(torch.randn(batch + (piece.noise_size,), **like)) for _, piece in self.pieces
        ]
        return self._join(draws).expand(batch + (self.size,))

    def log_prob(self, x):
        return sum(piece.log_prob(x[..., positions]) for positions, piece in self.pieces)


class KronJoint(JointGaussian):
    """The K-FAC precision's Gaussian over the sites: layer blocks and a diagonal rest (module docstring)."""

    kind = "kron"

    def __init__(
        self,
        sites: list[SiteSpec],
        mean: Tensor,
        blocks: list[KronFactors],
        rest_index: Tensor,
        rest_precision: Tensor,
    ):
        super().__init__(sites, mean)
        self.blocks, self.rest_index, self.rest_precision = blocks, rest_index, rest_precision.detach()
        site_of = torch.empty(self.num_params, dtype=torch.long, device=mean.device)
        for s, rows in enumerate(self.slices):
            site_of[rows] = s
        starts = torch.tensor([rows.start for rows in self.slices], device=mean.device)
        # per site: (positions in the site, piece kind, block number, coordinates of the block)
        self.parts: list[list[tuple]] = [[] for _ in self.sites]
        self.splits: dict[int, _SplitBlock] = {}
        for number, factors in enumerate(blocks):
            flat = factors.index.flatten()
            owners = site_of[flat]
            order = sorted(set(owners.tolist()))
            block_mean = self.mean[flat]
            if len(order) == 1:
                self.parts[order[0]].append(
                    (flat - starts[order[0]], "whole", number, _WholeBlock(factors, block_mean))
                )
                continue
            if len(order) > 2:
                raise ModelError(
                    f"a K-FAC layer spans {len(order)} latent sites; as_prior conditions across two at most. Fit "
                    "structure='diag' or 'low_rank' for this model's prior."
                )
            first = (owners == order[0]).nonzero().squeeze(-1)
            second = (owners == order[1]).nonzero().squeeze(-1)
            if len(second) > LATER_LIMIT:
                raise ModelError(
                    f"the K-FAC layer of sites '{self.sites[order[0]].name}' and '{self.sites[order[1]].name}' puts "
                    f"{len(second)} numbers in the later site (at most {LATER_LIMIT}: a layer's bias sampled after its "
                    "weight is fine; a weight sampled after its bias is not). Sample the bias after the weight, or fit "
                    "structure='diag' or 'low_rank'."
                )
            split = _SplitBlock(factors, block_mean, first, second)
            self.splits[number] = split
            self.parts[order[0]].append((flat[first] - starts[order[0]], "first", number, _Marginal(split)))
            self.parts[order[1]].append((flat[second] - starts[order[1]], "second", number, None))
        rest_owner = site_of[rest_index]
        for s in range(len(self.sites)):
            mine = rest_index[rest_owner == s]
            if len(mine):
                piece = _DiagonalPiece(self.mean[mine], self.rest_precision[rest_owner == s])
                self.parts[s].append((mine - starts[s], "rest", -1, piece))

    def start(self):
        return {}

    def conditional(self, s, state):
        pieces = []
        for positions, kind, number, piece in self.parts[s]:
            if kind == "second":
                piece = _Conditional(self.splits[number], state.get(number))
            pieces.append((positions, piece))
        return _Product(pieces, self.sites[s].size)

    def update(self, s, state, delta):
        state = dict(state)
        for positions, kind, number, _ in self.parts[s]:
            if kind == "first":
                state[number] = delta[..., positions]
        return state

    def precision_matrix(self):
        eye = torch.eye(self.num_params, dtype=self.mean.dtype, device=self.mean.device)
        out = torch.zeros_like(eye)
        for factors in self.blocks:
            flat = factors.index.flatten()
            columns = factors.matvec(eye[flat][:, flat].reshape((len(flat),) + factors.index.shape)).flatten(-2)
            out[flat.unsqueeze(-1), flat] = columns
        out[self.rest_index, self.rest_index] = self.rest_precision
        return out

    def precision_diagonal(self):
        out = torch.empty_like(self.mean)
        for factors in self.blocks:
            out[factors.index.flatten()] = factors.precision_diagonal().flatten()
        out[self.rest_index] = self.rest_precision
        return out
