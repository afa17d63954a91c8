r"""Likelihood families: the output :math:`f` of an observed site, its curvature :math:`\Lambda`, and its predictive.

For an observed site :math:`y_i \sim p(y \mid f_i)` the generalised Gauss-Newton matrix uses
:math:`\Lambda_i = -\partial^2 \log p(y_i \mid f) / \partial f^2` at :math:`f_i = f(x_i, \theta_*)`, which for
these families (natural parameters) does not depend on :math:`y` and equals the Fisher information:

============================  =======================================  ====================================
distribution                  output :math:`f` (linearised)             :math:`\Lambda`
============================  =======================================  ====================================
``Normal(loc, scale)``         ``loc``                                   :math:`\sigma^{-2}`
``Normal`` heteroscedastic     ``(loc, log scale)``                      :math:`\mathrm{diag}(\sigma^{-2}, 2)`
``Bernoulli``                  ``logits``                                :math:`p(1-p)`
``Binomial(n)``                ``logits``                                :math:`n\,p(1-p)`
``Categorical``                ``logits``                                :math:`\mathrm{diag}(p) - pp^\top`
``Poisson``                    ``log rate``                              :math:`\lambda`
============================  =======================================  ====================================

(The heteroscedastic Normal's :math:`\Lambda` is its Fisher information in ``(loc, log scale)``; the GGN with
the Fisher is the usual choice where the Hessian is not positive semi-definite.)

**Weights.** Pyro's ``poutine.scale(w)`` (a constant, or one weight per point: ``poutine.scale(w[idx])``) multiplies a
point's log-likelihood by :math:`w_i`, and ``poutine.mask`` by 0 or 1: the log joint is
:math:`\sum_i w_i \log p(y_i \mid f_i)`. Its gradient, its curvature :math:`w_i\Lambda_i` (so
:math:`L_i \leftarrow \sqrt{w_i} L_i`), the empirical Fisher's root :math:`\sqrt{w_i}\,\nabla_f\log p(y_i\mid f_i)`
and a Normal's weighted residual sum of squares and observation count :math:`\sum_i w_i` follow from that one
weight per output (:meth:`Likelihood.weight_outputs`); an integer weight is the point repeated that many times.

Each family returns :math:`f` flattened to ``(points, outputs)`` — points along the leading dimension of the
site's value, the data plate in every usual model — and a square root :math:`L_i` with
:math:`\Lambda_i = L_i L_i^\top`, shape ``(points, outputs, outputs)``. For a Categorical the closed form is
:math:`L = \mathrm{diag}(\sqrt p) - p\sqrt p^\top`. The linearised predictive of :math:`y` given
:math:`f \sim \mathcal N(m, V)` is exact for the Normal, the probit approximation
:math:`\sigma(m / \sqrt{1 + \pi v / 8})` (MacKay 1992) or Monte Carlo for classification, and Monte Carlo or a
moment-matched negative binomial for the Poisson.
"""

from __future__ import annotations

import math
from typing import Literal

import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError

__all__ = ["Likelihood", "LinkApprox", "likelihood_of"]

LinkApprox = Literal["probit", "mc"]


