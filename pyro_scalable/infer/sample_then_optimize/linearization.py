r"""Where sample-then-optimise linearises the model: the given point, the model's own start, or the MAP it finds.

Only a **linear-Gaussian** model needs no MAP: an output linear in the latents (and no other latent) with a
homoscedastic Normal likelihood is its own linearisation, at any point, and its posterior is exactly the Gaussian
the solver samples, centred at the solved mean. Every other model is linearised at its MAP :math:`\theta_*`: a
network, and a GLM too — its predictor is linear in the latents, but its likelihood is not Gaussian, so its posterior
is the Gaussian of the likelihood's curvature *at the mode* (the Laplace approximation; for a canonical link the
GGN is the Hessian), and a Gaussian built anywhere else is centred at the wrong point with the wrong spread. The
point is given (constrained values, or a trained autoguide's ``median``) or found by the package's full-data mode
search (:func:`~pyro_scalable.infer.mode_search.find_mode`: L-BFGS on subsamples, then on full-data passes), to
:data:`MAP_TOLERANCE`·√d posterior sds; the solve's MAP check then measures what is left.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_median, init_to_sample, init_to_uniform
from torch import Tensor

from pyro_scalable.bridge.checks import ModelError, user_stacklevel
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.linearized.sampling import is_linear_gaussian
from pyro_scalable.infer.linearized.sites import choose_sites
from pyro_scalable.infer.mode_search import find_mode

__all__ = ["MAP_TOLERANCE", "check_draws_finite", "find_map", "linearization_point"]

MAP_TOLERANCE = 0.01  # the MAP search stops within this times √d posterior sds of the mode (d latents)


def linearization_point(
    bridge: ModelBridge,
    site: str,
    args: tuple,
    kwargs: dict,
    generator: torch.Generator,
    *,
    linearize_at: dict[str, Tensor] | Any | None,
    sites: list[str] | str | None,
    map_steps: int,
    quiet: bool,
) -> Latents:
    """The unconstrained latents to linearise at: given, the model's own start when linear-Gaussian, or the MAP."""
    given = linearize_at
    if given is not None:
        values = given if isinstance(given, dict) else _guide_median(given, args, kwargs)
        missing = sorted(set(bridge.sites) - set(values))
        if missing:
            raise ModelError(f"linearize_at lacks the latent site(s) {missing}; give a value for every latent site.")
        latents = {}
        for name, latent in bridge.sites.items():
            value = torch.as_tensor(values[name], dtype=latent.dtype).detach()
            if value.shape != latent.shape:
                raise ModelError(
                    f"linearize_at['{name}'] has shape {tuple(value.shape)}, the site has {tuple(latent.shape)}."
                )
            latents[name] = latent.transform.inv(value.to(bridge.device))
        return latents
    start = {k: v[0] for k, v in bridge.init_latents(1, init_to_median, seed=int(generator.initial_seed())).items()}
    chosen, *_ = choose_sites(bridge, site, start, sites)
    if set(chosen) == set(bridge.sites) and is_linear_gaussian(bridge, site, chosen, start, generator):
        return start
    return find_map(bridge, generator, map_steps=map_steps, quiet=quiet)


def find_map(bridge: ModelBridge, generator: torch.Generator, *, map_steps: int, quiet: bool) -> Latents:
    """The MAP by the full-data mode search (at most ``map_steps`` L-BFGS iterations per stage).

    It starts at Pyro's uniform initialisation or at a draw from the prior, whichever has the higher log joint on a
    chunk of the data (a network's units saturate at ``init_to_uniform``'s ±1 where its prior's scale is smaller).
    """
    if map_steps == 0:
        raise ModelError(
            "the model is not linear-Gaussian (its output is not linear in its latents, its likelihood is not a "
            "Normal with a fixed scale, or it has other latents, e.g. a noise scale), so it is linearised at its "
            "MAP: pass linearize_at={site: value} or a trained guide, or map_steps > 0 to let the engine find it."
        )
    seed = int(generator.initial_seed())
    start = {k: v[0] for k, v in bridge.init_latents(1, init_to_uniform(radius=1.0), seed=seed).items()}
    prior_draw = {k: v[0] for k, v in bridge.init_latents(1, init_to_sample, seed=seed + 1).items()}
    mode, search = find_mode(
        bridge,
        start,
        generator,
        iterations=map_steps,
        tolerance=MAP_TOLERANCE,
        progress=not quiet,
        description="MAP search",
        also=[prior_draw],
    )
    if search.control is None or not all(bool(torch.isfinite(v).all()) for v in mode.values()):
        raise ModelError(
            "the MAP search found no finite mode of the log joint (a density that grows without bound, e.g. a "
            "scale that runs to zero, or non-finite values in the data); pass linearize_at={site: value}."
        )
    if not search.converged:
        warnings.warn(
            f"the MAP search stopped short of the mode after {search.full_passes} passes over the data (the full-data "
            f"gradient's norm there is {search.grad_norm:.3g}): the model is linearised, and its draws centred, at a "
            f"point that is not a MAP. Pass map_steps= above {map_steps}, or linearize_at= a MAP you found.",
            stacklevel=user_stacklevel(),
        )
    constrained = bridge.constrain(mode)
    edge = [name for name, value in constrained.items() if not bool(torch.isfinite(value).all())]
    if edge:
        raise ModelError(
            f"the MAP search ran to the edge of the support of {', '.join(f'site {n!r}' for n in edge)} (no "
            "finite mode: e.g. a hierarchy's scale, whose joint density grows without bound at 0 or infinity); pass "
            "linearize_at={site: value} at a point you trust, or sample the model with SG-MCMC, which needs no mode."
        )
    return {k: v.detach() for k, v in mode.items()}


def _guide_median(guide: Any, args: tuple, kwargs: dict) -> dict[str, Tensor]:
    if not hasattr(guide, "median"):
        raise TypeError(
            f"linearize_at must be a dict of constrained values by site name or a trained autoguide, got {guide!r}."
        )
    return {k: v.detach() for k, v in guide.median(*args, **kwargs).items()}


def check_draws_finite(bridge: ModelBridge, latents: Latents) -> None:
    """Refuse draws (unconstrained, by site) that are not finite once constrained, naming the sites.

    A Gaussian in unconstrained space is too wide where the curvature of the prior and the data at the linearisation
    point is near zero: a hierarchy's scale at a MAP near 0, whose exp overflows.
    """
    infinite = [name for name, value in bridge.constrain(latents).items() if not bool(torch.isfinite(value).all())]
    if infinite:
        raise ModelError(
            f"the draws of {', '.join(f'site {n!r}' for n in infinite)} are not finite once constrained: the "
            "Gaussian in unconstrained space is too wide there, where the curvature at the linearisation point is "
            "near zero (e.g. a hierarchy's scale at its MAP near 0). A Gaussian posterior does not fit this model: "
            "sample it with SG-MCMC, or pass linearize_at=... and sites=[...] without that site. The solver's rows "
            "are in engine.state."
        )
