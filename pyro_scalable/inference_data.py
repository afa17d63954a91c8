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

from pyro_scalable.bridge.likelihood import full_data_log_likelihood
from pyro_scalable.bridge.model import ModelBridge

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
    posterior = _numpy(mcmc.get_samples(group_by_chain=True))
    stats = _numpy(mcmc.sample_stats)
    bridge: ModelBridge | None = mcmc._full_bridge
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


def _from_dict(groups: dict, coords: dict | None, dims: dict):
    if _ARVIZ_1:
        from arviz_base import from_dict

        return from_dict(groups, coords=coords, dims=dims)
    return az.from_dict(**groups, coords=coords, dims=dims)


def _numpy(tensors: dict) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


def _plate_dims(bridge: ModelBridge, site: str, ndim: int) -> list[str]:
    # Plate dims count from the right of the batch shape; the observed value also has the event dims on its right.
    frames = bridge.observed[site]
    event_dim = bridge.observed_event_dims[site]
    return [frames.get(dim + event_dim, f"{site}_dim_{ndim + dim}") for dim in range(-ndim, 0)]
