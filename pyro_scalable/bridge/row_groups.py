r"""Which group each data row belongs to: the map a multilevel model's plate-aware sampler needs, read from the model.

A multilevel model has a **group plate** (size :math:`G`, not subsampled) holding local latents :math:`b_1,\dots,b_G`
(a varying intercept, slope, or a non-centred effect), and a **data plate** whose rows each read one of them,
``b[g[idx]]``. Pyro records the plates but not the index expression, so the map :math:`g` is found by differentiating
each row's log-likelihood :math:`\ell_i` along directions of the local latents. With :math:`\partial_k \ell_i` the
sum over a group's coordinates of :math:`\partial \ell_i / \partial b_{k,\cdot}` and a tangent :math:`t` that is
:math:`t_k` on every coordinate of group :math:`k`, one directional derivative (two reverse passes: :math:`Jt` is
the gradient in :math:`u` of :math:`\langle J^\top u, t\rangle`) gives every row's

.. math::

    D_i(t) = \sum_k t_k\, \partial_k \ell_i ,

so a row that reads group :math:`g(i)` alone has :math:`D_i(k) / D_i(1) = g(i)` and
:math:`D_i(k^2) / D_i(1) = g(i)^2`; a row that reads several groups of the plate (multiple membership) fails the
second equation (its excess is :math:`\sum_{k<l} w_k w_l (k-l)^2 / (\sum_k w_k)^2` for weights
:math:`w_k = \partial_k \ell_i`, zero only when one group has all the weight), and is refused. The tangent is put on
one coordinate of a group's slice at a time (an intercept and a slope times :math:`x_i` could cancel in a sum, and
the ratio would then carry the terms' rounding): three products over the data per coordinate of a group's slice of
each local site, :math:`O(N)` memory, and the groups a row reads must agree across them.
A row whose derivative vanishes at the point (a residual exactly zero) is tried again at a second point. The point
is fixed and irregular (:func:`~.hierarchy.irregular_point`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.hierarchy import irregular_point
from pyro_scalable.bridge.likelihood import chunk_dim, data_batches
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge

__all__ = ["RowGroups", "group_plates", "row_groups"]

_ROUNDING = 1e-4  # relative: a ratio further than this from an integer (or its square) is no single group


class RowGroups(NamedTuple):
    """The rows of a data plate, by the group of one group plate they read."""

    plate: str  # the group plate
    data_plate: str  # the subsampled plate whose rows are mapped
    sites: tuple[str, ...]  # the local latents: those with a dimension along the group plate
    group: Tensor  # (N,) int64: each row's group
    sizes: Tensor  # (G,) int64: rows per group

    @property
    def num_groups(self) -> int:
        return self.sizes.shape[0]


def group_plates(bridge: ModelBridge) -> dict[str, tuple[str, ...]]:
    """The plates other than the data plates along which latents lie, each with its latent sites (in order).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(g, y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        ...     with pyro.plate("groups", 3):
        ...         b = pyro.sample("b", dist.Normal(mu, 1.0))
        ...     with pyro.plate("data", len(y), subsample_size=4) as idx:
        ...         pyro.sample("obs", dist.Normal(b[g[idx]], 1.0), obs=y[idx])
        >>> group_plates(ModelBridge(model, (torch.arange(12) % 3, torch.randn(12))))
        {'groups': ('b',)}

    """
    found: dict[str, list[str]] = {}
    for name, site in bridge.sites.items():
        for plate in site.plates:
            if plate is not None and plate not in bridge.plates:
                found.setdefault(plate, [])
                if name not in found[plate]:
                    found[plate].append(name)
    return {plate: tuple(names) for plate, names in found.items()}


def row_groups(bridge: ModelBridge, plate: str | None = None) -> RowGroups:
    """The group of ``plate`` (default: the model's one group plate) that each row of its data plate reads.

    Raises:
        ValueError: naming what is missing or what the rows do instead, and what to add: no subsampled data plate,
            no group plate (or several, without ``plate``), a row that reads no group of it, or one that reads
            several (multiple membership).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(x, g, y):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("counties", 4):
        ...         a = pyro.sample("a", dist.Normal(0.0, 1.0))
        ...         b = pyro.sample("b", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("homes", len(y), subsample_size=5) as idx:
        ...         pyro.sample("obs", dist.Normal(a[g[idx]] + (w + b[g[idx]]) * x[idx], 1.0), obs=y[idx])
        >>> g = torch.tensor([3, 0, 0, 2, 1, 3, 3, 0, 2, 2])
        >>> found = row_groups(ModelBridge(model, (torch.randn(10), g, torch.randn(10))))
        >>> found.plate, found.sites, torch.equal(found.group, g), found.sizes.tolist()
        ('counties', ('a', 'b'), True, [3, 1, 3, 3])

    """
    if not bridge.plates:
        raise ValueError(
            "the rows' groups are read through a data plate with a subsample_size smaller than N, and this model "
            "has none (observations in the group plate itself, or in a plate that is not subsampled). Give the "
            "observations a plate of their own that reads each row's group, e.g. "
            "`with pyro.plate('data', N, subsample_size=B) as idx: pyro.sample('y', dist.Normal(b[g[idx]], s), "
            "obs=y[idx])` (with one row per group, g is torch.arange(G) and B any size below G): the engine reads "
            "each group's rows through it and draws no minibatches. A small model is cheaper with "
            "pyro.infer.NUTS."
        )
    if len(bridge.plates) > 1:
        raise ValueError(
            "the rows' groups are read from a model with one subsampled data plate "
            f"(pyro.plate(name, N, subsample_size=B)); this one has {len(bridge.plates)}: "
            f"{', '.join(repr(p) for p in bridge.plates)}."
        )
    data = next(iter(bridge.plates.values()))
    plates = group_plates(bridge)
    if plate is None:
        if len(plates) != 1:
            named = ", ".join(f"'{p}'" for p in plates) or "none"
            raise ValueError(
                f"a multilevel model needs one group plate: a pyro.plate (not subsampled) holding a latent per group "
                f"that the data rows index, e.g. b[g[idx]]; found {named}. Name the group plate (plate=...)."
            )
        plate = next(iter(plates))
    if plate not in plates:
        raise ValueError(f"'{plate}' is no group plate of this model (found: {sorted(plates)}).")
    sites = plates[plate]
    point = irregular_point(bridge)
    group, known = _probe(bridge, point, plate, sites)
    if not bool(known.all()):  # a derivative that vanished at the point: a second one
        again, found = _probe(bridge, irregular_point(bridge, 1.0), plate, sites)
        group, known = torch.where(known, group, again), known | found
    if not bool(known.all()):
        rows = torch.nonzero(~known).flatten()[:5].tolist()
        raise ValueError(
            f"rows {rows} of plate '{data.name}' read no latent of the group plate '{plate}' (sites {list(sites)}): "
            "every row must read its group's latents, e.g. b[g[idx]]."
        )
    size = bridge.sites[sites[0]].shape[bridge.sites[sites[0]].plates.index(plate)]
    sizes = torch.bincount(group, minlength=size)
    return RowGroups(plate, data.name, sites, group, sizes)


def _tangent(latents: Latents, bridge: ModelBridge, plate: str, site: str, coordinate: int, power: int) -> Latents:
    """``k**power`` on coordinate ``coordinate`` of group k of ``site`` (in the group's slice), 0 elsewhere.

    One coordinate at a time: a tangent on several that a row adds up (an intercept and a slope times ``x``) could
    cancel, and the ratio of two such sums would carry the rounding of the terms, not of their sum.
    """
    tangent = {name: torch.zeros_like(x) for name, x in latents.items()}
    x = latents[site]
    dim = bridge.sites[site].plates.index(plate) - len(bridge.sites[site].shape) + x.dim()
    k = torch.arange(x.shape[dim], dtype=torch.float64, device=x.device) ** power
    moved = tangent[site].movedim(dim, 0).reshape(x.shape[dim], -1)
    moved[:, coordinate] = k.to(x.dtype)
    tangent[site] = moved.reshape(tangent[site].movedim(dim, 0).shape).movedim(0, dim).contiguous()
    return tangent


def _probe(bridge: ModelBridge, point: Latents, plate: str, sites: tuple[str, ...]) -> tuple[Tensor, Tensor]:
    """Each row's group and whether a derivative showed it (module docstring); multiple membership raises.

    Every coordinate of a group's slice of every local site is probed; a row's group is the same in every probe in
    which its derivative is not zero, or the row reads several groups.
    """
    data = next(iter(bridge.plates.values()))
    group = torch.zeros(data.size, dtype=torch.int64, device=bridge.device)
    known = torch.zeros(data.size, dtype=torch.bool, device=bridge.device)
    for site in sites:
        x = point[site]
        per_group = (
            x.numel() // x.shape[bridge.sites[site].plates.index(plate) - len(bridge.sites[site].shape) + x.dim()]
        )
        for coordinate in range(per_group):
            tangents = [_tangent(point, bridge, plate, site, coordinate, power) for power in (0, 1, 2)]
            found, seen = _rows(bridge, point, tangents, plate)
            clash = seen & known & (found != group)
            if bool(clash.any()):
                raise _several(int(torch.nonzero(clash)[0, 0]), data.name, plate)
            group = torch.where(seen & ~known, found, group)
            known |= seen
    return group, known


def _rows(bridge: ModelBridge, point: Latents, tangents: list[Latents], plate: str) -> tuple[Tensor, Tensor]:
    """Each row's group from the three directional derivatives, and where the derivative is not zero."""
    data = next(iter(bridge.plates.values()))
    groups, seen = [], []
    for batch in data_batches(bridge):

        def rows(latents: Latents, batch: Batch = batch) -> Tensor:
            """Each row's log-likelihood, summed over the observed sites and over their other dimensions."""
            total = 0.0
            for name, value in bridge.pointwise_log_likelihood(latents, batch).items():
                dim = chunk_dim(bridge, name)
                if dim is not None:  # a site outside the data plate reads no row
                    total = total + value.movedim(dim, 0).reshape(value.shape[dim], -1).sum(1)
            return total

        d = [_directional(rows, point, t).double() for t in tangents]
        nonzero = d[0] != 0
        safe = torch.where(nonzero, d[0], torch.ones_like(d[0]))
        first, second = d[1] / safe, d[2] / safe
        group = torch.round(first)
        # single membership: both ratios exact to the model's rounding (float32: about 1e-7 of the group index)
        single = (first - group).abs() <= _ROUNDING * (group.abs() + 1)
        single &= (second - group.square()).abs() <= _ROUNDING * (group.square() + 1)
        if bool((nonzero & ~single).any()):
            raise _several(int(batch.indices[data.name][torch.nonzero(nonzero & ~single)[0, 0]]), data.name, plate)
        groups.append(torch.where(nonzero, group, torch.zeros_like(group)).to(torch.int64))
        seen.append(nonzero)
    return torch.cat(groups), torch.cat(seen)


def _directional(function, point: Latents, tangent: Latents) -> Tensor:
    """The derivative of a vector ``function`` at ``point`` along ``tangent``, by reverse mode twice.

    ``J t`` is the gradient in ``u`` of ``<J^T u, t>``: two backward passes, where torch's forward mode would import
    its compiler and run its decompositions in Python (seconds on a process's first call).
    """
    value, pullback = torch.func.vjp(function, point)

    def along(u: Tensor) -> Tensor:
        (cotangent,) = pullback(u)
        return sum((cotangent[name] * tangent[name]).sum() for name in tangent)

    return torch.func.grad(along)(torch.zeros_like(value))


def _several(row: int, data: str, plate: str) -> ValueError:
    return ValueError(
        f"row {row} of plate '{data}' reads several groups of the plate '{plate}' (multiple membership, e.g. "
        "b[g1[idx]] + b[g2[idx]]): its group is not one. Give each row's group yourself, or model the memberships "
        "as separate plates."
    )
