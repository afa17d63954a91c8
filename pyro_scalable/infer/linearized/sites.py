r"""Which sites a linearised engine reads: the one observed site, the latents it linearises in, the noise it holds.

:func:`observed_site` is the observed site (its outermost batch dimension the data plate); :func:`choose_sites` the
latent sites the network function :math:`f(x, \theta)` is taken in (by default every one the mean output depends on),
whether a Normal likelihood is heteroscedastic, and the scalar noise scale held at its value; :func:`first_batch` the
data's first chunk, on which they are read. Every linearised engine (Laplace, sample-then-optimise, SWAG's
linearised predictive, the EKF) starts here, then builds its :class:`~.network.NetworkFunction`.
"""

from __future__ import annotations

from typing import Any

import torch

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.bridge.outputs import model_outputs
from pyro_scalable.infer.linearized.families import likelihood_of

__all__ = ["choose_sites", "first_batch", "observed_site"]


def observed_site(bridge: ModelBridge, engine: str) -> str:
    """The one observed site a linearised engine reads, whose outermost batch dimension is the data plate.

    The network function is ``points x outputs``: one row per data point, the data plate's. A model with another
    plate outside it (``obs`` of shape ``(features, points)``) would need a transpose the engines do not guess.
    """
    if len(bridge.observed) != 1:
        raise ModelError(f"{engine} needs exactly one observed site; the model has {sorted(bridge.observed)}.")
    site = next(iter(bridge.observed))
    plate = next(iter(bridge.plates.values()), None)
    frames = bridge.observed[site]  # plate dim -> plate name
    if plate is not None and frames and frames[min(frames)] != plate.name:
        raise ModelError(
            f"observed site '{site}' has the plate '{frames[min(frames)]}' outside the data plate '{plate.name}'; "
            f"{engine} reads one row of outputs per data point, so the data plate must be the outermost "
            f"(leftmost) batch dimension. Declare pyro.plate('{plate.name}', ...) first, with the lowest dim."
        )
    return site


def choose_sites(bridge: ModelBridge, site: str, latents: Latents, sites) -> tuple[list[str], bool, str | None, Any]:
    """The sites to linearise in, whether the Normal is heteroscedastic, and the scalar noise site and value.

    By default every latent site the mean output depends on; a scalar Normal noise scale is left out (held at its
    given value). ``sites`` may name them, or be ``"last_layer"``.
    """
    if isinstance(sites, str) and sites != "last_layer":
        raise ValueError(f"sites must be None, 'last_layer' or a list of latent site names, got {sites!r}.")
    if sites is not None and not isinstance(sites, str):
        if not isinstance(sites, (list, tuple, set, frozenset)) or not all(isinstance(s, str) for s in sites):
            raise TypeError(f"sites must be None, 'last_layer' or a list of latent site names, got {sites!r}.")
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in latents.items()}
    raw = model_outputs(bridge, leaves, first_batch(bridge), site=site, layers=True)
    likelihood = likelihood_of(site, raw.fn, raw.mask)
    mean_output = likelihood.outputs()
    names = list(leaves)

    by_id = {id(leaves[n]): n for n in names}

    def depends(tensor) -> set[str]:
        # the leaves the autograd graph of ``tensor`` reaches (walked, not differentiated: no weight gradients)
        found: set[str] = {by_id[id(tensor)]} if id(tensor) in by_id else set()
        seen: set = set()
        stack = [tensor.grad_fn] if tensor.requires_grad else []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            name = by_id.get(id(getattr(node, "variable", None)))
            if name is not None:
                found.add(name)
            stack.extend(child for child, _ in node.next_functions)
        return found

    on_mean = depends(mean_output)
    heteroscedastic, noise_site, noise = False, None, None
    if likelihood.name == "Normal":
        scale = likelihood.scale
        on_scale = depends(scale)
        constant = bool((scale == scale.flatten()[0]).all())
        if on_scale and (not constant or on_scale & on_mean):
            heteroscedastic = True
            on_mean |= on_scale
        elif constant:
            noise = scale.flatten()[0].detach()
            noise_site = next(iter(on_scale)) if len(on_scale) == 1 else None
            if noise_site is not None and bridge.sites[noise_site].shape.numel() != 1:
                noise_site = None
    if sites is None:
        chosen = [n for n in bridge.sites if n in on_mean]
    elif sites == "last_layer":
        layers = [layer for layer in raw.layers if layer.weight in on_mean]
        if not layers:
            raise ModelError(
                "sites='last_layer' found no linear layer (F.linear or x @ W) whose weight is a latent site."
            )
        last = layers[-1]
        chosen = [n for n in bridge.sites if n in (last.weight, last.bias)]
    else:
        unknown = sorted(set(sites) - set(bridge.sites))
        if unknown:
            raise ModelError(f"sites={unknown} are not latent sites of the model; it has {sorted(bridge.sites)}.")
        chosen = [n for n in bridge.sites if n in set(sites)]
    if not chosen:
        raise ModelError(f"no latent site affects the output of the observed site '{site}'; nothing to approximate.")
    if noise_site in chosen:
        noise_site, noise = None, None
    return chosen, heteroscedastic, noise_site, noise


def first_batch(bridge: ModelBridge) -> Batch:
    """The first (at most 1024) points of the data plate: enough to see the model's structure."""
    plate = next(iter(bridge.plates.values()), None)
    indices = {} if plate is None else {plate.name: torch.arange(min(plate.size, 1024), device=bridge.device)}
    return Batch(indices, bridge.args, bridge.kwargs)
