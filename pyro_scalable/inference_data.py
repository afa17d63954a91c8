"""The ArviZ adapter: the one module that imports ArviZ.

Groups written, each with dimensions ``(chain, draw, *site_shape)`` where a draw dimension applies:

* ``posterior``: constrained draws of every latent site;
* ``sample_stats``: ``lp`` (minibatch log-joint estimate), ``diverging``, ``step_size``, ``temperature``,
  ``grad_norm`` — ArviZ's names where it has one;
* ``log_likelihood``: pointwise ``log p(y_i | θ)`` on the **full** data, computed in chunks (never a minibatch),
  so that ``az.loo``/``az.waic`` are unbiased;
* ``observed_data``: the full observed values.

Observed dimensions that belong to a plate are named after it (``"data"``), so ``az.loo`` finds its pointwise
dimension. Works with ArviZ 0.x (``InferenceData``) and 1.x (``xarray.DataTree`` via ``arviz_base``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from pyro_scalable.arguments import check_count, check_flag
from pyro_scalable.bridge.likelihood import full_data_log_likelihood
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer.results import Draws

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

__all__ = ["draws_to_inference_data", "to_inference_data"]

_ARVIZ_1 = int(az.__version__.split(".")[0]) >= 1


def to_inference_data(
    mcmc: Any,
    *,
    log_likelihood: bool = True,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
    coords: dict | None = None,
    dims: dict | None = None,
):
    """Convert a finished :class:`~pyro_scalable.infer.StochasticMCMC` run to ArviZ.

    Args:
        mcmc: the run.
        log_likelihood: compute the full-data ``log_likelihood`` group (one pass over the data per 64 draws).
        data_chunk_size: data points per chunk for the log-likelihood (default: max(B, 1024)).
        draws_chunk_size: draws vectorised together for the log-likelihood.
        coords: as in ``arviz.from_dict``.
        dims: as in ``arviz.from_dict``; plate dimensions are named after their plates by default.

    """
    if not isinstance(mcmc, Draws):
        raise TypeError(f"mcmc must be a finished run (StochasticMCMC, SampleThenOptimize), got {type(mcmc).__name__}.")
    _check_options(log_likelihood, data_chunk_size, draws_chunk_size, coords, dims)
    posterior = _numpy(mcmc.get_samples(group_by_chain=True))
    stats = _numpy(mcmc.sample_stats)
    bridge: ModelBridge | None = mcmc.results.full_bridge
    groups: dict[str, dict[str, np.ndarray]] = {"posterior": posterior, "sample_stats": stats}
    all_dims = {}
    if bridge is None:
        warnings.warn(
            "no full data was passed to run() (only batches): log_likelihood and observed_data are left out.",
            stacklevel=3,
        )
    else:
        observed = bridge.observed_data()
        groups["observed_data"] = _numpy(observed)
        all_dims = {name: _plate_dims(bridge, name, value.dim()) for name, value in observed.items()}
        if log_likelihood:
            draws = mcmc.get_unconstrained_samples(group_by_chain=False)
            values = full_data_log_likelihood(
                bridge, draws, data_chunk_size=data_chunk_size, draws_chunk_size=draws_chunk_size
            )
            shape = (mcmc.num_chains, mcmc.num_samples)
            groups["log_likelihood"] = {k: v.reshape(shape + v.shape[1:]).numpy() for k, v in values.items()}
    all_dims.update(dims or {})
    return _from_dict(groups, coords, all_dims)


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
    """Convert unconstrained draws ``{site: (chains * draws, *shape)}`` of a model (e.g. a Laplace posterior's)."""
    if not isinstance(bridge, ModelBridge):
        raise TypeError(f"bridge must be a ModelBridge, got {type(bridge).__name__}.")
    check_count("num_chains", num_chains)
    _check_options(log_likelihood, data_chunk_size, draws_chunk_size, coords, dims)
    _check_draws(bridge, latents, num_chains)
    num_draws = next(iter(latents.values())).shape[0] // num_chains
    shape = (num_chains, num_draws)
    constrained = bridge.constrain(latents)
    groups = {"posterior": {k: v.reshape(shape + v.shape[1:]).detach().cpu().numpy() for k, v in constrained.items()}}
    observed = bridge.observed_data()
    groups["observed_data"] = _numpy(observed)
    all_dims = {name: _plate_dims(bridge, name, value.dim()) for name, value in observed.items()}
    if log_likelihood:
        values = full_data_log_likelihood(
            bridge, latents, data_chunk_size=data_chunk_size, draws_chunk_size=draws_chunk_size
        )
        groups["log_likelihood"] = {k: v.reshape(shape + v.shape[1:]).numpy() for k, v in values.items()}
    all_dims.update(dims or {})
    return _from_dict(groups, coords, all_dims)


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
        if not isinstance(value, torch.Tensor) or tuple(value.shape[1:]) != tuple(site.unconstrained_shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"latents[{name!r}] must be a tensor of shape (draws, *{tuple(site.unconstrained_shape)}), got {shape}."
            )
        counts.add(value.shape[0])
    if len(counts) != 1:
        raise ValueError(f"latents have different numbers of draws per site: {sorted(counts)}.")
    total = counts.pop()
    if total == 0 or total % num_chains:
        raise ValueError(f"num_chains={num_chains} must divide the number of draws ({total}), which must be positive.")


def _from_dict(groups: dict, coords: dict | None, dims: dict):
    if _ARVIZ_1:
        from arviz_base import from_dict

        return from_dict(groups, coords=coords, dims=dims)
    with warnings.catch_warnings():
        # ArviZ guesses that arrays with more chains than draws are mis-shaped; ours are (chain, draw, ...) by
        # construction, and many chains of one draw each is parallel SG-MCMC (a deep ensemble at T = 0).
        warnings.filterwarnings("ignore", message=r"More chains \(\d+\) than draws", category=UserWarning)
        return az.from_dict(**groups, coords=coords, dims=dims)


def _numpy(tensors: dict) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


def _plate_dims(bridge: ModelBridge, site: str, ndim: int) -> list[str]:
    # Plate dims count from the right of the batch shape; the observed value also has the event dims on its right.
    frames = bridge.observed[site]
    event_dim = bridge.observed_event_dims[site]
    return [frames.get(dim + event_dim, f"{site}_dim_{ndim + dim}") for dim in range(-ndim, 0)]
