"""What the ArviZ adapter can convert: one :class:`~pyro_scalable.infer.record.RunRecord` from every kind of result.

A record is the draws of every latent site (unconstrained, ``(chains, draws, *shape)``), their statistics, and the
model bound to its full data (a :class:`~pyro_scalable.bridge.ModelBridge`). Our engines fill one as they run;
this module builds one from (reading the protocols of :mod:`~pyro_scalable.infer.record`, importing no engine)

* a finished :class:`~pyro_scalable.infer.StochasticMCMC` or :class:`~pyro_scalable.infer.SampleThenOptimize`
  (its own record; ``args=`` may supply the full data a DataLoader run was not given);
* a Gaussian posterior — Laplace, SWAG, the EKF — (``num_samples`` draws, spread over its chains: one per SWAG run);
* Pyro's ``pyro.infer.MCMC`` after NUTS/HMC (draws, and ``diverging`` from its diagnostics);
* any Pyro guide — an ``AutoGuide`` after SVI, or a callable guide with ``model=`` (``num_samples`` calls of it);
* a dict of draws ``{site: (S, ...)}``, e.g. ``pyro.infer.Predictive``'s output or ``mcmc.get_samples()``, with
  ``model=`` (Predictive's broadcast dims, ``(S, 1, d)`` for a ``(d,)`` site, are undone).

For Pyro's objects the model is run with subsampling switched off (:class:`~pyro_scalable.FullDataModel`), so the
record always describes all N data points.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pyro
import torch
from pyro.infer.autoguide import AutoGuide
from torch import Tensor

from pyro_scalable.arguments import check_count, check_seed
from pyro_scalable.bridge import FullDataModel, ModelBridge
from pyro_scalable.bridge.guides import guide_draws
from pyro_scalable.infer.record import GaussianSource, RecordSource, RunRecord
from pyro_scalable.memory import check_memory

__all__ = ["run_record"]

_KINDS = (
    "a finished StochasticMCMC or SampleThenOptimize run, a LaplacePosterior, a SWAGPosterior, a pyro.infer.MCMC "
    "run, a Pyro guide (an AutoGuide, or a callable with model=), or a dict of draws {site: (num_draws, ...)} "
    "with model="
)


def run_record(
    source: Any,
    model: Callable | None = None,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    num_samples: int = 1000,
    seed: int | None = None,
) -> tuple[RunRecord, dict[str, Tensor]]:
    """The record of ``source`` and any extra per-draw values it carries (Predictive's observed/deterministic sites).

    ``model``/``args``/``kwargs`` are the model and its full data where ``source`` does not know them.
    """
    check_count("num_samples", num_samples)
    check_seed("seed", seed)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of the model's positional arguments, got {type(args).__name__}.")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of the model's keyword arguments, got {type(kwargs).__name__}.")
    args, kwargs = tuple(args), dict(kwargs or {})
    if isinstance(source, RecordSource):
        _no_model(source, model)
        return _from_draws(source, args, kwargs), {}
    if isinstance(source, GaussianSource):  # num_samples spread over its chains: MultiSWAG's runs stay apart
        _no_model(source, model)
        per_chain = -(-num_samples // source.num_chains)
        _check_draws_memory(source.bridge, per_chain * source.num_chains, num_samples)
        return _record(source.bridge, source.get_samples(per_chain, group_by_chain=True, seed=seed)), {}
    if isinstance(source, pyro.infer.MCMC):
        _no_model(source, model)
        return _from_pyro_mcmc(source, args, kwargs), {}
    if isinstance(source, Mapping):
        bridge = _bridge(model, args, kwargs, "a dict of draws")
        return _from_dict(bridge, source)
    if isinstance(source, AutoGuide) or callable(source):
        model = source.model if model is None and isinstance(source, AutoGuide) else model
        bridge = _bridge(model, args, kwargs, "a guide")
        return _from_guide(bridge, source, num_samples, seed), {}
    raise TypeError(f"cannot convert {type(source).__name__}: pass {_KINDS}.")


def _check_draws_memory(bridge: ModelBridge, num_draws: int, num_samples: int) -> None:
    """Refuse ``num_draws`` draws of every latent site that do not fit: constrained, and the record's unconstrained."""
    per_draw = sum(
        (site.shape.numel() + site.unconstrained_shape.numel()) * torch.empty((), dtype=site.dtype).element_size()
        for site in bridge.sites.values()
    )
    check_memory(
        num_draws * per_draw,
        bridge.device,
        f"{num_draws} draws of the posterior's {sum(s.shape.numel() for s in bridge.sites.values()):,} latent values",
        lambda factor: [f"fewer draws: num_samples={max(1, num_samples // factor)}"],
    )


def _no_model(source: Any, model: Any) -> None:
    if model is not None:
        raise TypeError(f"model= is for guides and dicts of draws; a {type(source).__name__} knows its model.")


def _bridge(model: Callable | None, args: tuple, kwargs: dict, what: str) -> ModelBridge:
    if model is None:
        raise TypeError(f"converting {what} needs the model: pass model=... and the full data as args=(...).")
    if not args and not kwargs:
        raise TypeError(
            f"converting {what} needs the model's full data: pass args=(x, y) (and kwargs=) as the model takes them."
        )
    return ModelBridge(FullDataModel(model), args, kwargs)


def _record(bridge: ModelBridge, constrained: Mapping[str, Tensor], stats: dict | None = None) -> RunRecord:
    """A record of constrained draws ``(chains, draws, *shape)`` of every latent site of ``bridge``'s model."""
    missing = sorted(set(bridge.sites) - set(constrained))
    if missing:
        raise ValueError(f"the draws lack the model's latent site(s) {missing}; they do not belong to this model.")
    draws = {}
    for name, site in bridge.sites.items():
        value = torch.as_tensor(constrained[name])
        batch = value.shape[:2]
        if value[0, 0].numel() != site.shape.numel():
            raise ValueError(
                f"draws of site '{name}' have shape {tuple(value.shape[2:])} per draw; the model's site has shape "
                f"{tuple(site.shape)}."
            )
        value = value.reshape(batch + site.shape).to(device=bridge.device, dtype=site.dtype)
        draws[name] = bridge.unconstrain({name: value.reshape((-1,) + site.shape)})[name].reshape(
            batch + site.unconstrained_shape
        )
    return RunRecord(bridge, bridge, bridge.args, bridge.kwargs, draws, dict(stats or {}))


def _from_draws(run: RecordSource, args: tuple, kwargs: dict) -> RunRecord:
    record = run.run_record()
    if not args and not kwargs:
        return record
    full = ModelBridge(record.bridge.model, args, kwargs)
    return RunRecord(record.bridge, full, args, kwargs, record.draws, record.stats)


def _from_pyro_mcmc(mcmc: pyro.infer.MCMC, args: tuple, kwargs: dict) -> RunRecord:
    model = getattr(mcmc.kernel, "model", None)
    if model is None:
        raise TypeError("this pyro.infer.MCMC run has no model (its kernel was given a potential_fn); nothing to read.")
    if getattr(mcmc, "_samples", None) is None:
        raise RuntimeError("call mcmc.run(...) before converting a pyro.infer.MCMC.")
    if not args and not kwargs:
        args, kwargs = tuple(mcmc._args or ()), dict(mcmc._kwargs or {})
    bridge = ModelBridge(FullDataModel(model), args, kwargs)
    samples = mcmc.get_samples(group_by_chain=True)
    num_chains, num_draws = next(iter(samples.values())).shape[:2]
    diverging = torch.zeros(num_chains, num_draws, dtype=torch.bool)
    divergences = mcmc.diagnostics().get("divergences", {})
    for chain in range(num_chains):
        diverging[chain, divergences.get(f"chain {chain}", [])] = True
    return _record(bridge, samples, {"diverging": diverging})


def _from_dict(bridge: ModelBridge, samples: Mapping[str, Any]) -> tuple[RunRecord, dict[str, Tensor]]:
    values = {k: torch.as_tensor(v) for k, v in samples.items()}
    if not values or any(v.dim() == 0 for v in values.values()):
        raise ValueError("a dict of draws must map each site to a tensor with a leading draw dimension.")
    counts = {v.shape[0] for v in values.values()}
    if len(counts) != 1:
        raise ValueError(f"the draws have different numbers of draws per site: {sorted(counts)}.")
    record = _record(bridge, {k: v.unsqueeze(0) for k, v in values.items() if k in bridge.sites})
    observed = bridge.observed_data() if set(values) & set(bridge.observed) else {}
    extra = {}
    for name, value in values.items():
        if name in bridge.sites:
            continue
        if name in observed and value[0].numel() == observed[name].numel():
            value = value.reshape((-1,) + observed[name].shape)
            if torch.equal(value.to(observed[name]), observed[name].expand_as(value)):
                warnings.warn(
                    f"every draw of the observed site '{name}' equals the observed data: the draws were made with "
                    "the observed values given (Predictive(model, ...)(x, y)), so they are not predictions and are "
                    "left out. Call Predictive with y=None, or pass posterior_predictive=True here.",
                    stacklevel=4,
                )
                continue
        extra[name] = value.unsqueeze(0)
    return record, extra


def _from_guide(bridge: ModelBridge, guide: Callable, num_samples: int, seed: int | None) -> RunRecord:
    draws = guide_draws(bridge, guide, num_samples, seed)
    return _record(bridge, {k: v.unsqueeze(0) for k, v in draws.items()})
