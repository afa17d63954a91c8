r"""The priors of a network's random parameters: independent Normals, centred at zero or at the pretrained values.

Each random parameter :math:`\theta_s` of shape :math:`(d_1, \dots, d_k)` gets one Pyro site with

.. math::

    \theta_s \sim \mathcal{N}(c_s, \sigma_s^2 I), \qquad c_s = 0 \ \text{(``center="zero"``)} \ \text{or} \
    c_s = \theta_s^{\text{pretrained}} \ \text{(``center="pretrained"``)},

as ``Normal(c_s, σ_s).expand(shape).to_event(k)``: one event over the whole tensor, so the site's log density is a
0-d sum. The scale :math:`\sigma_s` is

* a number: the same for every parameter (iid);
* a mapping from parameter names, ``fnmatch`` patterns or layer paths to numbers (layer-wise): the first key that
  matches a parameter gives its scale; every random parameter must be matched (``"*"`` matches all);
* ``"fan_in"``: :math:`1/\sqrt{\text{fan-in}}` for a weight (the product of its dimensions after the first, as
  ``nn.Linear``, ``nn.Conv*`` and ``nn.Embedding`` lay them out), 1 for a vector (biases, norms' scales): the
  scale of the usual initialisations, under which a layer's pre-activations keep unit variance.

A pretrained centre with a small scale is a prior that shrinks towards the network one starts from (the
:math:`L^2`-SP penalty of fine-tuning); a zero centre is weight decay's prior.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, Union

import pyro.distributions as dist
from torch import Tensor

from pyro_scalable.nn.selection import _matches

__all__ = ["PriorScale", "parameter_prior", "prior_scales"]

PriorScale = Union[float, Mapping[str, float], Literal["fan_in"]]


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"prior_scale for {name!r} must be a positive finite number, got {value!r}.")
    return float(value)


def prior_scales(parameters: Mapping[str, Tensor], prior_scale: PriorScale) -> dict[str, float]:
    """The prior sd σ_s of each random parameter, by name.

    Example:
        >>> import torch
        >>> prior_scales({"0.weight": torch.zeros(8, 4), "0.bias": torch.zeros(8)}, "fan_in")
        {'0.weight': 0.5, '0.bias': 1.0}

    """
    if isinstance(prior_scale, str):
        if prior_scale != "fan_in":
            raise ValueError(f"prior_scale must be a positive number, a mapping or 'fan_in', got {prior_scale!r}.")
        return {name: 1 / math.sqrt(math.prod(p.shape[1:])) if p.dim() >= 2 else 1.0 for name, p in parameters.items()}
    if isinstance(prior_scale, Mapping):
        scales = {}
        for name in parameters:
            key = next((key for key in prior_scale if _matches(key, name)), None)
            if key is None:
                raise ValueError(
                    f"prior_scale has no key for the random parameter {name!r} (keys: {', '.join(prior_scale)}); "
                    "add its name, its layer's path or '*' for every other parameter."
                )
            scales[name] = _positive(name, prior_scale[key])
        return scales
    return {name: _positive(name, prior_scale) for name in parameters}


def parameter_prior(value: Tensor, scale: float, center: Literal["zero", "pretrained"]) -> dist.Distribution:
    """``Normal(c, scale)`` over the whole of a parameter shaped like ``value``, as one event."""
    loc = value.detach().clone() if center == "pretrained" else value.new_zeros(())
    return dist.Normal(loc, value.new_tensor(scale)).expand(value.shape).to_event(value.dim())
