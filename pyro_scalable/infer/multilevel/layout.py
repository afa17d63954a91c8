"""The latents of a multilevel model as two blocks: a vector of globals and a ``(G, p)`` matrix of locals per chain.

A local site (one with a dimension along the group plate) gives each group the coordinates of its slice; the locals
of group ``k`` are the slices of every local site, concatenated in the sites' order (``p`` coordinates). Every other
site is global, flattened into one vector in the sites' order. :meth:`Layout.join` inverts :meth:`Layout.split`
exactly, for any leading batch dimensions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.bridge.row_groups import RowGroups

__all__ = ["Layout"]


class Layout:
    """Where each site's coordinates sit in the global vector and in a group's local block."""

    def __init__(self, bridge: ModelBridge, groups: RowGroups):
        self.num_groups = groups.num_groups
        self.locals: dict[str, tuple[int, torch.Size]] = {}  # site -> (dim of the plate, from the right; shape)
        self.globals: dict[str, torch.Size] = {}
        for name, site in bridge.sites.items():
            shape = site.unconstrained_shape
            if name in groups.sites:
                dim = site.plates.index(groups.plate) - len(site.shape)
                if len(shape) != len(site.shape) or shape[dim] != self.num_groups:
                    raise ValueError(
                        f"the local latent '{name}' changes shape when unconstrained ({tuple(site.shape)} -> "
                        f"{tuple(shape)}); a group's block needs a site whose support keeps its shape (a real, "
                        "positive or bounded value per group)."
                    )
                self.locals[name] = (dim, shape)
            else:
                self.globals[name] = shape
        self.local_size = sum(math.prod(shape) // self.num_groups for _, shape in self.locals.values())
        self.global_size = sum(math.prod(shape) for shape in self.globals.values())

    def split(self, latents: Latents, batch_dims: int = 1) -> tuple[Tensor, Tensor]:
        """``(globals (..., d), locals (..., G, p))`` from latents with ``batch_dims`` leading dimensions."""
        lead = next(iter(latents.values())).shape[:batch_dims]
        flat = [latents[name].reshape((*lead, -1)) for name in self.globals]
        blocks = []
        for name, (dim, _) in self.locals.items():
            x = latents[name].movedim(dim, batch_dims)
            blocks.append(x.reshape((*lead, self.num_groups, -1)))
        first = next(iter(latents.values()))
        empty = first.new_zeros(*lead, 0)
        return (torch.cat(flat, -1) if flat else empty), torch.cat(blocks, -1)

    def join(self, theta: Tensor, b: Tensor) -> Latents:
        """The latents of :meth:`split`'s blocks (any leading dimensions, the same on both)."""
        lead = theta.shape[:-1]
        latents, start = {}, 0
        for name, shape in self.globals.items():
            size = math.prod(shape)
            latents[name] = theta[..., start : start + size].reshape((*lead, *shape))
            start += size
        start = 0
        for name, (dim, shape) in self.locals.items():
            size = math.prod(shape) // self.num_groups
            moved = list(shape)
            moved.insert(0, moved.pop(dim))
            block = b[..., start : start + size].reshape((*lead, *moved))
            latents[name] = block.movedim(len(lead), dim)
            start += size
        return latents
