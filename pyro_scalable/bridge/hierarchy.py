"""Which latents form a hierarchy: the sites whose prior depends on other latents, and those latents.

A centred hierarchy, ``b_j ~ Normal(mu, tau)``, gives ``b`` a prior whose parameters are other latents: its
posterior is a funnel (``tau`` small, every ``b_j`` near ``mu``), which a sampler with one step size crosses slowly,
and the remedy is the model's (a non-centred parametrisation, ``b = mu + tau * z`` with ``z ~ Normal(0, 1)``) or a
sampler that adapts its step to the funnel (NUTS). Found by tracing the model once, with no random draw, on one
data point of each subsampled plate, every latent a leaf that requires grad: a parent is a latent in whose
direction a site's prior log density has a gradient that is not zero. The point is fixed and irregular, since a
special one hides parents (at 0, ``b ~ Normal(mu, tau)`` has no gradient in ``mu``), and a graph alone is not
enough: ``LocScaleReparam(centered=0.0)``'s decentred site still reaches ``mu`` and ``tau``, through ``mu * 0`` and
``tau ** 0``.
"""

from __future__ import annotations

import math
from typing import Any

import pyro
import torch

from pyro_scalable.bridge.plates import plate_indices

__all__ = ["irregular_point", "prior_parents"]


def prior_parents(bridge: Any) -> dict[str, tuple[str, ...]]:
    """For each latent site of ``bridge`` (a ``ModelBridge``), the latent sites its prior's parameters depend on.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        ...     tau = pyro.sample("tau", dist.HalfNormal(1.0))
        ...     with pyro.plate("groups", 3):
        ...         b = pyro.sample("b", dist.Normal(mu, tau))
        ...     with pyro.plate("data", len(y), subsample_size=3) as idx:
        ...         pyro.sample("obs", dist.Normal(b[idx % 3], 1.0), obs=y[idx])
        >>> prior_parents(ModelBridge(model, (torch.randn(30),)))
        {'mu': (), 'tau': (), 'b': ('mu', 'tau')}

    """
    one = {name: torch.zeros(1, dtype=torch.long, device=bridge.device) for name in bridge.plates}
    values = {k: v.detach().requires_grad_() for k, v in bridge.constrain(irregular_point(bridge)).items()}
    parents = {}
    with torch.enable_grad(), pyro.validation_enabled(False), plate_indices(one, full_data=True):
        conditioned = pyro.poutine.condition(bridge.model, data=values)
        trace = pyro.poutine.trace(conditioned).get_trace(*bridge.args, **bridge.kwargs)
        for name in bridge.sites:
            density = trace.nodes[name]["fn"].log_prob(values[name].detach()).sum()
            others = [k for k in bridge.sites if k != name]
            grads = [None] * len(others)
            if density.requires_grad and others:
                grads = torch.autograd.grad(density, [values[k] for k in others], allow_unused=True)
            parents[name] = tuple(k for k, g in zip(others, grads) if g is not None and bool((g != 0).any()))
    return parents


def irregular_point(bridge: Any, shift: float = 0.0) -> dict[str, torch.Tensor]:
    """A fixed, irregular unconstrained point of ``bridge``'s latents (``shift`` gives another): no special value.

    At a special point a derivative can vanish that is not zero elsewhere (``b ~ Normal(mu, tau)`` at 0 has no
    gradient in ``mu``); a cosine of the coordinates' running index has none of those.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        ...     pyro.sample("obs", dist.Normal(w.sum(), 1.0), obs=y)
        >>> irregular_point(ModelBridge(model, (torch.tensor(0.5),)))["w"]
        tensor([ 0.3824, -0.2081, -0.4937])

    """
    point, start = {}, 0
    for name, site in bridge.sites.items():
        k = torch.arange(start, start + math.prod(site.unconstrained_shape), dtype=torch.float64)
        start += k.numel()
        value = 0.5 * torch.cos(1.3 * k + 0.7 + shift)
        point[name] = value.reshape(site.unconstrained_shape).to(site.dtype).to(bridge.device)
    return point