class Likelihood:
    """A family bound to one observed site's fixed parts (the Normal's scale, a Binomial's count, shapes)."""

    name: str = ""
    classification = False
    weight: Tensor | None = None  # poutine.scale's per-point weight, the site's batch shape (None: 1)

    def __init__(self, site: str, fn, mask: Tensor | None, raw_logits: Tensor | None = None):
        self.site = site
        self.raw_logits = raw_logits
        self.reinterpreted = 0
        while isinstance(fn, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
            if isinstance(fn, dist.Independent):
                self.reinterpreted += fn.reinterpreted_batch_ndims
            elif isinstance(fn, dist.MaskedDistribution):
                mask = fn._mask if mask is None else mask & fn._mask
            elif isinstance(fn, dist.ExpandedDistribution):
                raise ModelError(
                    f"observed site '{site}' uses .expand(); give the distribution parameters their full shape "
                    "(broadcast the loc/logits to the data) so each data point has its own output."
                )
            fn = fn.base_dist
        self.base = fn
        self.shape = self._output_shape(fn)
        self.mask = mask

    @classmethod
    def concatenate(cls, parts: list[Likelihood]) -> Likelihood:
        """One likelihood over the points of ``parts`` (chunks of one site, in order)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        joined = object.__new__(type(first))
        joined.__dict__.update(first.__dict__)
        joined.shape = torch.Size((sum(p.num_points for p in parts),)) + first.shape[1:]
        joined.raw_logits = None
        for name in ("scale", "total_count", "mask", "weight"):
            values = [getattr(p, name, None) for p in parts]
            if all(isinstance(v, Tensor) for v in values):
                setattr(
                    joined, name, torch.cat([torch.broadcast_to(v, p.shape[: v.dim()]) for v, p in zip(values, parts)])
                )
        return joined

    # ------------------------------------------------------------------ per family
    def _output_shape(self, fn) -> torch.Size:
        return fn.batch_shape + fn.event_shape

    def outputs(self) -> Tensor:
        """The output :math:`f` as ``(points, outputs)``."""
        raise NotImplementedError

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        raise NotImplementedError

    def predictive(self, mean: Tensor, covariance: Tensor, link_approx: LinkApprox, num_samples: int, generator):
        """The predictive distribution of ``y`` when ``f ~ N(mean, covariance)`` per point."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    @property
    def num_points(self) -> int:
        return self.shape[0] if len(self.shape) > self._event_dims else 1

    _event_dims = 0

    def flatten(self, value: Tensor) -> Tensor:
        """``value`` (the site's shape) as ``(points, outputs)``: the layout of the network output ``f``.

        The observed value, a scale or a mask per point reads row by row against ``f`` (a residual ``y - f``, the
        curvature's diagonal) only in this layout.
        """
        return value.reshape(self.num_points, -1)

    def _unflatten(self, f: Tensor) -> Tensor:
        return f.reshape(f.shape[:-2] + self.shape)

    def _wrap(self, fn):
        return fn.to_event(self.reinterpreted) if self.reinterpreted else fn

    def hessian_sqrt(self, f: Tensor) -> Tensor:
        r""":math:`L` with :math:`w\Lambda = L L^\top`, ``(points, outputs, outputs)``: zero rows where masked."""
        root = self._sqrt_lambda(f)
        if self.mask is not None or self.weight is not None:
            root = root * self.weight_outputs(f).sqrt().unsqueeze(-1)
        return root

    def score_root(self, score: Tensor) -> Tensor:
        r"""The empirical Fisher's root ``(points, outputs, 1)`` from ``score``, the gradient of :meth:`log_prob` in f.

        That gradient is :math:`w_i \nabla_f \log p(y_i \mid f_i)`; the root is :math:`\sqrt{w_i}` times the
        unweighted score, so that the squared root counts a point :math:`w_i` times (module docstring).
        """
        if self.weight is not None:
            weight = self.weight_outputs(score)
            score = torch.where(weight > 0, score / weight.sqrt().clamp_min(torch.finfo(score.dtype).tiny), 0.0)
        return score.unsqueeze(-1)

    def weight_outputs(self, f: Tensor) -> Tensor:
        """Each output's weight as ``f``'s ``(points, outputs)``: the point's ``poutine.scale`` weight, 0 if masked.

        Sums over the data (a residual sum of squares, the observation count, the curvature) weight each output by
        it, so that a masked output counts as not observed and a weight of 2 as observed twice.
        """
        keep = self._mask_outputs(f) if self.mask is not None else torch.ones_like(f)
        if self.weight is None:
            return keep
        return keep * self.flatten(torch.broadcast_to(self._site_weight(), self.shape).to(f.dtype))

    def _site_weight(self) -> Tensor:
        """The weight broadcast to the base distribution's batch shape (unit dimensions for the event's)."""
        batch = self.base.batch_shape
        outer = len(batch) - self.reinterpreted
        weight = torch.broadcast_to(self.weight, batch[:outer])
        return weight.reshape(batch[:outer] + (1,) * (len(self.shape) - outer))

    def _mask_outputs(self, f: Tensor) -> Tensor:
        batch = self.base.batch_shape
        mask = torch.broadcast_to(self.mask, batch).reshape(batch + (1,) * (len(self.shape) - len(batch)))
        return self.flatten(torch.broadcast_to(mask, self.shape).to(f.dtype))

    def _base(self, f: Tensor):
        raise NotImplementedError

    def distribution(self, f: Tensor):
        """The site's distribution at outputs ``f`` (``(points, outputs)``), with the site's own shape."""
        fn = self._base(f)
        return fn.to_event(self.reinterpreted) if self.reinterpreted else fn

    def log_prob(self, f: Tensor, value: Tensor) -> Tensor:
        """Sum over the site of ``w log p(value | f)`` (``poutine.scale``'s weights), masked points left out."""
        log_prob = self._base(f).log_prob(value)
        if self.mask is not None:
            log_prob = torch.where(torch.broadcast_to(self.mask, log_prob.shape), log_prob, 0.0)
        if self.weight is not None:
            weight = self._site_weight()
            log_prob = log_prob * weight.reshape(weight.shape[: log_prob.dim()])
        return log_prob.sum()


class _Normal(Likelihood):
    name = "Normal"

    def __init__(self, site, fn, mask, heteroscedastic: bool):
        super().__init__(site, fn, mask)
        self.heteroscedastic = heteroscedastic
        self.scale = torch.broadcast_to(self.base.scale, self.shape)

    def with_noise(self, noise: Tensor) -> _Normal:
        """The same site with a homoscedastic scale ``noise`` (as fitted by the evidence)."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.scale = torch.broadcast_to(noise.to(self.scale), self.shape)
        return copy

    def outputs(self) -> Tensor:
        loc = self.flatten(torch.broadcast_to(self.base.loc, self.shape))
        if self.heteroscedastic:
            return torch.cat([loc, self.flatten(self.scale).log()], dim=-1)
        return loc

    @property
    def width(self) -> int:
        return self.shape.numel() // self.num_points

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        if self.heteroscedastic:
            diagonal = torch.cat([(-f[..., self.width :]).exp(), torch.full_like(f[..., self.width :], 2**0.5)], -1)
        else:
            diagonal = self.flatten(self.scale).reciprocal().expand_as(f)
        return torch.diag_embed(diagonal)

    def weight_outputs(self, f: Tensor) -> Tensor:
        """The weights of the mean outputs, repeated for the log-scale outputs when the scale is heteroscedastic."""
        keep = super().weight_outputs(f[..., : self.width])
        return torch.cat([keep, keep], -1) if self.heteroscedastic else keep

    def _split(self, f: Tensor) -> tuple[Tensor, Tensor]:
        if self.heteroscedastic:
            return self._unflatten(f[..., : self.width]), self._unflatten(f[..., self.width :]).exp()
        return self._unflatten(f), self.scale

    def _base(self, f: Tensor):
        return dist.Normal(*self._split(f))

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        if not self.heteroscedastic:
            loc, noise = self._unflatten(mean), self.scale
            return self._wrap(dist.Normal(loc, (self._unflatten(variance) + noise**2).sqrt()))
        # y = loc + exp(s) eps: E[y] = E[loc], Var[y] = Var[loc] + E[exp(2 s)] (a log-normal moment)
        width = self.width
        loc = self._unflatten(mean[..., :width])
        noise_var = (2 * mean[..., width:] + 2 * variance[..., width:]).exp()
        return self._wrap(dist.Normal(loc, self._unflatten(variance[..., :width] + noise_var).sqrt()))


class _Bernoulli(Likelihood):
    name = "Bernoulli"
    classification = True

    def outputs(self) -> Tensor:
        return self.flatten(torch.broadcast_to(self.base.logits, self.shape))

    def _count(self) -> Tensor | float:
        return 1.0

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        p = torch.sigmoid(f)
        return torch.diag_embed((self._count() * p * (1 - p)).sqrt())

    def _base(self, f: Tensor):
        return dist.Bernoulli(logits=self._unflatten(f))

    def _probs(self, mean, covariance, link_approx, num_samples, generator) -> Tensor:
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        if link_approx == "probit":
            return torch.sigmoid(mean / (1 + math.pi / 8 * variance).sqrt())
        draws = _gaussian_draws(mean, variance.sqrt(), num_samples, generator)
        return torch.sigmoid(draws).mean(0)

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        probs = self._probs(mean, covariance, link_approx, num_samples, generator)
        return self._wrap(dist.Bernoulli(probs=self._unflatten(probs)))


class _Binomial(_Bernoulli):
    name = "Binomial"

    def __init__(self, site, fn, mask):
        super().__init__(site, fn, mask)
        self.total_count = torch.broadcast_to(torch.as_tensor(self.base.total_count), self.shape)

    def _count(self) -> Tensor:
        return self.flatten(self.total_count)

    def _base(self, f: Tensor):
        return dist.Binomial(self.total_count, logits=self._unflatten(f))

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        probs = self._probs(mean, covariance, link_approx, num_samples, generator)
        return self._wrap(dist.Binomial(self.total_count, probs=self._unflatten(probs)))


class _Categorical(Likelihood):
    name = "Categorical"
    classification = True
    _event_dims = 1

    def _output_shape(self, fn) -> torch.Size:
        return fn.batch_shape + fn.logits.shape[-1:]

    @property
    def num_classes(self) -> int:
        return self.shape[-1]

    def outputs(self) -> Tensor:
        logits = self.base.logits if self.raw_logits is None else self.raw_logits
        return self.flatten(torch.broadcast_to(logits, self.shape))

    def _groups(self, f: Tensor) -> Tensor:
        return f.reshape(f.shape[:-1] + (-1, self.num_classes))

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        p = torch.softmax(self._groups(f), -1)
        root_p = p.sqrt()
        blocks = p.unsqueeze(-1) * -root_p.unsqueeze(-2)  # (points, groups, K, K): diag(√p) - p √pᵀ
        blocks.diagonal(dim1=-2, dim2=-1).add_(root_p)
        return blocks.squeeze(-3) if blocks.shape[-3] == 1 else _block_diag(blocks)

    def _base(self, f: Tensor):
        return dist.Categorical(logits=self._unflatten(f))

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        if link_approx == "probit":
            variance = covariance.diagonal(dim1=-2, dim2=-1)
            probs = torch.softmax(self._groups(mean / (1 + math.pi / 8 * variance).sqrt()), -1)
        else:
            draws = _gaussian_draws_full(mean, covariance, num_samples, generator)
            probs = torch.softmax(self._groups(draws), -1).mean(0)
        return self._wrap(dist.Categorical(probs=self._unflatten(probs.flatten(-2))))


class _Poisson(Likelihood):
    name = "Poisson"

    def outputs(self) -> Tensor:
        return self.flatten(torch.broadcast_to(self.base.rate, self.shape)).log()

    def _sqrt_lambda(self, f: Tensor) -> Tensor:
        return torch.diag_embed((0.5 * f).exp())

    def _base(self, f: Tensor):
        return dist.Poisson(self._unflatten(f).exp())

    def predictive(self, mean, covariance, link_approx, num_samples, generator):
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        if link_approx == "mc":
            rates = _gaussian_draws(mean, variance.sqrt(), num_samples, generator).exp()
            components = dist.Poisson(rates.movedim(0, -1).reshape(self.shape + (num_samples,)))
            mixing = dist.Categorical(logits=rates.new_zeros(self.shape + (num_samples,)))
            return self._wrap(dist.MixtureSameFamily(mixing, components))
        # Poisson-log-normal, moment-matched by a negative binomial: mean mu, variance mu + mu^2 (e^v - 1)
        mu = (mean + variance / 2).exp()
        total_count = 1 / variance.clamp_min(torch.finfo(mean.dtype).tiny).expm1()
        probs = mu / (mu + total_count)
        return self._wrap(dist.NegativeBinomial(self._unflatten(total_count), probs=self._unflatten(probs)))


_FAMILIES = {
    dist.Normal: _Normal,
    dist.Bernoulli: _Bernoulli,
    dist.Binomial: _Binomial,
    dist.Categorical: _Categorical,
    dist.Poisson: _Poisson,
}


def likelihood_of(
    site: str,
    fn,
    mask: Tensor | None = None,
    *,
    heteroscedastic: bool = False,
    raw_logits: Tensor | None = None,
    weight: Tensor | float | None = None,
) -> Likelihood:
    """The family of observed ``site`` whose distribution is ``fn`` (raises a :class:`ModelError` if unknown).

    ``raw_logits`` are a Categorical's logits before normalisation, when known: the GGN does not depend on the
    choice, but the probit approximation does, and the usual convention linearises the network's own logits.
    ``weight``: the site's ``poutine.scale`` weight (a constant or one per point of its batch shape; ``None``: 1).
    """
    likelihood = _family(site, fn, mask, heteroscedastic, raw_logits)
    if weight is not None:
        outer = likelihood.base.batch_shape[: len(likelihood.base.batch_shape) - likelihood.reinterpreted]
        like = likelihood.base.mean  # a tensor of the outputs' dtype and device (a Categorical's is NaN)
        weight = torch.as_tensor(weight, dtype=like.dtype, device=like.device)
        bad = ~torch.isfinite(weight) | (weight < 0)
        if bool(bad.any()):
            raise ModelError(
                f"observed site '{site}' has a poutine.scale weight that is negative or not finite "
                f"({weight[bad].flatten()[0].item() if weight.dim() else weight.item():.3g}); weights must be >= 0."
            )
        likelihood.weight = torch.broadcast_to(weight, outer).detach()
    return likelihood


def _family(site: str, fn, mask: Tensor | None, heteroscedastic: bool, raw_logits: Tensor | None) -> Likelihood:
    base = fn
    while isinstance(base, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        base = base.base_dist
    for family, cls in _FAMILIES.items():
        if type(base) is family:
            if cls is _Normal:
                return cls(site, fn, mask, heteroscedastic)
            return cls(site, fn, mask, raw_logits) if cls is _Categorical else cls(site, fn, mask)
    known = ", ".join(f.__name__ for f in _FAMILIES)
    raise ModelError(
        f"observed site '{site}' has a {type(base).__name__} likelihood, whose GGN curvature is not known here "
        f"(known: {known}). Write the likelihood with one of these families."
    )


def _block_diag(blocks: Tensor) -> Tensor:
    # (points, groups, K, K) -> (points, groups*K, groups*K)
    points, groups, size, _ = blocks.shape
    out = blocks.new_zeros(points, groups, size, groups, size)
    index = torch.arange(groups, device=blocks.device)
    out[:, index, :, index, :] = blocks.movedim(1, 0)
    return out.reshape(points, groups * size, groups * size)


def _gaussian_draws(mean: Tensor, scale: Tensor, num_samples: int, generator) -> Tensor:
    noise = torch.randn((num_samples,) + mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + scale * noise


def _gaussian_draws_full(mean: Tensor, covariance: Tensor, num_samples: int, generator) -> Tensor:
    eye = torch.eye(covariance.shape[-1], dtype=covariance.dtype, device=covariance.device)
    jitter = 1e-10 * covariance.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[..., None, None]
    root = torch.linalg.cholesky(covariance + jitter * eye)
    noise = torch.randn((num_samples,) + mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + torch.einsum("nij,snj->sni", root, noise)
