"""The diagonal mass of the momentum samplers (SGHMC, BAOAB): its forms, its checks, and its shape per site."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Latents
from pyro_scalable.infer.schedules import check_positive, constant

__all__ = ["Mass", "check_mass", "mass_like"]

Mass = float | Mapping[str, Tensor] | str


def mass_like(mass: Mass, latents: Latents) -> Latents:
    """The diagonal mass per site: a dict (or a learnt one) broadcast to each site's shape, a scalar as a 0-d tensor.

    ``"fisher"`` before warm-up has learnt it is the unit mass.
    """
    if isinstance(mass, Mapping):
        return {
            name: torch.as_tensor(mass[name], dtype=x.dtype, device=x.device) + torch.zeros_like(x)
            for name, x in latents.items()
        }
    value = 1.0 if isinstance(mass, str) else float(mass)
    return {name: constant(value, x) for name, x in latents.items()}  # a scalar broadcasts: one shared 0-d tensor


def check_mass(mass: Mass, *, learnt: bool = False) -> float:
    """Validate ``mass`` and return its smallest value (1 for a mass warm-up learns, where ``learnt`` allows it)."""
    if isinstance(mass, str):
        if not learnt or mass != "fisher":
            choices = "a positive number, a dict of positive tensors by site" + (", or 'fisher'" if learnt else "")
            raise ValueError(f"mass must be {choices}; got {mass!r}.")
        return 1.0
    if isinstance(mass, Mapping):
        least = math.inf
        for name, value in mass.items():
            value = torch.as_tensor(value)
            if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
                raise ValueError(f"mass['{name}'] must be finite and positive everywhere.")
            least = min(least, float(value.min()))
        return least
    check_positive("mass", mass)
    return float(mass)
