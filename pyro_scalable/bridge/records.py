"""The records the bridge hands to the engines: a minibatch, a latent site, a subsampled plate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributions.transforms import Transform

__all__ = ["Batch", "DataPlate", "LatentSite", "Latents"]

Latents = dict[str, Tensor]


class Batch(NamedTuple):
    """One minibatch as the model sees it. Only ``indices`` is ever batched over chains."""

    indices: dict[str, Tensor]  # plate name -> subsample indices drawn by the engine
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class LatentSite:
    """A latent sample site: its constrained shape and the bijection from unconstrained space."""

    name: str
    shape: torch.Size  # constrained value shape
    unconstrained_shape: torch.Size
    transform: Transform
    has_jacobian: bool = True  # False for real-valued sites: their log|det J| is 0 and is skipped
    dtype: torch.dtype = torch.float32  # of the constrained value (the model's)
    plates: tuple[str | None, ...] = ()  # per dim of the constrained value: the plate it belongs to, or None


@dataclass(frozen=True)
class DataPlate:
    """A plate the engine subsamples: ``size`` N and minibatch size B (``subsample_size``)."""

    name: str
    size: int
    subsample_size: int
    dim: int
