r"""Where sample-then-optimise linearises the model: the given point, the model's own start, or a MAP it finds.

A model whose output is linear in its latents (and has no other latent) needs no MAP: the linear model is the
model itself, at any point. Otherwise the linearisation point :math:`\theta_*` is given (constrained values, or a
trained autoguide's ``median``), or found by Adam on minibatches of the model's subsampled plate.
"""

from __future__ import annotations

from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_median, init_to_uniform
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.infer.linearized.network import choose_sites
from pyro_scalable.infer.linearized.sampling import is_linear

__all__ = ["find_map", "linearization_point"]


def linearization_point(
    bridge: ModelBridge,
    site: str,
    args: tuple,
    kwargs: dict,
    generator: torch.Generator,
    *,
    linearize_at: dict[str, Tensor] | Any | None,
    sites: list[str] | str | None,
    map_steps: int,
    quiet: bool,
) -> Latents:
    """The unconstrained latents to linearise at: given, the model's own start when linear, or a MAP."""
    given = linearize_at
    if given is not None:
        values = given if isinstance(given, dict) else _guide_median(given, args, kwargs)
        missing = sorted(set(bridge.sites) - set(values))
        if missing:
            raise ModelError(f"linearize_at lacks the latent site(s) {missing}; give a value for every latent site.")
        latents = {}
        for name, latent in bridge.sites.items():
            value = torch.as_tensor(values[name], dtype=latent.dtype).detach()
            if value.shape != latent.shape:
                raise ModelError(
                    f"linearize_at['{name}'] has shape {tuple(value.shape)}, the site has {tuple(latent.shape)}."
                )
            latents[name] = latent.transform.inv(value.to(bridge.device))
        return latents
    start = {k: v[0] for k, v in bridge.init_latents(1, init_to_median, seed=int(generator.initial_seed())).items()}
    chosen, *_ = choose_sites(bridge, site, start, sites)
    if set(chosen) == set(bridge.sites) and is_linear(bridge, site, chosen, start, generator):
        return start
    return find_map(bridge, generator, map_steps=map_steps, quiet=quiet)


def find_map(bridge: ModelBridge, generator: torch.Generator, *, map_steps: int, quiet: bool) -> Latents:
    """The MAP by ``map_steps`` Adam steps on minibatches, from Pyro's uniform initialisation."""
    if map_steps == 0:
        raise ModelError(
            "the model's output is not linear in its latents (or it has other latents, e.g. a noise scale), so "
            "it needs a linearisation point: pass linearize_at={site: value} or a trained guide, or map_steps > 0."
        )
    init = bridge.init_latents(1, init_to_uniform(radius=1.0), seed=int(generator.initial_seed()))
    latents = {k: v[0].clone().requires_grad_(True) for k, v in init.items()}
    optimizer = torch.optim.Adam(list(latents.values()), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 - 0.99 * t / map_steps)
    sampler = EpochSampler(bridge.plates, 1, generator, bridge.device)
    for _ in tqdm(range(map_steps), disable=quiet, desc="MAP"):
        batch = Batch({k: v[0] for k, v in next(sampler).items()}, bridge.args, bridge.kwargs)
        loss = -bridge.log_posterior(latents, batch)
        if not torch.isfinite(loss):
            raise ModelError(
                "the log joint is not finite while finding the MAP; check the data, or pass linearize_at=..."
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return {k: v.detach() for k, v in latents.items()}


def _guide_median(guide: Any, args: tuple, kwargs: dict) -> dict[str, Tensor]:
    if not hasattr(guide, "median"):
        raise TypeError(
            f"linearize_at must be a dict of constrained values by site name or a trained autoguide, got {guide!r}."
        )
    return {k: v.detach() for k, v in guide.median(*args, **kwargs).items()}
