"""Draws of a model's latent sites from a Pyro guide (an ``AutoGuide`` after SVI, or any callable guide)."""

from __future__ import annotations

from collections.abc import Callable

import pyro
import torch
from torch import Tensor

from pyro_scalable.arguments import fork_rng
from pyro_scalable.bridge.model import ModelBridge

__all__ = ["guide_draws"]


def guide_draws(bridge: ModelBridge, guide: Callable, num_samples: int, seed: int | None) -> dict[str, Tensor]:
    """``{site: (num_samples, *shape)}`` constrained draws of every latent site of ``bridge``'s model.

    The guide is called ``num_samples`` times on the bridge's arguments (so it sees what the model sees) and its
    trace read at the model's latent sites; ``seed`` seeds the draws without touching the global RNG (``None``:
    the global RNG draws them).
    """
    draws: dict[str, list[Tensor]] = {name: [] for name in bridge.sites}
    with fork_rng(seed), torch.no_grad():
        for _ in range(num_samples):
            trace = pyro.poutine.trace(guide).get_trace(*bridge.args, **bridge.kwargs)
            for name in bridge.sites:
                if name not in trace.nodes:
                    raise ValueError(
                        f"the guide has no site '{name}' (a latent site of the model); it does not belong to it."
                    )
                draws[name].append(trace.nodes[name]["value"])
    return {name: torch.stack(values) for name, values in draws.items()}
