r"""Which control variate a run uses, and where its centre is: ``control_variate="auto"``, ``"map"``, ``"warmup"``.

The controlled density is :class:`~pyro_scalable.infer.gradients.ControlledDensity`, its centre
:mod:`.control_variates`; this module is the driver's policy. ``"auto"`` chooses from the model
and the run (:func:`choose`, with the reason for each threshold); :func:`attach` wraps the run's log
posterior in the chosen estimate, finding a ``"map"`` centre once (a resumed run reads it back); with ``"warmup"``
the driver calls :func:`recentre` at the end of each of warm-up's metric windows (one full-data pass each) and
steps burn-in on the plain density (:func:`~.run_state.step_densities`): a chain far from the centre sees noise
growing with :math:`\lVert\theta-\hat\theta\rVert^2`, and burn-in, which does not bound the gradient noise, would
amplify it until the chains run away, even from a centre at the exact posterior mean.
"""

from __future__ import annotations

from typing import Any

from pyro_scalable.bridge.hierarchy import prior_parents
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.gradients import ControlledDensity, MinibatchDensity
from pyro_scalable.infer.sgmcmc.control_variates import (
    CentreError,
    ControlVariate,
    full_data_gradient,
    prepare,
    require_full_data,
)

__all__ = ["AUTO_RATIO", "HIERARCHY_RATIO", "ROWS_PER_GROUP", "attach", "centred", "choose", "recentre"]

AUTO_RATIO = 10  # "auto": a control variate at the mode where N/B reaches this (why: see choose())
HIERARCHY_RATIO = 4  # "auto": centred at warm-up's windows for a hierarchy where N/B reaches this (see choose())
ROWS_PER_GROUP = 20  # "auto": a centred hierarchy with this many rows per group or more is centred at its mode


def choose(option: Any, kernel: Any, bridge: ModelBridge, *, windows: bool = True) -> Any:
    """What ``"auto"`` means for this kernel on this model: ``"map"``, ``"warmup"`` or ``None``.

    ``windows``: whether warm-up has metric stages (whose window means ``"warmup"`` centres on). Any option other
    than ``"auto"`` is kept, except that ``"warmup"`` without them is refused with the fix.

    Only where warm-up chooses the step size (so the noise bound sets it), the gradient noise is corrected, and one
    plate is subsampled (off for a hand-set step, where the noise is then not the bound, for a loader's plate, with
    no full data to centre on unless given, and for several subsampled plates). There:

    * ``"map"`` where ``N/B ≥`` :data:`AUTO_RATIO` and no latent site is in a plate. The plain estimate's noise bound
      makes the step about ``B/N`` of the curvature bound and a relaxation time about ``N/B`` steps; the control
      variate lifts that bound for twice the work per step. From about ``N/B = 10`` the controlled noise is small
      enough that warm-up's friction drops several-fold, and the effective draws this gains outweigh the second
      gradient per step; below it, the plain estimate's bound is too loose for the centre to pay.
    * For a model with a latent site inside a plate (group-level latents: a hierarchy) where ``N/B ≥``
      :data:`HIERARCHY_RATIO`: each group's effect is informed by its own rows only, so the plain estimate's noise
      binds even at a small ``N/B``.

      - ``"map"`` where the hierarchy is **centred** (every such site's prior depends on other latents,
        ``b_j ~ N(μ, τ)``: :func:`centred`) and has :data:`ROWS_PER_GROUP` rows per group or more (N over the
        largest group plate). There the data place each group's effect and the mode (a local one: the joint
        density is unbounded where τ → 0 and every b_j → 0) sits in the bulk, whereas the mean of a warm-up
        window can lie far outside it in a scale's direction (the chains may still be travelling when the last
        window closes), where the controlled noise, and warm-up's friction with it, is large. With fewer rows per
        group the data place the effects less firmly, the mode moves towards the funnel's neck, and ``"warmup"``
        does as well or better. Where the search finds no finite mode (it ran into that funnel), :func:`attach`
        goes on with ``"warmup"``.
      - ``"warmup"`` otherwise, and always where it is **non-centred** (``z_j ~ N(0, 1)``, ``μ + τ z_j`` in the
        likelihood). There the joint mode is not where the posterior's mass is: the mode wants every z near 0 and
        a large group scale τ, while the draws hold ‖z‖² ≈ G, so a centre at the mode lies far outside the bulk
        and chains controlled there drift away from it (and from one another: a high r_hat). Warm-up's window
        means are in the bulk.

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
    plates = list(bridge.plates.values())
    groups = _group_sizes(bridge)
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
    if groups:
        if ratio < HIERARCHY_RATIO:
            return None
        rows = plates[0].size / max(groups.values())
        return "map" if rows >= ROWS_PER_GROUP and centred(bridge) else ("warmup" if windows else None)
    return "map" if ratio >= AUTO_RATIO else None


def _group_sizes(bridge: ModelBridge) -> dict[str, int]:
    """The latent sites inside a plate (group-level latents: a hierarchy), each with its largest plate's size."""
    sites = bridge.sites.items()
    return {
        name: max(size for size, plate in zip(site.shape, site.plates) if plate is not None)
        for name, site in sites
        if any(plate is not None for plate in site.plates)
    }


