r"""Which control variate a run uses, and where its centre is: ``control_variate="auto"``, ``"map"``, ``"warmup"``.

The estimator is in :mod:`.control_variates`; this module is the driver's policy. ``"auto"`` chooses from the model
and the run (:func:`choose`, with the measurements behind each threshold); :func:`attach` wraps the run's log
posterior in the chosen estimate, finding a ``"map"`` centre once (a resumed run reads it back); with ``"warmup"``
the driver calls :func:`recentre` at the end of each of warm-up's metric windows (one full-data pass each) and
switches the estimate off in burn-in (``ControlledLogPosterior.active``): a chain far from the centre sees noise
growing with :math:`\lVert\theta-\hat\theta\rVert^2`, and burn-in, which does not bound the gradient noise, would
amplify it (seen on the non-centred hierarchical logistic regression, centred at its exact posterior mean: the
burn-in chains ran away).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.sgmcmc.control_variates import (
    CentreError,
    ControlledLogPosterior,
    ControlVariate,
    full_data_gradient,
    prepare,
    require_full_data,
)

__all__ = ["AUTO_RATIO", "HIERARCHY_RATIO", "attach", "choose", "recentre"]

AUTO_RATIO = 10  # "auto": a control variate at the mode where N/B reaches this (measured: see choose())
HIERARCHY_RATIO = 4  # "auto": centred at warm-up's windows for a hierarchy where N/B reaches this (see choose())


def choose(option: Any, kernel: Any, bridge: ModelBridge, *, windows: bool = True) -> Any:
    """What ``"auto"`` means for this kernel on this model: ``"map"``, ``"warmup"`` or ``None``.

    ``windows``: whether warm-up has metric stages (whose window means ``"warmup"`` centres on). Any option other
    than ``"auto"`` is kept, except that ``"warmup"`` without them is refused with the fix.

    Only where warm-up chooses the step size (so the noise bound sets it), the gradient noise is corrected, and one
    plate is subsampled (off for a hand-set step, where the noise is then not the bound, for a loader's plate, with
    no full data to centre on unless given, and for several subsampled plates). There:

    * ``"map"`` where ``N/B ≥`` :data:`AUTO_RATIO` and no latent site is in a plate. The plain estimate's noise bound
      makes the step about ``B/N`` of the curvature bound and a relaxation time about ``N/B`` steps; the control
      variate lifts that bound for twice the work per step. From ``N/B = 10`` the controlled noise is small enough
      that warm-up's friction drops several-fold, and the draws a run keeps are worth about three times as many
      (the least bulk ESS of the accuracy zoo's small models, ``tests/model_zoo.py``) for about 1.2× the time.
    * ``"warmup"`` for a model with a latent site inside a plate (group-level latents: a hierarchy) where
      ``N/B ≥`` :data:`HIERARCHY_RATIO`. There the joint mode is not where the posterior's mass is: in a
      non-centred hierarchy with G group effects z ~ N(0, 1) the mode wants every z near 0 and a large group scale
      τ, while the draws hold ‖z‖² ≈ G, so a centre at the mode can lie far outside the posterior's bulk and
      chains controlled there drift away from it. Warm-up's window means are in the bulk; and each group's effect is
      informed by its own rows only, so the plain estimate's noise binds even at a small ``N/B``.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> from pyro_scalable.infer import SGHMC
        >>> def model(x, group, y):
        ...     tau = pyro.sample("tau", dist.HalfNormal(1.0))
        ...     with pyro.plate("groups", 3):
        ...         z = pyro.sample("z", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(y), subsample_size=10) as idx:
        ...         pyro.sample("obs", dist.Normal(tau * z[group[idx]] + x[idx], 1.0), obs=y[idx])
        >>> x, group = torch.randn(300), torch.arange(300) % 3
        >>> choose("auto", SGHMC(model), ModelBridge(model, (x, group, x)))
        'warmup'
        >>> choose("auto", SGHMC(model, step_size=1e-3), ModelBridge(model, (x, group, x))) is None  # a hand-set step
        True

    """
    plates = list(getattr(bridge, "plates", {}).values())
    hierarchy = any(name is not None for site in getattr(bridge, "sites", {}).values() for name in site.plates)
    if option == "warmup" and not windows:
        raise ValueError(
            "control_variate='warmup' centres on the means of warm-up's metric windows, and this run has none: "
            "use metric='diagonal' or 'dense' (or 'auto' with num_warmup >= 200 and a step size left to warm-up), "
            "or control_variate='map'."
        )
    if option != "auto":
        return option
    if kernel.step_size is not None or kernel.gradient_noise != "correct":
        return None
    if len(plates) != 1:
        return None
    ratio = plates[0].size / plates[0].subsample_size
    if hierarchy:
        return "warmup" if windows and ratio >= HIERARCHY_RATIO else None
    return "map" if ratio >= AUTO_RATIO else None


def attach(
    option: Any,
    base: Callable,
    start: Latents,
    seed: int,
    reducer: Any,
    *,
    bridge: ModelBridge,
    full: ModelBridge | None,
    resumed: ControlVariate | None = None,
    chosen: bool = False,
) -> tuple[Callable, ControlVariate | None, Any]:
    """The log posterior with the control variate ``option`` (from :func:`choose`) asks for, its centre and search.

    Returns ``(log posterior, control variate, mode search)``: ``base`` and ``None`` where ``option`` is ``None``. A
    centre ``resumed`` from a checkpoint is used as it is; otherwise one is found (one chain's initial point ``start``
    begins a mode search on ``bridge``, the full-data gradient on ``full``); ``"warmup"`` starts with none (the
    plain estimate until warm-up's first window). ``chosen``: ``option`` is what ``"auto"`` chose, and a mode search
    that finds no finite mode (a centred hierarchy whose group effects are not in a plate has none: its group scale
    runs to 0) leaves the run plain instead of failing it. The driver keeps what this returns, and checkpoints a new
    centre at once.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.arange(20.0),))
        >>> fn, control, _ = attach({"mu": torch.tensor(9.5)}, bridge.log_posterior_fn, {}, 0, None,
        ...                         bridge=bridge, full=bridge)
        >>> float(control.centre["mu"]), fn.active
        (9.5, True)

    """
    if option is None:
        return base, None, None
    require_full_data(full)
    control, search = resumed, None
    if control is None and option != "warmup":
        try:
            control, search = prepare(option, bridge, full, start, seed, reducer=reducer)
        except CentreError:
            if not chosen:
                raise
            return base, None, None
    return ControlledLogPosterior(base, control), control, search


def recentre(full: ModelBridge, schedule: Any, reducer: Any = None) -> ControlVariate:
    """A control variate centred at warm-up's last window mean (``control_variate="warmup"``): one full-data pass.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> from pyro_scalable.infer.sgmcmc.metric import MetricSchedule
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> schedule = MetricSchedule("dense", 200, {"mu": torch.zeros(4)})  # four chains of a scalar site
        >>> schedule.window_mean = torch.tensor([9.5])  # as next_map leaves it
        >>> control = recentre(ModelBridge(model, (torch.arange(20.0),)), schedule)
        >>> float(control.centre["mu"]), round(float(control.gradient["mu"]), 4)  # the prior's: the data's is 0
        (9.5, -0.095)

    """
    centre = schedule.layout.unflatten(schedule.window_mean)
    return full_data_gradient(full, centre, reducer=reducer)
