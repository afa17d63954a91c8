"""``AutoLinearizedLaplace``: Pyro's MAP-then-Laplace autoguide, with GGN curvature over the full data.

Training is exactly ``AutoLaplaceApproximation``'s (a point mass in unconstrained space fitted by ``SVI``, any
minibatch plates included). :meth:`AutoLinearizedLaplace.laplace_approximation` then builds a
:class:`LaplacePosterior`: it finds the observed site and its likelihood family, picks the Laplace sites (those
the mean output depends on; a scalar Normal noise scale is held at its MAP and can be fitted by the evidence),
reads the prior from the model, and computes the curvature in one pass over the full data.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pyro.infer.autoguide import AutoLaplaceApproximation
from pyro.infer.autoguide.initialization import InitMessenger, init_to_sample, init_to_uniform

from pyro_scalable.arguments import check_choice, check_count, check_flag, check_number, check_seed, check_tensor
from pyro_scalable.bridge.checks import ModelError, user_stacklevel
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.bridge.plates import FullDataModel
from pyro_scalable.infer.laplace.curvature import FitRequest, PassStructure
from pyro_scalable.infer.laplace.posterior import LaplacePosterior
from pyro_scalable.infer.laplace.structures import STRUCTURES, StructureName, structure_class
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.map_check import GAIN_THRESHOLD
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sites import choose_sites, observed_site
from pyro_scalable.infer.mode_search import ModeSearch, find_mode

__all__ = ["AutoLinearizedLaplace"]


class AutoLinearizedLaplace(AutoLaplaceApproximation):
    """Linearised Laplace for a Pyro model: train the MAP with ``SVI``, then call :meth:`laplace_approximation`.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro.infer import SVI, Trace_ELBO
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0], subsample_size=32) as idx:
        ...         pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])
        >>> x = torch.randn(200, 3); y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -1.0, 0.5])))
        >>> guide = AutoLinearizedLaplace(model)
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        >>> for _ in range(300):
        ...     _ = svi.step(x, y)
        >>> posterior = guide.laplace_approximation(x, y, structure="full", check_map=False)
        >>> posterior.predict(x[:5]).distribution.probs.shape
        torch.Size([5])

    """

    def __init__(self, model: Any, *args: Any, **kwargs: Any):
        if not callable(model):
            raise TypeError(f"model must be a Pyro model (a callable), got {type(model).__name__}.")
        super().__init__(model, *args, **kwargs)

    def _loc_scale(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # the guide is a point mass at its MAP (Pyro's AutoLaplaceApproximation trains a Delta): ``median()``, and
        # so ``SampleThenOptimize(model, linearize_at=guide)``, read the MAP (the zero scale is never used by it)
        return self.loc, torch.zeros_like(self.loc)

    def laplace_approximation(
        self,
        *args: Any,
        structure: StructureName = "kron",
        sites: Sequence[str] | Literal["last_layer"] | None = None,
        curvature: Literal["ggn", "ef"] = "ggn",
        prior_precision: torch.Tensor | float | None = None,
        rank: int = 50,
        num_samples: int = 64,
        sampler_options: dict[str, Any] | None = None,
        jitter: float = 0.0,
        chunk_size: int | None = None,
        map_latents: Latents | None = None,
        check_map: bool = True,
        finish_map: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ) -> LaplacePosterior:
        """The Laplace posterior at the MAP on the data ``args``/``kwargs`` (the model's own arguments).

        Args:
            structure: ``"full"``, ``"diag"``, ``"kron"`` (K-FAC per linear layer, diagonal elsewhere) or
                ``"low_rank"`` (top-``rank`` eigenpairs of the GGN), or ``"sampled"`` (``num_samples`` draws of
                the full-GGN posterior by sample-then-optimise — the solver
                :class:`~pyro_scalable.infer.SampleThenOptimize` runs, :mod:`pyro_scalable.infer.linearized.sampling`
                — for nets too large for the others; no evidence, EM instead). ``sampler_options`` go to the solver
                (``num_epochs``, ``variance_reduction``, ``step_size``, ``chunk_size``, ``seed``, ...).
            sites: the latent sites the Laplace covers (default: all that the mean output depends on), or
                ``"last_layer"``; every other latent is held at its MAP value.
            curvature: the GGN, or the empirical Fisher (``"ef"``).
            prior_precision: overrides the precision read from the model's priors (scalar or flat vector).
            jitter: added to the prior precision, for a curvature that is singular.
            chunk_size: data points per pass (default: the plate's subsample size, at least 1024).
            map_latents: constrained MAP values by site name, instead of the trained guide's.
            check_map: warn when the MAP is not a maximum (a Gauss-Newton step would gain more than a nat).
            finish_map: where that check finds the trained guide's point is not a MAP, finish it with the full-data mode
                search (:func:`~pyro_scalable.infer.mode_search.find_mode`: L-BFGS from the point, exact Newton
                steps up to 64 latents) and fit there; ``posterior.map_search`` records the search (``None`` where
                the point was a MAP). SVI's minibatch steps stop short of the mode where the posterior is narrow in
                one direction and wide in another (a regression on unscaled predictors, where a fixed budget of Adam
                steps can leave the point many posterior sds off). ``False``, or ``map_latents`` given: fit
                at the point as it is, and warn.
            seed: seeds the random probes of ``"low_rank"``.

        """
        check_choice("structure", structure, tuple(STRUCTURES))
        check_choice("curvature", curvature, ("ggn", "ef"))
        if prior_precision is not None:
            check_tensor("prior_precision", prior_precision, nonnegative=True)
        check_count("rank", rank)
        check_count("num_samples", num_samples)
        if sampler_options is not None and not isinstance(sampler_options, Mapping):
            raise TypeError(f"sampler_options must be a dict or None, got {type(sampler_options).__name__}.")
        check_number("jitter", jitter, nonnegative=True)
        check_count("chunk_size", chunk_size, optional=True)
        if map_latents is not None and not isinstance(map_latents, Mapping):
            raise TypeError(
                f"map_latents must be a dict of constrained values by site name, got {type(map_latents).__name__}."
            )
        check_flag("check_map", check_map)
        check_flag("finish_map", finish_map)
        check_seed("seed", seed)
        structure_type = structure_class(structure)
        # a structure fitted by the one GGN pass has each chunk's observed values checked there, before they are
        # used; the bridge's own check would be one more forward pass of the model over the full data
        in_pass = issubclass(structure_type, PassStructure)
        bridge = ModelBridge(_user_model(self.model), args, kwargs, check_values=not in_pass)
        site = observed_site(bridge, "linearised Laplace")
        if chunk_size is not None and not bridge.plates:
            warnings.warn(
                f"chunk_size={chunk_size} is ignored: the model has no plate with subsample_size, so the data is "
                "passed in one go. Give the data plate a subsample_size to have it walked in chunks.",
                stacklevel=2,
            )
        latents = self._map(bridge, map_latents)
        options = {
            "sites": sites,
            "structure": structure,
            "curvature": curvature,
            "prior_precision": prior_precision,
            "rank": rank,
            "num_samples": num_samples,
            "sampler_options": sampler_options,
            "jitter": jitter,
            "chunk_size": chunk_size,
            "seed": seed,
            "check_map": check_map,
        }
        posterior = self._fit(bridge, site, latents, args, kwargs, **options)
        if check_map and structure_type.has_evidence:  # otherwise the sampler checks it (a Newton step, its mean row)
            finish = finish_map and map_latents is None
            if posterior.check_map(warn=not finish) > GAIN_THRESHOLD and finish:
                latents, search = _finish(self.model, args, kwargs, latents, seed)
                posterior = self._fit(bridge, site, latents, args, kwargs, **options)
                posterior.map_search = search
                posterior.check_map()
            if posterior.structure != "diag":  # the diagonal overcounts γ even on a MAP that does not interpolate
                posterior.check_noise()
        return posterior

    def _fit(
        self,
        bridge,
        site,
        latents,
        args,
        kwargs,
        *,
        sites,
        structure,
        curvature,
        prior_precision,
        rank,
        num_samples,
        sampler_options,
        jitter,
        chunk_size,
        seed,
        check_map,
    ) -> LaplacePosterior:
        """The Laplace posterior at the unconstrained ``latents`` (unchecked)."""
        structure_type = structure_class(structure)
        chosen, heteroscedastic, noise_site, noise = choose_sites(bridge, site, latents, sites)
        layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
        theta = layout.flatten(latents).detach()
        net = NetworkFunction(
            bridge, site, layout, theta, latents, heteroscedastic=heteroscedastic, chunk_size=chunk_size
        )
        precision, mean = net.prior(theta, joint=True)
        if precision.dim() == 2 and structure != "full" and prior_precision is None:
            raise ModelError(
                f"the Laplace sites have a correlated Gaussian prior (a posterior's as_prior), which structure="
                f"'{structure}' cannot hold (its prior precision is diagonal); use structure='full', or make the "
                "previous posterior's prior with a diagonal structure (structure='diag': the EWC update)."
            )
        if prior_precision is not None:
            check_tensor("prior_precision", prior_precision, nonnegative=True, shape=theta.shape)
            precision = torch.broadcast_to(
                torch.as_tensor(prior_precision, dtype=theta.dtype, device=theta.device), theta.shape
            ).clone()
        request = FitRequest(
            net,
            theta,
            precision,
            curvature=curvature,
            rank=rank,
            generator=torch.Generator(device=theta.device).manual_seed(seed),
            model=_user_model(self.model),
            args=args,
            kwargs=kwargs,
            latents=latents,
            num_samples=num_samples,
            sampler_options=dict(sampler_options or {}),
            seed=seed,
            check_map=check_map,
        )
        fit = structure_type.fit(request)
        if curvature == "ef":
            noise = None
        posterior = LaplacePosterior(
            net,
            fit,
            precision,
            mean,
            structure=structure_type,
            noise_scale=noise,
            noise_site=noise_site,
            jitter=jitter,
            curvature=curvature,
        )
        posterior.precision  # noqa: B018  (factorise now: a singular curvature is an error here, not later)
        return posterior

    def _map(self, bridge: ModelBridge, map_latents: Latents | None) -> Latents:
        if map_latents is not None:
            missing = sorted(set(bridge.sites) - set(map_latents))
            if missing:
                raise ModelError(f"map_latents lacks the latent site(s) {missing}.")
            values = {}
            for name, site in bridge.sites.items():
                value = torch.as_tensor(map_latents[name], dtype=site.dtype, device=bridge.device).detach()
                if value.shape != site.shape:
                    raise ModelError(
                        f"map_latents['{name}'] has shape {tuple(value.shape)}, the site has {tuple(site.shape)}."
                    )
                values[name] = value
            return {k: v.detach() for k, v in bridge.unconstrain(values).items()}
        if not hasattr(self, "loc"):
            raise ModelError(
                "the guide has not been trained: run SVI(model, guide, optimizer, Trace_ELBO()) on the data first, "
                "or pass map_latents={site: value}."
            )
        latents = {site["name"]: value.detach() for site, value in self._unpack_latent(self.loc)}
        return {name: latents[name].reshape(bridge.sites[name].unconstrained_shape) for name in bridge.sites}


def _finish(model, args: tuple, kwargs: dict, latents: Latents, seed: int) -> tuple[Latents, ModeSearch]:
    """The full-data mode search from the unconstrained ``latents``, to :data:`MAP_TOLERANCE` sds."""
    full = ModelBridge(FullDataModel(_user_model(model)), args, kwargs)
    generator = torch.Generator(device=full.device).manual_seed(seed)
    start = {name: latents[name].reshape(site.unconstrained_shape) for name, site in full.sites.items()}
    # also from Pyro's initialisation and a prior draw (as sample-then-optimise's search): the search starts from
    # the best of the three on a chunk of the data (SVI can leave a point far worse than either)
    uniform = {k: v[0] for k, v in full.init_latents(1, init_to_uniform(radius=1.0), seed=seed).items()}
    prior_draw = {k: v[0] for k, v in full.init_latents(1, init_to_sample, seed=seed + 1).items()}
    mode, search = find_mode(full, start, generator, tolerance=MAP_TOLERANCE, also=[uniform, prior_draw])
    if search.control is None or not all(bool(torch.isfinite(v).all()) for v in mode.values()):
        raise ModelError(
            "the trained point is not a MAP, and the mode search from it found no finite mode of the log joint (a "
            "density that grows without bound, e.g. a scale that runs to zero): pass map_latents= at a point you "
            "trust, or finish_map=False to fit where the guide is."
        )
    if not search.converged:
        warnings.warn(
            f"the trained point is not a MAP, and the mode search from it stopped short of the mode after "
            f"{search.full_passes} passes over the data (the full-data gradient's norm there is "
            f"{search.grad_norm:.3g}): the Laplace posterior is fitted there. Train the guide to its MAP, or pass "
            "map_latents= a MAP you found.",
            stacklevel=user_stacklevel(),
        )
    return {name: mode[name].detach().reshape(latents[name].shape) for name in latents}, search


MAP_TOLERANCE = 0.01  # the finished MAP: its next step under 0.01·√d posterior sds


def _user_model(model):
    # AutoContinuous wraps the model in an InitMessenger, which would initialise (and for a discrete site, reject)
    # the observed site at test inputs; the bridge needs the model as written.
    while isinstance(model, functools.partial) and len(model.args) == 2 and isinstance(model.args[0], InitMessenger):
        model = model.args[1]
    return model
