"""The groups of an ``InferenceData`` as numpy arrays, with their dimensions: what the ArviZ adapter assembles.

No ArviZ here (:mod:`pyro_scalable.inference_data` assembles the groups and is the one module that imports it): a
record's constrained draws (:func:`posterior_group`), the observed points of a masked site's pointwise values
(:func:`observed_only`), one posterior-predictive draw per posterior draw (:func:`posterior_predictive_group`), the
prior and prior-predictive draws (:func:`prior_groups`), and each variable's dimension names, a plate's named after it
(:func:`latent_dims`, :func:`observed_dims`). :mod:`pyro_scalable.loo` builds its chunks from the same functions.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pyro
import torch
from torch import Tensor

from pyro_scalable import memory
from pyro_scalable.arguments import fork_rng
from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.likelihood import full_data_log_likelihood, observed_masks
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.predictive import sample_posterior_predictive
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.memory import MemoryLimitWarning, available_memory, check_memory, format_bytes

__all__ = [
    "check_log_likelihood",
    "record_groups",
    "latent_dims",
    "numpy_group",
    "observed_dims",
    "observed_only",
    "pointwise_shapes",
    "posterior_group",
    "posterior_predictive_group",
    "prior_groups",
]


def posterior_group(record: RunRecord) -> dict[str, np.ndarray]:
    """The constrained draws of every latent site, ``(chain, draw, *shape)``."""
    shape = next(iter(record.draws.values())).shape[:2]
    constrained = record.bridge.constrain({k: v.reshape((-1,) + v.shape[2:]) for k, v in record.draws.items()})
    return {k: v.reshape(shape + v.shape[1:]).detach().cpu().numpy() for k, v in constrained.items()}


def pointwise_shapes(bridge: ModelBridge) -> dict[str, torch.Size]:
    """The shape of each observed site's pointwise log-likelihood: its observed value less the event dims."""
    observed = bridge.observed_data()
    return {name: value.shape[: value.dim() - bridge.observed_event_dims[name]] for name, value in observed.items()}


def observed_only(values: dict[str, np.ndarray], masks: dict, all_dims: dict) -> tuple[dict, dict]:
    """Keep, in place, the observed points of each masked site's ``(chain, draw, *batch)`` values; their dims, coords.

    A mask that selects whole entries along one dimension (a per-point mask in a plate) keeps that dimension and its
    name, its coordinates the observed entries' positions; any other mask flattens the batch dims into one
    ``"<site>_observed"``. A site with no observed point is dropped.
    """
    dims, coords = {}, {}
    for name, mask in masks.items():
        value = values.pop(name)
        mask = np.broadcast_to(mask.cpu().numpy(), value.shape[2:])
        if not mask.any():
            continue
        names = list(all_dims.get(name, []))[: mask.ndim]
        names += [f"{name}_dim_{i}" for i in range(len(names), mask.ndim)]
        # the entries observed along each dim, whatever the others; a mask is one such profile broadcast, or not
        profiles = [mask.any(axis=_others(d, mask.ndim)) for d in range(mask.ndim)]
        along = [d for d in range(mask.ndim) if (mask == np.expand_dims(profiles[d], _others(d, mask.ndim))).all()]
        if along:
            d = along[0]
            keep = np.flatnonzero(profiles[d])
            values[name] = value.take(keep, axis=2 + d)
            dims[name], coords[names[d]] = names, keep
        else:
            flat = mask.reshape(-1)
            values[name] = value.reshape(value.shape[:2] + (-1,))[..., flat]
            dims[name], coords[f"{name}_observed"] = [f"{name}_observed"], np.flatnonzero(flat)
    return dims, coords


def _others(dim: int, ndim: int) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i != dim)


