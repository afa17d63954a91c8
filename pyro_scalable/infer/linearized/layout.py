"""A flat parameter vector over some latent sites, its way back to site values, and its groups of parameters.

The groups are those a prior precision is tied over: one for all, one per site, or one per parameter.
"""

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
        """``{site: value}`` from ``theta`` (any leading batch dims).

        One ``split`` rather than a slice per site: its backward concatenates the sites' gradients into the flat one
        (a slice's backward zero-fills a ``d``-vector per site and adds them up).
        """
        batch = theta.shape[:-1]
        pieces = theta.split([s.shape.numel() for s in self.slots.values()], dim=-1)
        return {s.name: piece.reshape(batch + s.shape) for s, piece in zip(self.slots.values(), pieces)}

    def flatten(self, values: dict[str, Tensor], batch_dims: int = 0) -> Tensor:
        """The flat vector of ``values`` (each with ``batch_dims`` leading dims)."""
        parts = [values[name].reshape(values[name].shape[:batch_dims] + (-1,)) for name in self.slots]
        return torch.cat(parts, dim=-1)

    def index(self, name: str, device=None) -> Tensor:
        """Flat indices of site ``name``, shaped like the site."""
        slot = self.slots[name]
        return torch.arange(slot.start, slot.stop, device=device).reshape(slot.shape)

    def groups(self, how: str, device=None) -> tuple[Tensor, list[str]]:
        """The group of every flat position and the groups' names.

        Args:
            how: one group for all (``"scalar"``), one per site (``"site"``) or one per parameter (``"diagonal"``).

        """
        if how == "scalar":
            return torch.zeros(self.num_params, dtype=torch.long, device=device), ["all"]
        if how == "diagonal":
            return torch.arange(self.num_params, device=device), [str(k) for k in range(self.num_params)]
        if how == "site":
            groups = torch.empty(self.num_params, dtype=torch.long, device=device)
            for k, slot in enumerate(self.slots.values()):
                groups[slot.start : slot.stop] = k
            return groups, self.names
        raise ValueError(f"groups must be 'scalar', 'site' or 'diagonal', not {how!r}.")

    def site_of(self, position: int) -> str:
        """The site that holds flat position ``position``."""
        for slot in self.slots.values():
            if slot.start <= position < slot.stop:
                return slot.name
        raise IndexError(position)
