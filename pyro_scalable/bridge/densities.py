r"""A site's summed log density (fast paths for two common likelihoods and priors), and a model's at given latents.

:class:`Evaluate` is the handler that substitutes the latents and sums the sites' terms (all, or the prior's or the
data's only). The fast paths: Normals whose scale is one expanded number, and Bernoullis given by their logits.

A prior written the usual way, ``dist.Normal(0., s).expand(shape).to_event(k)``, holds ``scale`` as a stride-0
view of one number; ``torch.distributions.Normal.log_prob`` then builds ``scale ** 2`` and ``scale.log()`` at the
full size of the site on every call (and their backward), which on a network's weights costs more than the prior's
arithmetic itself. Where the scale aliases one element :math:`\sigma` and the site's Pyro scale is a number with no
mask, the bridge only needs the sum

.. math::

    \sum_i \log \mathcal{N}(v_i;\ \mu_i, \sigma)
        = -\frac{1}{2\sigma^2} \sum_i (v_i - \mu_i)^2 - n \log\sigma - \frac{n}{2}\log 2\pi,

which reads ``loc`` as it is (broadcast) and :math:`\sigma` as a 0-d tensor.

A ``Bernoulli(logits=f)`` (the usual classification likelihood) has
:math:`\sum_i \log p(y_i\mid f_i) = -\sum_i \mathrm{BCE}(f_i, y_i)`; ``log_prob`` computes the binary cross-entropy
per element, then the bridge negates, scales and sums those elements (and their backward walks each step back at
the minibatch's size). One ``binary_cross_entropy_with_logits(..., reduction="sum")`` computes the sum in one
kernel, and the negation and scale act on one number.

Every other site goes through the distribution's own ``log_prob``. The fast paths agree with it to rounding
(``tests/bridge/test_densities.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Number

import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.distributions import Bernoulli, Independent, Normal
from torch.nn.functional import binary_cross_entropy_with_logits

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.records import Latents, LatentSite

__all__ = ["Evaluate", "summed_log_prob"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _one_number(x: Tensor) -> Tensor | None:
    """``x`` as a 0-d tensor when every element of ``x`` is the same memory (an expanded number), else ``None``."""
    if x.dim() == 0:
        return x
    if all(stride == 0 or size == 1 for stride, size in zip(x.stride(), x.shape, strict=True)):
        return x[(0,) * x.dim()]
    return None


def _plain_normal(fn) -> Normal | None:
    while isinstance(fn, Independent):
        fn = fn.base_dist
    if isinstance(fn, Normal) and type(fn).log_prob is Normal.log_prob:
        return fn
    return None


def _logits_bernoulli(fn) -> Tensor | None:
    """The logits of a plain ``Bernoulli`` built from its logits (not its probabilities), else ``None``."""
    while isinstance(fn, Independent):
        fn = fn.base_dist
    if isinstance(fn, Bernoulli) and type(fn).log_prob is Bernoulli.log_prob and "logits" in vars(fn):
        return fn.logits
    return None


def _number_scale(scale) -> bool:
    return isinstance(scale, Number) or (isinstance(scale, Tensor) and scale.dim() == 0)


def _covers(shape: torch.Size, other: torch.Size) -> bool:
    """Whether ``shape`` is the broadcast of ``shape`` and ``other`` (``torch.broadcast_shapes`` imports sympy)."""
    if len(other) > len(shape):
        return False
    return all(b == 1 or b == a for a, b in zip(shape[len(shape) - len(other) :], other, strict=True))


def summed_log_prob(fn, value: Tensor, scale, mask, args: tuple = (), kwargs: dict | None = None) -> Tensor:
    """``scale_and_mask(fn.log_prob(value), scale, mask).sum()``, cheaper on the fast paths."""
    plain = not args and not kwargs and (mask is None or mask is True) and _number_scale(scale)
    logits = _logits_bernoulli(fn) if plain else None
    if logits is not None and _covers(value.shape, logits.shape) and logits.dtype == value.dtype:
        return -binary_cross_entropy_with_logits(logits.expand(value.shape), value, reduction="sum") * scale
    normal = _plain_normal(fn) if plain else None
    sigma = _one_number(normal.scale) if normal is not None else None
    if sigma is None or not _covers(value.shape, normal.batch_shape):
        log_prob = fn.log_prob(value, *args, **(kwargs or {}))
        return scale_and_mask(log_prob, scale, mask).sum()
    n = value.numel()
    total = (value - normal.loc).square().sum() * (-0.5 / sigma.square()) - n * (sigma.log() + _HALF_LOG_2PI)
    return total * scale


class Evaluate(Messenger):
    """Substitute unconstrained latents and accumulate the scaled log joint (and pointwise log-likelihoods).

    ``part="prior"`` sums only the latent sites' terms (densities and Jacobians), ``"data"`` only the observed sites'.
    """

    def __init__(self, sites: Mapping[str, LatentSite], latents: Latents, pointwise: bool = False, part: str = ""):
        super().__init__()
        self.sites = sites
        self.latents = latents
        self.pointwise = pointwise
        self.prior, self.data = part != "data", part != "prior"
        self.log_joint: Tensor | float = 0.0
        self.log_likelihood: dict[str, Tensor] = {}

    def _pyro_sample(self, msg) -> None:
        if site_is_subsample(msg) or msg["is_observed"]:
            return
        site = self.sites.get(msg["name"])
        if site is None:
            raise ModelError(
                f"latent site '{msg['name']}' did not appear when the model was first traced; "
                "the set of latent sites must not depend on the data or the minibatch."
            )
        unconstrained = self.latents[site.name]
        value = site.transform(unconstrained)
        if site.has_jacobian and self.prior:
            self.log_joint = self.log_joint + site.transform.log_abs_det_jacobian(unconstrained, value).sum()
        msg["value"] = value
        msg["done"] = True

    def _pyro_post_sample(self, msg) -> None:
        if site_is_subsample(msg) or msg["infer"].get("_deterministic"):
            return
        if not (self.data if msg["is_observed"] else self.prior):
            return
        fn, value, args, kwargs = msg["fn"], msg["value"], msg["args"], msg["kwargs"]
        if self.pointwise and msg["is_observed"]:
            log_prob = fn.log_prob(value, *args, **kwargs)
            self.log_likelihood[msg["name"]] = log_prob
            self.log_joint = self.log_joint + scale_and_mask(log_prob, msg["scale"], msg["mask"]).sum()
        else:
            self.log_joint = self.log_joint + summed_log_prob(fn, value, msg["scale"], msg["mask"], args, kwargs)