def posterior_predictive_group(record: RunRecord, seed: int | None) -> dict[str, np.ndarray]:
    """One draw of every observed site per posterior draw, on the full data (the model, not a linearisation)."""
    bridge = record.full_bridge
    shape = next(iter(record.draws.values())).shape[:2]
    observed = bridge.observed_data()
    size = shape[0] * shape[1] * sum(v.numel() * v.element_size() for v in observed.values())
    check_memory(
        size,
        bridge.device,
        f"the posterior_predictive group ({shape[0]} chains × {shape[1]} draws of {', '.join(observed)})",
        lambda factor: [
            f"fewer draws: thin={factor} keeps every {factor}th draw of each chain",
            f"fewer points: the model's arguments on a subset of the data as args=(...) (1/{factor} of them fits)",
            "posterior_predictive=False leaves the group out",
        ],
    )
    draws = bridge.constrain({k: v.reshape((-1,) + v.shape[2:]).to(bridge.device) for k, v in record.draws.items()})
    values = sample_posterior_predictive(
        bridge.model, draws, *bridge.args, seed=seed, return_sites=list(bridge.observed), **bridge.kwargs
    )
    return {k: v.reshape(shape + v.shape[1:]).detach().cpu().numpy() for k, v in values.items()}


def prior_groups(bridge: ModelBridge, num_draws: int, seed: int | None) -> tuple[dict, dict]:
    """``num_draws`` draws of the latents from their prior, and of the observed sites given them (full data)."""
    model = pyro.poutine.uncondition(FullDataModel(bridge.model))
    sites = list(bridge.sites) + list(bridge.observed)
    observed = bridge.observed_data()
    per_draw = sum(s.shape.numel() * torch.empty((), dtype=s.dtype).element_size() for s in bridge.sites.values())
    per_draw += sum(v.numel() * v.element_size() for v in observed.values())
    check_memory(
        num_draws * per_draw,
        bridge.device,
        f"the prior and prior_predictive groups ({num_draws} draws of {', '.join(sites)})",
        lambda factor: [f"fewer draws: prior={max(1, num_draws // factor)}", "prior=None leaves the groups out"],
    )
    with fork_rng(seed):
        values = pyro.infer.Predictive(model, num_samples=num_draws, return_sites=sites)(*bridge.args, **bridge.kwargs)
    shapes = {name: site.shape for name, site in bridge.sites.items()}
    shapes.update({name: value.shape for name, value in bridge.observed_data().items()})
    values = {k: v.reshape((1, num_draws) + shapes[k]).detach().cpu().numpy() for k, v in values.items()}
    prior = {k: v for k, v in values.items() if k in bridge.sites}
    return prior, {k: v for k, v in values.items() if k in bridge.observed}


def numpy_group(tensors: Mapping) -> dict[str, np.ndarray]:
    """Each tensor (or array-like) as a numpy array on the CPU."""
    return {k: v.detach().cpu().numpy() if isinstance(v, Tensor) else np.asarray(v) for k, v in tensors.items()}


def latent_dims(site) -> list[str]:
    """A latent site's dimension names: its plates', else ``<site>_dim_<i>``."""
    return [plate or f"{site.name}_dim_{i}" for i, plate in enumerate(site.plates)]


def observed_dims(bridge: ModelBridge, site: str, ndim: int) -> list[str]:
    """An observed site's ``ndim`` rightmost dimension names: its plates', else ``<site>_dim_<i>``."""
    # Plate dims count from the right of the batch shape; the observed value also has the event dims on its right.
    frames = bridge.observed[site]
    event_dim = bridge.observed_event_dims[site]
    return [frames.get(dim + event_dim, f"{site}_dim_{ndim + dim}") for dim in range(-ndim, 0)]


