"""The ArviZ adapter: the one library module that imports ArviZ, and the one converter from Pyro results to ArviZ.

:func:`to_inference_data` takes any result :mod:`pyro_scalable.sources` reads — our engines' runs and posteriors,
Pyro's ``MCMC``, a trained guide, a dict of draws — and writes, each with dimensions ``(chain, draw, *site_shape)``:

* ``posterior``: constrained draws of every latent site (and a dict's extra deterministic sites);
* ``sample_stats``: the engine's per-draw statistics — ``lp`` (minibatch log-joint estimate), ``diverging``,
  ``step_size``, ``temperature``, ``grad_norm``, … (ArviZ's names where it has one); ``diverging`` for Pyro MCMC;
* ``log_likelihood``: pointwise ``log p(y_i | θ)`` on the **full** data, computed in chunks (never a minibatch),
  so that ``az.loo``/``az.waic`` are unbiased; of the observed points only (a point masked out with
  ``poutine.mask`` or ``dist.mask`` is no term of the likelihood, so ``az.loo`` counts the points the model
  observes): where a mask selects whole entries of one plate the plate's dimension keeps the observed entries, its
  coordinates their positions in the data; any other mask leaves one dimension ``"<site>_observed"`` of the observed
  points, its coordinates their flat positions;
* ``observed_data``: the full observed values;
* on request, ``posterior_predictive`` (one draw of every observed site per posterior draw, on the full data),
  ``prior`` and ``prior_predictive``.

Dimensions that belong to a plate are named after it (``"data"``), so ``az.loo`` finds its pointwise dimension.
ArviZ 0.x returns ``arviz.InferenceData``, ArviZ 1.x an ``xarray.DataTree`` (via ``arviz_base.from_dict``); the
groups, variables and dimensions are the same on both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyro
import torch
from torch import Tensor

from pyro_scalable.arguments import check_count, check_flag, fork_rng
from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.likelihood import full_data_log_likelihood, observed_masks
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.predictive import sample_posterior_predictive
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.sources import run_record

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

__all__ = ["ARVIZ_MAJOR", "draws_to_inference_data", "to_inference_data"]

#: The installed ArviZ's major version: 0 (``InferenceData``) or 1 (``xarray.DataTree``).
ARVIZ_MAJOR = int(az.__version__.split(".")[0])


def to_inference_data(
    source: Any,
    model: Callable | None = None,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_samples: int = 1000,
    seed: int | None = None,
    log_likelihood: bool = True,
    posterior_predictive: bool | Mapping[str, Any] = False,
    prior: int | None = None,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
    coords: dict | None = None,
    dims: dict | None = None,
):
    """Convert a Pyro result to ArviZ, with the full-data pointwise log-likelihood.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable import to_inference_data
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
        >>> draws = {"mu": torch.randn(100)}           # e.g. mcmc.get_samples() or Predictive's output
        >>> idata = to_inference_data(draws, model, args=(torch.zeros(20),))
        >>> tuple(idata["log_likelihood"]["obs"].dims)
        ('chain', 'draw', 'data')

    Args:
        source: a finished :class:`~pyro_scalable.infer.StochasticMCMC` or
            :class:`~pyro_scalable.infer.SampleThenOptimize`, a :class:`~pyro_scalable.infer.LaplacePosterior`,
            :class:`~pyro_scalable.infer.SWAGPosterior` or :class:`~pyro_scalable.infer.EKFPosterior`, a
            finished ``pyro.infer.MCMC`` (NUTS, HMC), a Pyro guide (an ``AutoGuide`` after SVI, or any callable
            guide with ``model``), or a dict of draws ``{site: (num_draws, ...)}`` with ``model`` (for example
            ``pyro.infer.Predictive``'s output; its observed sites become ``posterior_predictive``).
        model: the Pyro model, for a guide that does not know it or a dict of draws. It is run with subsampling
            switched off.
        args: the model's positional arguments on the full data (``x, y``). Our runs and Pyro's MCMC know them;
            given for a DataLoader run, they supply the full data the run was not given.
        kwargs: the model's keyword arguments on the full data.
        num_samples: draws to take from a Gaussian posterior (Laplace, SWAG, the EKF) or a guide.
        seed: seeds those draws and the predictive ones (``None``: the global RNG).
        log_likelihood: compute the full-data ``log_likelihood`` group (one pass over the data per
            ``draws_chunk_size`` draws).
        posterior_predictive: ``True`` to draw every observed site once per posterior draw on the full data, or
            a dict ``{site: (chains, draws, ...)}`` of draws you made.
        prior: the number of draws from the prior (``prior`` and ``prior_predictive`` groups); ``None`` for none.
        data_chunk_size: data points per chunk for the log-likelihood (default: max(B, 1024, 2^20 /
            ``draws_chunk_size``)); the memory it takes is the float64 output plus one chunk's work.
        draws_chunk_size: draws vectorised together for the log-likelihood.
        coords: as in ``arviz.from_dict``.
        dims: as in ``arviz.from_dict``; plate dimensions are named after their plates by default.

    Returns:
        ``arviz.InferenceData`` on ArviZ 0.x, ``xarray.DataTree`` on ArviZ 1.x.

    """
    _check_options(log_likelihood, data_chunk_size, draws_chunk_size, coords, dims)
    check_count("prior", prior, optional=True)
    if not isinstance(posterior_predictive, (bool, Mapping)):
        raise TypeError(
            f"posterior_predictive must be True/False or a dict of draws, got {type(posterior_predictive).__name__}."
        )
    with fork_rng(seed):  # a seeded conversion leaves the global RNG as it found it
        record, extra = run_record(source, model, args, kwargs, num_samples=num_samples, seed=seed)
        bridge = record.full_bridge
        observed_extra = {k: v for k, v in extra.items() if bridge is not None and k in bridge.observed}
        groups, all_dims, own = _groups(record, log_likelihood, data_chunk_size, draws_chunk_size)
        groups["posterior"].update(_numpy({k: v for k, v in extra.items() if k not in observed_extra}))
        if observed_extra and posterior_predictive is False:
            groups["posterior_predictive"] = _numpy(observed_extra)
        if posterior_predictive is not False or prior is not None:
            if bridge is None:
                raise ValueError("posterior_predictive and prior need the full data: pass args=(...) to this call.")
            if isinstance(posterior_predictive, Mapping):
                groups["posterior_predictive"] = _numpy(posterior_predictive)
            elif posterior_predictive:
                groups["posterior_predictive"] = _posterior_predictive(record, seed)
            if prior is not None:
                groups["prior"], groups["prior_predictive"] = _prior(bridge, prior, seed)
        all_dims.update(dims or {})
        return _from_dict(groups, coords, all_dims, own)


def draws_to_inference_data(
    bridge: ModelBridge,
    latents: dict,
    *,
    num_chains: int = 1,
    log_likelihood: bool = True,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
    coords: dict | None = None,
    dims: dict | None = None,
):
    """Convert unconstrained draws ``{site: (chains * draws, *shape)}`` of the model bound in ``bridge``."""
    if not isinstance(bridge, ModelBridge):
        raise TypeError(f"bridge must be a ModelBridge, got {type(bridge).__name__}.")
    check_count("num_chains", num_chains)
    _check_options(log_likelihood, data_chunk_size, draws_chunk_size, coords, dims)
    _check_draws(bridge, latents, num_chains)
    draws = {k: v.reshape((num_chains, -1) + v.shape[1:]) for k, v in latents.items()}
    record = RunRecord(bridge, bridge, bridge.args, bridge.kwargs, draws)
    groups, all_dims, own = _groups(record, log_likelihood, data_chunk_size, draws_chunk_size)
    all_dims.update(dims or {})
    return _from_dict(groups, coords, all_dims, own)


def _groups(record: RunRecord, log_likelihood: bool, data_chunk_size, draws_chunk_size) -> tuple[dict, dict, dict]:
    """``posterior``, ``sample_stats``, ``observed_data`` and ``log_likelihood`` of a record, and their dims.

    The third value is ``{group: (dims, coords)}`` for a group whose variables need dims of their own: the
    ``log_likelihood`` of a site with masked points, which holds its observed points only (:func:`_observed_only`).
    """
    shape = next(iter(record.draws.values())).shape[:2]
    constrained = record.bridge.constrain({k: v.reshape((-1,) + v.shape[2:]) for k, v in record.draws.items()})
    groups: dict[str, dict[str, np.ndarray]] = {
        "posterior": {k: v.reshape(shape + v.shape[1:]).detach().cpu().numpy() for k, v in constrained.items()}
    }
    if record.stats:
        groups["sample_stats"] = _numpy(record.stats)
    all_dims = {name: _latent_dims(site) for name, site in record.bridge.sites.items() if any(site.plates)}
    bridge = record.full_bridge
    if bridge is None:
        warnings.warn(
            "no full data was passed to run() (only batches): log_likelihood and observed_data are left out. "
            "Pass the full data as to_inference_data(..., args=(x, y)) to have them.",
            stacklevel=3,
        )
        return groups, all_dims, {}
    observed = bridge.observed_data()
    groups["observed_data"] = _numpy(observed)
    all_dims.update({name: _observed_dims(bridge, name, value.dim()) for name, value in observed.items()})
    if log_likelihood:
        draws = {k: v.reshape((-1,) + v.shape[2:]) for k, v in record.draws.items()}
        # the model runs in the data's dtype, chunk by chunk, each chunk written into one float64 output: ArviZ's PSIS
        # (az.loo) exponentiates these and returns NaN on float32 values at thousands of draws
        values = full_data_log_likelihood(
            bridge, draws, data_chunk_size=data_chunk_size, draws_chunk_size=draws_chunk_size, out_dtype=torch.float64
        )
        groups["log_likelihood"] = {k: v.reshape(shape + v.shape[1:]).numpy() for k, v in values.items()}
        masks = observed_masks(bridge)
        if masks:
            return groups, all_dims, {"log_likelihood": _observed_only(groups["log_likelihood"], masks, all_dims)}
    return groups, all_dims, {}


def _observed_only(values: dict[str, np.ndarray], masks: dict, all_dims: dict) -> tuple[dict, dict]:
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


def _posterior_predictive(record: RunRecord, seed: int | None) -> dict[str, np.ndarray]:
    """One draw of every observed site per posterior draw, on the full data (the model, not a linearisation)."""
    bridge = record.full_bridge
    shape = next(iter(record.draws.values())).shape[:2]
    draws = bridge.constrain({k: v.reshape((-1,) + v.shape[2:]).to(bridge.device) for k, v in record.draws.items()})
    values = sample_posterior_predictive(
        bridge.model, draws, *bridge.args, seed=seed, return_sites=list(bridge.observed), **bridge.kwargs
    )
    return {k: v.reshape(shape + v.shape[1:]).detach().cpu().numpy() for k, v in values.items()}


def _prior(bridge: ModelBridge, num_draws: int, seed: int | None) -> tuple[dict, dict]:
    """``num_draws`` draws of the latents from their prior, and of the observed sites given them (full data)."""
    model = pyro.poutine.uncondition(FullDataModel(bridge.model))
    sites = list(bridge.sites) + list(bridge.observed)
    with fork_rng(seed):
        values = pyro.infer.Predictive(model, num_samples=num_draws, return_sites=sites)(*bridge.args, **bridge.kwargs)
    shapes = {name: site.shape for name, site in bridge.sites.items()}
    shapes.update({name: value.shape for name, value in bridge.observed_data().items()})
    values = {k: v.reshape((1, num_draws) + shapes[k]).detach().cpu().numpy() for k, v in values.items()}
    prior = {k: v for k, v in values.items() if k in bridge.sites}
    return prior, {k: v for k, v in values.items() if k in bridge.observed}


def _check_options(log_likelihood, data_chunk_size, draws_chunk_size, coords, dims) -> None:
    check_flag("log_likelihood", log_likelihood)
    check_count("data_chunk_size", data_chunk_size, optional=True)
    check_count("draws_chunk_size", draws_chunk_size)
    for name, value in (("coords", coords), ("dims", dims)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict (as in arviz.from_dict) or None, got {type(value).__name__}.")
    for site, names in (dims or {}).items():
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"dims[{site!r}] must be a list of dimension names, got {names!r}.")


def _check_draws(bridge: ModelBridge, latents: Any, num_chains: int) -> None:
    if not isinstance(latents, dict) or not latents:
        raise TypeError("latents must be a non-empty dict {site: unconstrained draws (chains * draws, *shape)}.")
    missing = sorted(set(bridge.sites) - set(latents))
    if missing:
        raise ValueError(f"latents lacks the latent site(s) {missing}.")
    counts = set()
    for name, site in bridge.sites.items():
        value = latents[name]
        if not isinstance(value, Tensor) or tuple(value.shape[1:]) != tuple(site.unconstrained_shape):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"latents[{name!r}] must be a tensor of shape (draws, *{tuple(site.unconstrained_shape)}), got {shape}."
            )
        counts.add(value.shape[0])
    if len(counts) != 1:
        raise ValueError(f"latents have different numbers of draws per site: {sorted(counts)}.")
    total = counts.pop()
    if total == 0 or total % num_chains:
        raise ValueError(f"num_chains={num_chains} must divide the number of draws ({total}), which must be positive.")


def _others(dim: int, ndim: int) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i != dim)


def _from_dict(groups: dict, coords: dict | None, dims: dict, own: dict | None = None):
    """The groups as ArviZ data; a group of ``own``, ``{group: (dims, coords)}``, with dims and coords of its own."""
    own = own or {}
    data = _convert({g: v for g, v in groups.items() if g not in own}, coords, dims)
    for group, (group_dims, group_coords) in own.items():
        # positions of the observed entries: they index the caller's coordinates of that dim where given
        own_coords = {
            k: np.asarray((coords or {})[k])[v] if k in (coords or {}) else v for k, v in group_coords.items()
        }
        merged = {**(coords or {}), **own_coords}
        part = _convert({group: groups[group]}, merged, {**dims, **group_dims})
        if ARVIZ_MAJOR >= 1:
            data[group] = part[group]
        else:
            data.add_groups({group: part[group]})
    return data


def _convert(groups: dict, coords: dict | None, dims: dict):
    attrs = {"inference_library": "pyro", "inference_library_version": pyro.__version__}
    # Arrays are (chain, draw, ...) by construction; ArviZ warns where there are more chains than draws, which is
    # parallel SG-MCMC (one draw per chain: a deep ensemble at T = 0), so that one warning is silenced on both majors.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"More chains \(\d+\) than draws", category=UserWarning)
        warnings.filterwarnings("ignore", message="Found chain dimension to be longer than draw", category=UserWarning)
        if ARVIZ_MAJOR >= 1:
            from arviz_base import from_dict

            return from_dict(groups, coords=coords, dims=dims, attrs={group: attrs for group in groups})
        return az.from_dict(**groups, coords=coords, dims=dims, attrs=attrs)


def _numpy(tensors: Mapping) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() if isinstance(v, Tensor) else np.asarray(v) for k, v in tensors.items()}


def _latent_dims(site) -> list[str]:
    return [plate or f"{site.name}_dim_{i}" for i, plate in enumerate(site.plates)]


def _observed_dims(bridge: ModelBridge, site: str, ndim: int) -> list[str]:
    # Plate dims count from the right of the batch shape; the observed value also has the event dims on its right.
    frames = bridge.observed[site]
    event_dim = bridge.observed_event_dims[site]
    return [frames.get(dim + event_dim, f"{site}_dim_{ndim + dim}") for dim in range(-ndim, 0)]
