"""The ArviZ adapter: the one library module that imports ArviZ, and the one converter from Pyro results to ArviZ.

ArviZ (seconds to import) is imported on the first conversion, not with this module, which ``import pyro_scalable``
imports: it registers :func:`to_inference_data` as the converter of :mod:`pyro_scalable.infer.record`, which a
result's own ``to_inference_data()`` calls (the results sit below this module and never import it).

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
  ``prior`` and ``prior_predictive``;
* on request (``ksd=True``), the kernel Stein discrepancy of the converted draws
  (:mod:`pyro_scalable.infer.stein`): ``sample_stats["ksd"]``, one value per chain (dimension ``chain`` only), and
  the pooled figures in ``sample_stats``' attributes ``ksd_pooled``, ``ksd_floor``, ``ksd_squared_unbiased``,
  ``ksd_scale`` and ``ksd_kernel``. ``az.summary`` reads the posterior and never sees it; a netCDF file keeps it on
  both majors.

The groups with one value per draw and data point (``log_likelihood``, ``posterior_predictive``, ``prior_predictive``)
are checked against the memory available before they are allocated (:mod:`pyro_scalable.memory`): above
:data:`~pyro_scalable.memory.MEMORY_FRACTION` of it the conversion is refused with a
:class:`~pyro_scalable.memory.MemoryLimitError` naming the figures and what works instead (``thin=``, fewer points,
``log_likelihood_dtype=torch.float32``, ``log_likelihood=False``, :func:`pyro_scalable.loo.streaming_loo`); the
run's draws stay as they were. A ``log_likelihood`` group that fits, but on which ``az.loo`` would need more than is
left (it works on :data:`LOO_COPIES` copies of it), is a :class:`~pyro_scalable.memory.MemoryLimitWarning`.

Dimensions that belong to a plate are named after it (``"data"``), so ``az.loo`` finds its pointwise dimension.
ArviZ 0.x returns ``arviz.InferenceData``, ArviZ 1.x an ``xarray.DataTree`` (via ``arviz_base.from_dict``); the
groups, variables and dimensions are the same on both.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
import pyro
import torch
from torch import Tensor

from pyro_scalable.arguments import check_choice, check_count, check_flag, fork_rng
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.groups import (
    numpy_group,
    posterior_predictive_group,
    prior_groups,
    record_groups,
)
from pyro_scalable.infer.record import RunRecord, register_converter
from pyro_scalable.infer.stein import SteinDiscrepancy, stein_discrepancy
from pyro_scalable.sources import run_record

__all__ = ["ARVIZ_MAJOR", "LOO_COPIES", "draws_to_inference_data", "to_inference_data"]

#: The installed ArviZ's major version: 0 (``InferenceData``) or 1 (``xarray.DataTree``), from its metadata.
ARVIZ_MAJOR = int(importlib.metadata.version("arviz").split(".")[0])
#: The memory ``az.loo`` takes beyond a ``log_likelihood`` group, in copies of it (measured with tracemalloc: 3.0 on
#: ArviZ 0.23; 1.0 on 1.3, whose result keeps the smoothed weights, a copy).
LOO_COPIES = 3 if ARVIZ_MAJOR == 0 else 1
_LOO = {"arviz_major": ARVIZ_MAJOR, "loo_copies": LOO_COPIES}  # what the groups' memory check warns of


@functools.cache
def _arviz() -> ModuleType:
    """The ``arviz`` module, imported on first use: the package's one import of ArviZ."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
        import arviz as az
    return az


