r"""The control variate's centre: found, given or chosen (its density: :mod:`pyro_scalable.infer.gradients.controlled`).

``control_variate="map"`` finds :math:`\hat\theta` by
:func:`~pyro_scalable.infer.mode_search.find_mode`: L-BFGS on a subsample, then on full-data passes until the next
step would be under 0.01 posterior standard deviations, whose last pass gives :math:`\ell(\hat\theta)` and
:math:`\nabla\ell(\hat\theta)`; ``"warmup"`` centres it at the mean of each of warm-up's metric windows in turn (the
posterior's bulk, where a hierarchy's joint mode is not; :mod:`.control_choice`); a dict of constrained values, or a
trained guide (its ``median()``), is used as given. Far from :math:`\hat\theta` (another mode of a multimodal
posterior) the estimate stays unbiased but its noise grows with :math:`\lVert\theta-\hat\theta\rVert^2`; the noise
estimate sees that, so the draws stay calibrated, only the steps get smaller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_sample

from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.bridge.observed import no_mode_reason
from pyro_scalable.infer.full_data import ControlVariate, full_data_gradient
from pyro_scalable.infer.mode_search import ModeSearch, find_mode

__all__ = [
    "CentreError",
    "ControlVariate",
    "ModeSearch",
    "check_control_variate",
    "find_mode",
    "full_data_gradient",
    "prepare",
    "require_full_data",
]

CHOICES = (None, "auto", "map", "warmup")  # "auto": see control_choice.choose


def check_control_variate(control_variate: Any) -> Any:
    """Validate a kernel's ``control_variate=``: ``None``, ``"auto"``, ``"map"``, ``"warmup"``, a dict, or a guide."""
    if control_variate is None or isinstance(control_variate, Mapping):
        return control_variate
    if isinstance(control_variate, str):
        if control_variate not in CHOICES:
            raise ValueError(
                "control_variate must be None, 'auto', 'map', 'warmup', a dict of latent values by site, or a trained "
                f"guide; got {control_variate!r}."
            )
        return control_variate
    if not callable(getattr(control_variate, "median", None)):
        raise TypeError(
            "control_variate must be None, 'auto', 'map', 'warmup', a dict of latent values by site, or a trained "
            f"autoguide (with median()); got {type(control_variate).__name__}."
        )
    return control_variate


def require_full_data(full: ModelBridge | None) -> None:
    """Refuse a control variate without the full data (a ``batches=`` loader run given none), naming the fix.

    Example:
        >>> require_full_data(None)
        Traceback (most recent call last):
        ...
        ValueError: control_variate needs the full data for its full-data passes: with batches=, also pass the full ...

    """
    if full is None:
        raise ValueError(
            "control_variate needs the full data for its full-data passes: with batches=, also pass the full "
            "data to run(*args, batches=loader)."
        )


def prepare(
    option: Any,
    bridge: ModelBridge,
    full: ModelBridge,
    start: Latents,
    seed: int,
    *,
    chunk_size: int | None = None,
    reducer: Any = None,
    progress: bool = False,
) -> tuple[ControlVariate, ModeSearch | None]:
    """The control variate a kernel's ``control_variate=`` option asks for, on the run's data.

    ``start`` is one chain's unconstrained initial point; the mode search starts there or at a draw from the prior
    (seeded from ``seed``), whichever has the higher log joint on one chunk of the data: on a tanh network with
    fan-in-scaled priors, ``init_to_uniform``'s ±2 in every weight saturates the units, where the gradient is nearly
    flat and the search needs many times the full-data passes it needs from a prior draw. The search draws its
    subsample from its own generator, seeded from ``seed`` (the run's generator is untouched), and its last pass is
    the control variate's. ``full`` is the full-data model (:func:`require_full_data` refuses a run without one
    first); ``bridge``, the run's, gives the generator its device. ``progress``: the mode search's progress bar.
    """
    search = None
    if option == "map":
        generator = torch.Generator(device=bridge.device).manual_seed(seed + 2)
        prior_draw = {name: x[0] for name, x in full.init_latents(1, init_to_sample, seed=seed + 4).items()}
        centre, search = find_mode(
            full,
            start,
            generator,
            chunk_size=chunk_size,
            reducer=reducer,
            progress=progress,
            description="Mode search (control variate)",
            also=[prior_draw],  # a draw from the prior: its scales, where init_to_uniform's ±2 saturates a network
        )
    else:
        values = dict(option) if isinstance(option, Mapping) else option.median(*full.args, **full.kwargs)
        missing = [name for name in full.sites if name not in values]
        if missing:
            raise ValueError(
                f"control_variate gives no value for latent site(s) {', '.join(map(repr, missing))}: give every "
                "latent site's value (constrained, as the model samples it), or use control_variate='map'."
            )
        values = {
            name: torch.as_tensor(values[name], dtype=site.dtype, device=full.device).detach()
            for name, site in full.sites.items()
        }
        centre = full.unconstrain(values)
    control = search.control if isinstance(search, ModeSearch) else None  # the search's last pass, if it had one
    if control is None:
        control = full_data_gradient(full, centre, chunk_size=chunk_size, reducer=reducer)
    bad = [name for name, g in control.gradient.items() if not bool(torch.isfinite(g).all())]
    if bad or not bool(torch.isfinite(control.log_joint)):
        found = "the mode search found no finite mode" if search is not None else "the given centre is not finite"
        fix = (
            f"{no_mode_reason(full)}; or use control_variate='warmup' (warm-up's window means as centres, with a "
            "metric) or None."
            if search is not None
            else "give a centre inside the prior's support, or control_variate='map'."
        )
        at = f" at site(s) {', '.join(map(repr, bad))}" if bad else ""
        raise CentreError(f"the control variate's centre has a non-finite log joint or gradient ({found}){at}; {fix}")
    return control, search


class CentreError(ValueError):
    """The control variate's centre has a non-finite log joint or gradient: ``"auto"`` then runs without one.

    A centre the user asked for (``"map"``, a dict, a guide) raises it, saying whether a mode search found it.
    """