def record_groups(
    record: RunRecord,
    log_likelihood: bool,
    data_chunk_size,
    draws_chunk_size,
    dtype: torch.dtype = torch.float64,
    *,
    arviz_major: int,
    loo_copies: int,
) -> tuple[dict, dict, dict]:
    """``posterior``, ``sample_stats``, ``observed_data`` and ``log_likelihood`` of a record, and their dims.

    The third value is ``{group: (dims, coords)}`` for a group whose variables need dims of their own: the
    ``log_likelihood`` of a site with masked points, which holds its observed points only (:func:`observed_only`).
    ``az.loo`` on the ``log_likelihood`` group makes ``loo_copies`` copies of it (ArviZ ``arviz_major``.x): a group
    that fits but leaves no room for them is warned about.
    """
    shape = next(iter(record.draws.values())).shape[:2]
    groups: dict[str, dict[str, np.ndarray]] = {"posterior": posterior_group(record)}
    if record.stats:
        groups["sample_stats"] = numpy_group(record.stats)
    all_dims = {name: latent_dims(site) for name, site in record.bridge.sites.items() if any(site.plates)}
    bridge = record.full_bridge
    if bridge is None:
        warnings.warn(
            "no full data was passed to run() (only batches): log_likelihood and observed_data are left out. "
            "Pass the full data as to_inference_data(..., args=(x, y)) to have them.",
            stacklevel=3,
        )
        return groups, all_dims, {}
    observed = bridge.observed_data()
    groups["observed_data"] = numpy_group(observed)
    all_dims.update({name: observed_dims(bridge, name, value.dim()) for name, value in observed.items()})
    if log_likelihood:
        check_log_likelihood(bridge, shape, dtype, arviz_major=arviz_major, loo_copies=loo_copies)
        draws = {k: v.reshape((-1,) + v.shape[2:]) for k, v in record.draws.items()}
        # the model runs in the data's dtype, chunk by chunk, each chunk written into one output of ``dtype`` (float64
        # by default: ArviZ's PSIS, az.loo, exponentiates these)
        values = full_data_log_likelihood(
            bridge, draws, data_chunk_size=data_chunk_size, draws_chunk_size=draws_chunk_size, out_dtype=dtype
        )
        groups["log_likelihood"] = {k: v.reshape(shape + v.shape[1:]).numpy() for k, v in values.items()}
        masks = observed_masks(bridge)
        if masks:
            return groups, all_dims, {"log_likelihood": observed_only(groups["log_likelihood"], masks, all_dims)}
    return groups, all_dims, {}


def check_log_likelihood(
    bridge: ModelBridge, shape: tuple, dtype: torch.dtype, *, arviz_major: int, loo_copies: int
) -> None:
    """Refuse a ``log_likelihood`` group larger than the memory allows; warn where ``az.loo`` on it would not fit."""
    points = sum(s.numel() for s in pointwise_shapes(bridge).values())
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = shape[0] * shape[1] * points * itemsize
    what = (
        f"the log_likelihood group ({shape[0]} chains × {shape[1]} draws × {points:,} points, "
        f"{str(dtype).removeprefix('torch.')})"
    )

    def remedies(factor: int) -> list[str]:
        ways = [
            f"fewer draws: thin={factor} keeps every {factor}th draw of each chain ({format_bytes(size / factor)}; "
            f"num_samples={max(1, shape[0] * shape[1] // factor)} for a Laplace, SWAG or EKF posterior or a guide)",
            f"fewer points: the model's arguments on a subset of the data as args=(...) (1/{factor} of them fits)",
        ]
        if dtype == torch.float64:
            ways.append("log_likelihood_dtype=torch.float32 halves it")
        return ways + [
            "log_likelihood=False leaves the group out (the other groups are the size of the draws and the data)",
            "for PSIS-LOO: pyro_scalable.loo.streaming_loo(source, ...) with this call's arguments gives az.loo's "
            "elpd, its SE and the Pareto k's, computed chunk by chunk of the points without the whole group",
        ]

    check_memory(size, "cpu", what, remedies)
    available = available_memory("cpu")
    if available is not None and (1 + loo_copies) * size > memory.MEMORY_FRACTION * available:
        warnings.warn(
            f"{what} takes {format_bytes(size)}; az.loo on it needs about {loo_copies} times that again (ArviZ "
            f"{arviz_major}.x), more than {100 * memory.MEMORY_FRACTION:g}% of the {format_bytes(available)} "
            "available. For PSIS-LOO use pyro_scalable.loo.streaming_loo(source, ...), which holds one chunk of the "
            "points at a time, or pass thin= here.",
            MemoryLimitWarning,
            stacklevel=4,
        )
