"""The records the bridge hands to the engines: a minibatch, a latent site, a subsampled plate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributions.transforms import Transform

__all__ = ["Batch", "DataPlate", "DataRows", "LatentSite", "Latents"]

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


class DataRows(NamedTuple):
    """The rows an observed site's likelihood runs on at every step where no plate subsamples them.

    Example:
        >>> rows = DataRows(56_789, "obs", None)
        >>> rows.subsample_size, rows.plate_line()
        (560, "with pyro.plate('data', 56789, subsample_size=560) as idx:")

    """

    rows: int
    site: str  # the observed site
    plate: str | None  # the plate around it of ``rows`` rows; None where it is in no plate

    @property
    def subsample_size(self) -> int:
        """A minibatch size to start from: about 1% of the rows, between 100 and 1,000, to two significant digits.

        A step then costs about a hundredth of a data pass, and N/B >= 10 lets ``control_variate="auto"`` centre a
        control variate at the mode.
        """
        size = min(1000, max(100, self.rows // 100))
        digits = 10 ** max(int(math.log10(size)) - 1, 0)
        return min(size // digits * digits, self.rows)

    def plate_line(self) -> str:
        """The plate that would subsample these rows, as the model would write it."""
        return f"with pyro.plate('{self.plate or 'data'}', {self.rows}, subsample_size={self.subsample_size}) as idx:"