def centred(bridge: ModelBridge) -> bool:
    """Whether every latent site in a plate has a prior that depends on other latents (a centred hierarchy).

    ``b_j ~ Normal(mu, tau)`` is centred; ``z_j ~ Normal(0, 1)`` with ``mu + tau * z_j`` in the likelihood is not.
    Read from the latents each prior depends on (:func:`~pyro_scalable.bridge.hierarchy.prior_parents`).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y, centred=True):
        ...     tau = pyro.sample("tau", dist.HalfNormal(1.0))
        ...     with pyro.plate("groups", 3):
        ...         b = pyro.sample("b", dist.Normal(0.0, tau if centred else 1.0))
        ...     scale = 1.0 if centred else tau
        ...     with pyro.plate("data", len(y), subsample_size=3) as idx:
        ...         pyro.sample("obs", dist.Normal(scale * b[idx % 3], 1.0), obs=y[idx])
        >>> y = torch.randn(30)
        >>> centred(ModelBridge(model, (y,))), centred(ModelBridge(model, (y, False)))
        (True, False)

    """
    grouped = _group_sizes(bridge)
    parents = prior_parents(bridge) if grouped else {}
    return bool(grouped) and all(parents[name] for name in grouped)


def attach(
    option: Any,
    base: MinibatchDensity,
    start: Latents,
    seed: int,
    reducer: Any,
    *,
    bridge: ModelBridge,
    full: ModelBridge | None,
    resumed: ControlVariate | None = None,
    chosen: bool = False,
    windows: bool = True,
    progress: bool = False,
) -> tuple[MinibatchDensity, ControlVariate | None, Any, Any]:
    """The density with the control variate ``option`` (from :func:`choose`) asks for, its centre and search.

    Returns ``(density, control variate, mode search, option)``: ``base`` and ``None`` where ``option`` is
    ``None``. A centre ``resumed`` from a checkpoint is used as it is; otherwise one is found (one chain's initial
    point ``start`` begins a mode search on ``bridge``, the full-data gradient on ``full``); ``"warmup"`` starts with
    none (the plain estimate until warm-up's first calibrated half). ``chosen``: ``option`` is what ``"auto"``
    chose, and a mode search that finds no finite mode does not fail the run: a centred hierarchy (its group scale
    runs to 0 where the groups' data are few) goes on with ``"warmup"`` where warm-up has metric stages
    (``windows``), any other model plain. The option returned is the one the run goes on with. The driver keeps
    what this returns, and checkpoints a new centre at once. ``progress``: a progress bar for the mode search.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.arange(20.0),))
        >>> fn, control, _, _ = attach({"mu": torch.tensor(9.5)}, bridge.log_posterior_fn, {}, 0, None,
        ...                         bridge=bridge, full=bridge)
        >>> float(control.centre["mu"]), fn.inner is not None
        (9.5, True)

    """
    if option is None:
        return base, None, None, None
    require_full_data(full)
    control, search = resumed, None
    if control is None and option != "warmup":
        try:
            control, search = prepare(option, bridge, full, start, seed, reducer=reducer, progress=progress)
        except CentreError:
            if not chosen:
                raise
            if windows and _group_sizes(bridge):  # a centred hierarchy's funnel: its group scale runs to 0
                return ControlledDensity(base, None), None, None, "warmup"
            return base, None, None, None
    return ControlledDensity(base, control), control, search, option


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