def to_inference_data(
    source: Any,
    model: Callable | None = None,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_samples: int = 1000,
    thin: int = 1,
    seed: int | None = None,
    log_likelihood: bool = True,
    log_likelihood_dtype: torch.dtype = torch.float64,
    posterior_predictive: bool | Mapping[str, Any] = False,
    prior: int | None = None,
    ksd: bool | Mapping[str, Any] = False,
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
        thin: keep every ``thin``-th draw of each chain (and its statistics); the run keeps all of them.
        seed: seeds those draws and the predictive ones (``None``: the global RNG).
        log_likelihood: compute the full-data ``log_likelihood`` group (one pass over the data per
            ``draws_chunk_size`` draws).
        log_likelihood_dtype: that group's dtype: ``torch.float64`` (ArviZ's PSIS exponentiates the values), or
            ``torch.float32`` for half the memory.
        posterior_predictive: ``True`` to draw every observed site once per posterior draw on the full data, or
            a dict ``{site: (chains, draws, ...)}`` of draws you made.
        prior: the number of draws from the prior (``prior`` and ``prior_predictive`` groups); ``None`` for none.
        ksd: ``True`` to store the kernel Stein discrepancy of the converted draws beside ``sample_stats`` (the
            full-data gradient at every draw, and O(draws²) kernel terms), or a dict of
            :func:`~pyro_scalable.ksd.kernel_stein_discrepancy`'s kernel options (``scale``, ``c``, ``beta``,
            ``block_size``).
        data_chunk_size: data points per chunk for the log-likelihood (default: max(B, 1024, 2^20 /
            ``draws_chunk_size``)); the memory it takes is the float64 output plus one chunk's work.
        draws_chunk_size: draws vectorised together for the log-likelihood.
        coords: as in ``arviz.from_dict``.
        dims: as in ``arviz.from_dict``; plate dimensions are named after their plates by default.

    Returns:
        ``arviz.InferenceData`` on ArviZ 0.x, ``xarray.DataTree`` on ArviZ 1.x.

    """
    _check_options(log_likelihood, data_chunk_size, draws_chunk_size, coords, dims)
    check_choice("log_likelihood_dtype", log_likelihood_dtype, (torch.float64, torch.float32))
    check_count("prior", prior, optional=True)
    if not isinstance(posterior_predictive, (bool, Mapping)):
        raise TypeError(
            f"posterior_predictive must be True/False or a dict of draws, got {type(posterior_predictive).__name__}."
        )
    ksd_options = _ksd_options(ksd)
    with fork_rng(seed):  # a seeded conversion leaves the global RNG as it found it
        record, extra = thinned_record(source, model, args, kwargs, num_samples=num_samples, thin=thin, seed=seed)
        bridge = record.full_bridge
        observed_extra = {k: v for k, v in extra.items() if bridge is not None and k in bridge.observed}
        groups, all_dims, own = record_groups(
            record, log_likelihood, data_chunk_size, draws_chunk_size, log_likelihood_dtype, **_LOO
        )
        groups["posterior"].update(numpy_group({k: v for k, v in extra.items() if k not in observed_extra}))
        if observed_extra and posterior_predictive is False:
            groups["posterior_predictive"] = numpy_group(observed_extra)
        if posterior_predictive is not False or prior is not None:
            if bridge is None:
                raise ValueError("posterior_predictive and prior need the full data: pass args=(...) to this call.")
            if isinstance(posterior_predictive, Mapping):
                groups["posterior_predictive"] = numpy_group(posterior_predictive)
            elif posterior_predictive:
                groups["posterior_predictive"] = posterior_predictive_group(record, seed)
            if prior is not None:
                groups["prior"], groups["prior_predictive"] = prior_groups(bridge, prior, seed)
        all_dims.update(dims or {})
        data = _from_dict(groups, coords, all_dims, own)
        if ksd_options is not None:
            if bridge is None:
                raise ValueError("ksd needs the full data (the full-data score): pass args=(...) to this call.")
            with torch.no_grad():
                stein = stein_discrepancy(
                    bridge,
                    record.draws,
                    data_chunk_size=data_chunk_size,
                    draws_chunk_size=draws_chunk_size,
                    **ksd_options,
                )
            data = _with_ksd(data, stein, ksd_options)
        return data


def _ksd_options(ksd: Any) -> dict[str, Any] | None:
    """The kernel options of ``ksd=`` (``None``: no KSD), checked before anything is computed."""
    if ksd is False:
        return None
    if ksd is True:
        return {}
    if not isinstance(ksd, Mapping):
        raise TypeError(f"ksd must be True/False or a dict of kernel options, got {type(ksd).__name__}.")
    unknown = sorted(set(ksd) - {"scale", "c", "beta", "block_size"})
    if unknown:
        raise ValueError(f"ksd takes the kernel options scale, c, beta and block_size; got {unknown}.")
    return dict(ksd)


def _with_ksd(data, stein: SteinDiscrepancy, options: Mapping[str, Any]):
    """``data`` with ``sample_stats["ksd"]`` (per chain) and the pooled figures as ``sample_stats``' attributes."""
    import xarray as xr

    per_chain = stein.per_chain.numpy()
    scale = options.get("scale", "sd")
    attrs = {
        "ksd_pooled": float(stein.ksd),
        "ksd_floor": float(stein.floor),
        "ksd_squared_unbiased": float(stein.ksd_squared_unbiased),
        "ksd_scale": stein.scale.numpy(),
        "ksd_kernel": (
            f"IMQ (c^2 + |z - z'|^2)^beta, c = {options.get('c', 1.0)}, beta = {options.get('beta', -0.5)}, on the "
            f"unconstrained draws over {'their sd' if isinstance(scale, str) else 'ksd_scale'} per coordinate; "
            "Langevin Stein kernel of the full-data score; V-statistic (pyro_scalable.infer.stein)"
        ),
    }
    variable = xr.DataArray(per_chain, dims=["chain"], coords={"chain": np.arange(len(per_chain))})
    if ARVIZ_MAJOR >= 1:
        stats = data["sample_stats"].to_dataset() if "sample_stats" in data.children else xr.Dataset()
        stats = stats.assign(ksd=variable)
        stats.attrs.update(attrs)
        data["sample_stats"] = stats
        return data
    if "sample_stats" in data.groups():
        data.sample_stats["ksd"] = variable
        data.sample_stats.attrs.update(attrs)
    else:
        data.add_groups({"sample_stats": xr.Dataset({"ksd": variable}, attrs=attrs)})
    return data


def thinned_record(
    source: Any,
    model: Callable | None,
    args: tuple,
    kwargs: Mapping[str, Any] | None,
    *,
    num_samples: int,
    thin: int,
    seed: int | None,
) -> tuple[RunRecord, dict[str, Tensor]]:
    """:func:`~pyro_scalable.sources.run_record` with every ``thin``-th draw of each chain (a new record)."""
    check_count("thin", thin)
    record, extra = run_record(source, model, args, kwargs, num_samples=num_samples, seed=seed)
    if thin == 1:
        return record, extra
    draws = {k: v[:, ::thin] for k, v in record.draws.items()}
    stats = {k: v[:, ::thin] for k, v in record.stats.items()}
    return dataclasses.replace(record, draws=draws, stats=stats), {k: v[:, ::thin] for k, v in extra.items()}


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
    groups, all_dims, own = record_groups(record, log_likelihood, data_chunk_size, draws_chunk_size, **_LOO)
    all_dims.update(dims or {})
    return _from_dict(groups, coords, all_dims, own)


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
        return _arviz().from_dict(**groups, coords=coords, dims=dims, attrs=attrs)


register_converter(to_inference_data)
