"""Observed values inside their likelihood's support: checked once per bridge over the full data, in chunks.

The engines evaluate the model with Pyro's validation off (``torch.func.vmap`` cannot batch its checks), and
tracing a model never calls ``log_prob``, so data outside a likelihood's support would run and give a meaningless
log density: Bernoulli labels coded -1/1 give log-probabilities above 0, negative or fractional Poisson counts a
finite garbage value. Plain Pyro raises there; so does this check, with the site, the first offending data index
and the fix, before any step is taken.

:func:`check_observed_values` walks the data for the bridge (one forward pass of the model over all of it). An
engine that reads every chunk of the full data anyway (the linearised Laplace pass) builds its bridge with
``check_values=False`` and calls :func:`check_site_values` on each chunk before it evaluates the chunk's
likelihood: the same error, without the extra pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.minibatches import chunks, points_per_chunk

if TYPE_CHECKING:
    from pyro_scalable.bridge.model import ModelBridge

__all__ = ["check_observed_values", "check_site_values", "no_mode_reason"]

_HINTS = {
    "Bernoulli": "Bernoulli labels must be 0 or 1 (labels coded -1/1 become (y + 1) / 2)",
    "Binomial": "Binomial counts must be integers between 0 and total_count",
    "Categorical": "Categorical labels must be integer classes 0, ..., K - 1",
    "Poisson": "Poisson counts must be non-negative integers",
}


def check_observed_values(bridge: ModelBridge, chunk_size: int | None = None) -> None:
    """Raise a :class:`ModelError` naming the first observed value outside its distribution's support.

    The first subsampled plate is walked in chunks of ``chunk_size`` (default: those of a full-data pass,
    :func:`~.minibatches.points_per_chunk`) so that the full data is never in the model at once.
    """
    plate = next(iter(bridge.plates.values()), None)
    if plate is None:
        batches = [{}]
    else:
        size = points_per_chunk(bridge, chunk_size)
        batches = [{plate.name: idx} for idx in chunks(plate.size, size, bridge.device)]
    for indices in batches:
        with torch.no_grad():
            trace = bridge.trace_at(indices)
        for name, frames in bridge.observed.items():
            node = trace.nodes[name]
            check_site_values(name, node["fn"], node["value"], frames, indices)


def check_site_values(name: str, fn, value: Tensor, frames: dict[int, str], indices: dict[str, Tensor]) -> None:
    """Raise a :class:`ModelError` naming the first of observed site ``name``'s ``value`` outside ``fn``'s support.

    ``value`` holds the data points ``indices`` (plate name -> data indices, as a chunk of the data passes them);
    ``frames`` are the site's plates (``ModelBridge.observed[name]``), to name the offending data index.

    Example:
        >>> import pyro.distributions as dist, torch
        >>> labels = torch.tensor([1.0, -1.0, 0.0])  # the second of data points 10, 11, 12 is coded -1
        >>> check_site_values("y", dist.Bernoulli(logits=torch.zeros(3)), labels, {-1: "data"},
        ...                   {"data": torch.tensor([10, 11, 12])})
        Traceback (most recent call last):
        ...
        pyro_scalable.bridge.checks.ModelError: observed site 'y' has the value -1.0 at ...

    """
    inside = fn.support.check(value)
    if bool(inside.all()):
        return
    position = tuple(int(i) for i in (~inside).nonzero()[0])
    where = _data_index(position, frames, indices)
    hint = _HINTS.get(type(fn).__name__, "recode the data to the likelihood's support")
    raise ModelError(
        f"observed site '{name}' has the value {_value_at(value, position, fn.event_dim)} at {where}, "
        f"outside the support of its {type(fn).__name__} likelihood ({fn.support}); {hint}, or choose a "
        "likelihood whose support holds the data."
    )


def _data_index(position: tuple[int, ...], frames: dict[int, str], indices: dict[str, Tensor]) -> str:
    parts = []
    for dim, plate_name in sorted(frames.items()):
        local = position[len(position) + dim] if len(position) + dim >= 0 else 0
        index = int(indices[plate_name][local]) if plate_name in indices else local
        parts.append(f"index {index} of plate '{plate_name}'")
    return ", ".join(parts) if parts else f"position {position}"


def _value_at(value: Tensor, position: tuple[int, ...], event_dim: int) -> str:
    entry = value[position] if position else value
    return repr(entry.item()) if entry.numel() == 1 and event_dim == 0 else f"{entry.tolist()}"


def no_mode_reason(bridge: ModelBridge) -> str:
    """Why a search of this model's mode may end non-finite, and what to change, as a clause of an error message.

    A latent in a plate (a centred hierarchy: its group scale runs to 0 at the joint mode); observed values on a
    scale far from 1 (their likelihood's mode is as narrow, and a search started at the prior's scale overshoots
    it, in float32 into non-finite values); otherwise a scale running to 0 or a mode on the support's edge.
    """
    grouped = [name for name, site in bridge.sites.items() if any(site.plates)]
    if grouped:
        return (
            f"latent site(s) {', '.join(map(repr, grouped))} sit in a plate, and a centred hierarchy has no finite "
            "mode (its group scale runs to 0): non-centre it (z = loc + scale * z_raw, z_raw ~ Normal(0, 1))"
        )
    values = [v.detach().abs().flatten().double() for v in bridge.observed_data().values() if v.is_floating_point()]
    values = torch.cat(values) if values else torch.ones(1)
    scale = float(values[values > 0].median()) if bool((values > 0).any()) else 0.0
    if not 1e-4 <= scale <= 1e4:
        return (
            f"the observed values are on a scale of {scale:.0e}, so the likelihood's mode is as narrow and the search, "
            "started at the prior's scale, overshoots it: standardise the data (mean 0, sd 1)"
        )
    return (
        "the log density may have no finite mode (a scale parameter running to 0, or a mode on the edge of a site's "
        "support): reparametrise the model"
    )
