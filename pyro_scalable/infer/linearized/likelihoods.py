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

The families themselves, and :func:`~.families.likelihood_of` (the one of an observed site), are in :mod:`.families`.
"""

from __future__ import annotations

from typing import Literal

import pyro.distributions as dist
import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError

__all__ = ["Likelihood", "LinkApprox"]

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
