r"""Streaming PSIS-LOO: ``az.loo``'s estimate on the full data, one chunk of the points at a time.

``az.loo`` reads a ``log_likelihood`` group of chains × draws × N values and works on copies of it
(:data:`~pyro_scalable.inference_data.LOO_COPIES`): at N = 10⁶ and 4 × 1,000 draws the group alone is 32 GB.
PSIS-LOO is pointwise (Vehtari, Gelman and Gabry 2017, "Practical Bayesian model evaluation using leave-one-out
cross-validation and WAIC"): point i's smoothed importance weights and Pareto :math:`\hat k_i` read only its S values
:math:`\log p(y_i \mid \theta_s)`, given the relative efficiency :math:`r_\text{eff}`, which ArviZ takes from the
posterior (the mean ESS of its variables over S). So :func:`streaming_loo` computes :math:`r_\text{eff}` once, then,
for each chunk of the points, their (chains × draws × chunk) block of the full-data log-likelihood, which it hands to
the installed ArviZ's own ``az.loo`` with that :math:`r_\text{eff}`, keeping the pointwise elpd and
:math:`\hat k` only. The totals are ArviZ's: :math:`\text{elpd} = \sum_i \text{elpd}_i`, :math:`p_\text{loo}` the sum
over chunks, :math:`\text{SE} = \sqrt{N \operatorname{Var}(\text{elpd}_i)}` (ArviZ 0.x's variance; 1.x's with one
degree of freedom less). The memory it takes is one block and ArviZ's work on it, and two values per point.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import xarray as xr
from tqdm.auto import tqdm

from pyro_scalable import memory
from pyro_scalable.arguments import check_count, fork_rng
from pyro_scalable.bridge.likelihood import (
    PROGRESS_VALUES,
    chunk_dim,
    data_batches,
    log_likelihood_pieces,
    observed_masks,
)
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.groups import numpy_group, observed_dims, observed_only, pointwise_shapes, posterior_group
from pyro_scalable.inference_data import ARVIZ_MAJOR, LOO_COPIES, _arviz, _convert, thinned_record

__all__ = ["LOO_CHUNK_VALUES", "streaming_loo"]

#: Values per chunk by default (64 MB in float64; ``az.loo`` works on :data:`LOO_COPIES` more).
LOO_CHUNK_VALUES = 2**23

_NOT_OURS = "The point-wise LOO is the same with the sum LOO"  # said of a chunk of one point, not of the data


def streaming_loo(
    source: Any,
    model: Callable | None = None,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    var_name: str | None = None,
    num_samples: int = 1000,
    thin: int = 1,
    seed: int | None = None,
    reff: float | None = None,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
):
    """PSIS-LOO on the full data without its whole log-likelihood: ``az.loo``'s elpd, SE, p and Pareto k's.

    Takes what :func:`~pyro_scalable.inference_data.to_inference_data` takes, and returns what
    ``az.loo(to_inference_data(...), pointwise=True)`` would (to rounding), holding one chunk of the points' log
    likelihood at a time instead of all chains × draws × N values.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.loo import streaming_loo
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
        >>> draws = {"mu": 0.1 * torch.randn(400, generator=torch.Generator().manual_seed(0))}
        >>> loo = streaming_loo(draws, model, args=(torch.zeros(50),), data_chunk_size=8)
        >>> loo.pareto_k.shape
        (50,)

    Args:
        source: a result, as for :func:`~pyro_scalable.inference_data.to_inference_data` (as are ``model``,
            ``args``, ``kwargs``, ``num_samples``, ``thin``, ``seed`` and ``draws_chunk_size``).
        model: the Pyro model, for a guide or a dict of draws.
        args: the model's positional arguments on the full data, where ``source`` does not know them.
        kwargs: the model's keyword arguments on the full data.
        num_samples: draws to take from a Gaussian posterior or a guide.
        thin: keep every ``thin``-th draw of each chain.
        seed: seeds the draws of a Gaussian posterior or a guide.
        draws_chunk_size: draws vectorised together for the log-likelihood.
        var_name: the observed site (needed where the model has several, as for ``az.loo``).
        reff: the relative efficiency (default: ArviZ's, the posterior's mean ESS over the number of draws).
        data_chunk_size: points of the data's first plate per chunk (default: about :data:`LOO_CHUNK_VALUES` values
            per chunk, fewer where that chunk and ``az.loo``'s work on it would not fit in memory).

    Returns:
        What ``az.loo(..., pointwise=True)`` returns on the installed ArviZ: an ``ELPDData`` on 0.x (``elpd_loo``,
        ``se``, ``p_loo``, ``loo_i``, ``pareto_k``), an ``ELPDDataLOO`` on 1.x (``elpd``, ``se``, ``p``, ``elpd_i``,
        ``pareto_k``; its ``log_weights``, which would be the size of the whole group, are left out).

    """
    check_count("data_chunk_size", data_chunk_size, optional=True)
    check_count("draws_chunk_size", draws_chunk_size)
    with fork_rng(seed):
        record, extra = thinned_record(source, model, args, kwargs, num_samples=num_samples, thin=thin, seed=seed)
    bridge = record.full_bridge
    if bridge is None:
        raise ValueError("streaming_loo needs the full data, which this run was not given: pass args=(...).")
    site = _site(bridge, var_name)
    chains, draws = next(iter(record.draws.values())).shape[:2]
    if reff is None:
        posterior = posterior_group(record)
        posterior.update(numpy_group({k: v for k, v in extra.items() if k not in bridge.observed}))
        reff = relative_efficiency(posterior)
    latents = {k: v.reshape((-1,) + v.shape[2:]) for k, v in record.draws.items()}
    shape = pointwise_shapes(bridge)[site]
    dim = chunk_dim(bridge, site)
    mask = observed_masks(bridge).get(site)
    observed = np.ones(shape, dtype=bool) if mask is None else np.broadcast_to(mask.cpu().numpy(), shape)
    per_point = shape.numel() // (shape[dim] if dim is not None else 1)
    if data_chunk_size is None:  # LOO_CHUNK_VALUES, or fewer where that and az.loo's work on it would not fit
        free = memory.available_memory("cpu")
        fits = LOO_CHUNK_VALUES if free is None else int(memory.MEMORY_FRACTION * free) // (8 * (1 + LOO_COPIES))
        data_chunk_size = max(1, min(LOO_CHUNK_VALUES, fits) // (chains * draws * per_point))
    size = data_chunk_size
    memory.check_memory(
        (1 + LOO_COPIES) * chains * draws * per_point * min(size, shape[dim] if dim is not None else 1) * 8,
        "cpu",
        f"one chunk of streaming_loo ({chains} chains × {draws} draws × {size:,} points) and az.loo's work on it",
        lambda factor: [f"data_chunk_size={max(1, size // factor)}", f"thin={factor}"],
    )
    elpd, pareto_k = np.full(shape, np.nan), np.full(shape, np.nan)
    p_loo, first, caught = 0.0, None, {}
    batches = data_batches(bridge, size, draws_chunk_size)
    bar = tqdm(batches, desc="streaming PSIS-LOO", disable=chains * draws * shape.numel() < PROGRESS_VALUES)
    for batch in bar:
        block, offset = None, 0
        for start_point, start, values in log_likelihood_pieces(bridge, latents, batch, draws_chunk_size):
            if site in values:
                if block is None:
                    block, offset = np.empty((chains * draws, *values[site].shape[1:])), start_point
                block[start : start + values[site].shape[0]] = values[site].cpu().numpy()
        if block is None:  # a site outside the chunked plate came whole with the first chunk
            continue
        index = [slice(None)] * len(shape)
        if dim is not None:
            index[dim] = slice(offset, offset + block.shape[dim])
        points = observed[tuple(index)]
        if not points.any():
            continue
        result = _chunk_loo(block[:, points].reshape(chains, draws, -1), reff, caught)
        first = result if first is None else first
        elpd_i, k_i, p_i = _pointwise(result)
        elpd[tuple(index)][points], pareto_k[tuple(index)][points] = elpd_i, k_i
        p_loo += p_i
    if first is None:
        raise ValueError(f"the site {site!r} observes no point: there is nothing to leave out.")
    for message, category in caught.items():
        warnings.warn(message, category, stacklevel=2)
    return _result(first, bridge, site, mask, elpd, pareto_k, p_loo)


def relative_efficiency(posterior: Mapping[str, np.ndarray]) -> float:
    """ArviZ's ``reff`` for ``posterior``'s ``(chain, draw, ...)`` draws: their mean ESS over their number."""
    chains, draws = next(iter(posterior.values())).shape[:2]
    if chains == 1:
        return 1.0
    group = _convert({"posterior": dict(posterior)}, None, {})["posterior"]
    ess = _arviz().ess(group.to_dataset() if hasattr(group, "to_dataset") else group, method="mean")
    return float(np.hstack([ess[v].values.flatten() for v in ess.data_vars]).mean() / (chains * draws))


def _site(bridge: ModelBridge, var_name: str | None) -> str:
    names = list(bridge.observed)
    if var_name is None:
        if len(names) != 1:
            raise ValueError(f"the model has the observed sites {names}: name one as var_name=.")
        return names[0]
    if var_name not in names:
        raise ValueError(f"var_name={var_name!r} is not an observed site of the model; it has {names}.")
    return var_name


def _chunk_loo(values: np.ndarray, reff: float, caught: dict):
    """``az.loo`` on one ``(chain, draw, point)`` block, its warnings kept (said once, after the last chunk)."""
    data = _convert({"log_likelihood": {"chunk": values}}, None, {"chunk": ["point"]})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = _arviz().loo(data, pointwise=True, var_name="chunk", reff=reff)
    for warning in seen:
        if not str(warning.message).startswith(_NOT_OURS):
            caught.setdefault(str(warning.message), warning.category)
    return result


def _pointwise(result) -> tuple[np.ndarray, np.ndarray, float]:
    if ARVIZ_MAJOR >= 1:
        return result.elpd_i.values, result.pareto_k.values, float(result.p)
    return result["loo_i"].values, result["pareto_k"].values, float(result["p_loo"])


def _result(first, bridge: ModelBridge, site: str, mask, elpd: np.ndarray, pareto_k: np.ndarray, p_loo: float):
    """The installed ArviZ's result type, with the totals and pointwise values of every chunk."""
    observed = bridge.observed_data()[site]
    all_dims = {site: observed_dims(bridge, site, observed.dim())}
    names = all_dims[site][: elpd.ndim]
    coords: dict = {}
    if mask is not None:  # the observed points only, as the log_likelihood group holds them
        values = {site: elpd[None, None], "k": pareto_k[None, None]}
        dims, coords = observed_only(values, {site: mask, "k": mask}, {**all_dims, "k": all_dims[site]})
        elpd, pareto_k, names = values[site][0, 0], values["k"][0, 0], dims[site]
    points = elpd.ravel()
    n = points.size
    total = float(points.sum())
    good_k = float(first.good_k if ARVIZ_MAJOR >= 1 else first["good_k"])
    warning = bool((pareto_k > good_k).any())
    pointwise_name = "elpd_i" if ARVIZ_MAJOR >= 1 else "loo_i"
    elpd_i = xr.DataArray(elpd, dims=names, coords=coords, name=pointwise_name)
    k = xr.DataArray(pareto_k, dims=names, coords=coords, name="pareto_k")
    if ARVIZ_MAJOR >= 1:
        se = math.sqrt(n * np.var(points, ddof=1)) if n > 1 else 0.0
        return dataclasses.replace(
            first,
            elpd=total,
            se=se,
            p=p_loo,
            n_data_points=n,
            warning=warning,
            elpd_i=elpd_i,
            pareto_k=k,
            log_weights=None,
        )
    values = dict(first.items())
    values.update(
        elpd_loo=total,
        se=math.sqrt(n * np.var(points)),
        p_loo=p_loo,
        n_data_points=n,
        warning=warning,
        loo_i=elpd_i,
        pareto_k=k,
    )
    return type(first)(data=list(values.values()), index=list(values))
