"""A flat parameter vector over some latent sites, and the way back to a dict of unconstrained site values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ParameterLayout"]


@dataclass(frozen=True)
class _Slot:
    name: str
    start: int
    shape: torch.Size

    @property
    def stop(self) -> int:
        return self.start + self.shape.numel()


class ParameterLayout:
    """Sites concatenated in order, each flattened row-major: ``theta[slot.start:slot.stop]``."""

    def __init__(self, shapes: dict[str, torch.Size]):
        self.slots: dict[str, _Slot] = {}
        start = 0
        for name, shape in shapes.items():
            self.slots[name] = _Slot(name, start, torch.Size(shape))
            start += torch.Size(shape).numel()
        self.num_params = start

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        """``{site: value}`` from ``theta`` (any leading batch dims)."""
        batch = theta.shape[:-1]
        return {s.name: theta[..., s.start : s.stop].reshape(batch + s.shape) for s in self.slots.values()}

    def flatten(self, values: dict[str, Tensor], batch_dims: int = 0) -> Tensor:
        """The flat vector of ``values`` (each with ``batch_dims`` leading dims)."""
        parts = [values[name].flatten(batch_dims) for name in self.slots]
        return torch.cat(parts, dim=-1)

    def index(self, name: str, device=None) -> Tensor:
        """Flat indices of site ``name``, shaped like the site."""
        slot = self.slots[name]
        return torch.arange(slot.start, slot.stop, device=device).reshape(slot.shape)

    def site_of(self, position: int) -> str:
        """The site that holds flat position ``position``."""
        for slot in self.slots.values():
            if slot.start <= position < slot.stop:
                return slot.name
        raise IndexError(position)
