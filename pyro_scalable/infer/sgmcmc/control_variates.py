r"""Control variates: a minibatch log joint whose gradient noise vanishes at a centre near the posterior mode.

With a subsampled plate of N points and a minibatch :math:`\mathcal{B}` of B of them, the bridge's minibatch
estimate of the log joint is :math:`\ell_{\mathcal{B}}(\theta) = \log p(\theta) + \frac{N}{B}\sum_{i\in\mathcal{B}}
\log p(y_i\mid\theta)`; its gradient's covariance is :math:`O(N^2/B)` (:mod:`.base`). Given a centre
:math:`\hat\theta` and the full-data log joint :math:`\ell(\hat\theta)` and gradient :math:`\nabla\ell(\hat\theta)`
(one pass over the data), the **controlled** estimate (Baker, Fearnhead, Fox & Nemeth 2019, "Control variates for
stochastic gradient MCMC"; Nagapetyan et al. 2017) is

.. math::

    \tilde\ell_{\mathcal{B}}(\theta) = \ell(\hat\theta) + \ell_{\mathcal{B}}(\theta) - \ell_{\mathcal{B}}(\hat\theta)
        + \big\langle \nabla\ell(\hat\theta) - \nabla\ell_{\mathcal{B}}(\hat\theta),\ \theta - \hat\theta\big\rangle.

Both corrections have mean zero over minibatches, so :math:`\tilde\ell_{\mathcal{B}}` is again an unbiased
estimate of the log joint, and its gradient is the control-variate gradient

.. math::

    \nabla\tilde\ell_{\mathcal{B}}(\theta) = \nabla\ell(\hat\theta)
        + \big(\nabla\ell_{\mathcal{B}}(\theta) - \nabla\ell_{\mathcal{B}}(\hat\theta)\big),

in which the prior's terms cancel to :math:`\nabla\log p(\theta) - \nabla\log p(\hat\theta)` and the data's to
:math:`\frac{N}{B}\sum_{\mathcal{B}}(\nabla\log p(y_i\mid\theta) - \nabla\log p(y_i\mid\hat\theta))`. Its covariance is
:math:`(1 - B/N)\,\mathrm{Cov}_i(g_i(\theta) - g_i(\hat\theta))/B = O(N^2\lVert\theta-\hat\theta\rVert^2/B)`: zero at
:math:`\hat\theta`, and, with :math:`\lVert\theta-\hat\theta\rVert = O(N^{-1/2})` across the posterior, :math:`O(N/B)`
where the plain estimate's is :math:`O(N^2/B)`. The value's own noise is second order in
:math:`\theta-\hat\theta`.

:class:`ControlledLogPosterior` is this estimate as an engine's ``log_posterior_fn``: every kernel, warm-up (its
curvature is that of :math:`\ell_{\mathcal{B}}`, the linear term having none) and the per-example noise estimate
(whose single-example terms :math:`g_i(\theta) - g_i(\hat\theta) + \nabla\ell(\hat\theta)` have the spread above) use
it unchanged, so the noise correction and warm-up's step size see the reduced noise. A step evaluates the model
twice (at :math:`\theta` and :math:`\hat\theta`, on the same minibatch).

**The centre.** ``control_variate="map"`` finds :math:`\hat\theta` by
:func:`~pyro_scalable.infer.mode_search.find_mode`: L-BFGS on a subsample, then on full-data passes until the next
step would be under 0.01 posterior standard deviations, whose last pass gives :math:`\ell(\hat\theta)` and
:math:`\nabla\ell(\hat\theta)`; ``"warmup"`` centres it at the mean of each of warm-up's metric windows in turn (the
posterior's bulk, where a hierarchy's joint mode is not; :mod:`.control_choice`); a dict of constrained values, or a
trained guide (its ``median()``), is used as given. Far from :math:`\hat\theta` (another mode of a multimodal
posterior) the estimate stays unbiased but its noise grows with :math:`\lVert\theta-\hat\theta\rVert^2`; the noise
estimate sees that, so the draws stay calibrated, only the steps get smaller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_sample
from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.bridge.observed import no_mode_reason
from pyro_scalable.infer.mode_search import (
    ControlVariate,
    ModeSearch,
    find_mode,
    full_data_gradient,
)
from pyro_scalable.infer.mode_search import point_gradient_and_value as _gradient_and_value
from pyro_scalable.infer.sgmcmc.chains import gradient_and_value, index_dims

__all__ = [
    "CentreError",
    "ControlVariate",
    "ModeSearch",
    "ControlledLogPosterior",
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


class ControlledLogPosterior:
    """The controlled minibatch log joint (module docstring) as an engine's ``log_posterior_fn``.

    Wraps the bridge's ``log_posterior_fn`` (``inner``) and offers its ``examples`` split and ``replacement`` flag.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.arange(20.0),))
        >>> control = full_data_gradient(bridge, {"mu": torch.tensor(9.5)})
        >>> batch = Batch({"data": torch.tensor([0, 1, 2, 3, 4])}, bridge.args, {})
        >>> controlled = ControlledLogPosterior(bridge.log_posterior_fn, control)
        >>> exact = bridge.log_posterior({"mu": torch.tensor(9.5)}, bridge.full_batch())
        >>> bool(torch.isclose(controlled({"mu": torch.tensor(9.5)}, batch), exact))  # exact at the centre
        True

    """

    def __init__(self, inner: Callable, control: ControlVariate | None):
        self.inner = inner
        self.control = control  # None: the plain estimate (a warm-up centre not chosen yet)
        self.active = True  # False: the plain estimate (burn-in, for a centre warm-up chooses)

    @property
    def replacement(self) -> bool:
        return getattr(self.inner, "replacement", False)

    @replacement.setter
    def replacement(self, value: bool) -> None:
        self.inner.replacement = value

    def examples(self, batch: Batch):
        """The wrapped log posterior's per-example split of ``batch`` (see ``LogPosterior.examples``)."""
        split = getattr(self.inner, "examples", None)
        return None if split is None else split(batch)

    def __call__(self, latents: Latents, batch: Batch) -> Tensor:
        if self.control is None or not self.active:
            return self.inner(latents, batch)
        return self._controlled(self.inner, self.control.gradient, self.control.log_joint, latents, batch)

    @property
    def terms(self) -> tuple[Callable, Callable] | None:
        """The wrapped log posterior's ``terms`` (prior's, data's), each controlled with its own share of the centre.

        The prior's terms take the full-data value and gradient at the centre, the data's none; the two sum to the
        controlled estimate. ``None`` where the wrapped one has no ``terms``.
        """
        inner = getattr(self.inner, "terms", None)
        if inner is None or self.control is None or not self.active:
            return inner
        shared, grouped = inner
        control = self.control
        return (
            lambda latents, batch: self._controlled(shared, control.gradient, control.log_joint, latents, batch),
            lambda latents, batch: self._controlled(grouped, None, None, latents, batch),
        )

    def _controlled(self, fn: Callable, anchor: Latents | None, offset: Tensor | None, latents: Latents, batch: Batch):
        """``fn(θ) - fn(θ̂) + offset + <anchor - ∇fn(θ̂), θ - θ̂>`` on ``batch`` (θ̂ the centre; ``None``: 0)."""
        centre = self.control.centre
        at_centre, value_at_centre = _gradient_and_value(fn, centre, batch)
        value = fn(latents, batch) - value_at_centre
        if offset is not None:
            value = value + offset
        for name, x in latents.items():
            slope = at_centre[name] if anchor is None else at_centre[name] - anchor[name]
            value = value - (slope * (x - centre[name])).sum()
        return value

    def batched_gradient(self, latents: Latents, batch: Batch) -> tuple[Latents, Tensor]:
        """Every chain's controlled gradient and value (``latents`` with a leading chain dimension).

        The chains at θ and at the centre, each on its chain's minibatch, are one vmapped density of 2C chains and
        one backward pass (:func:`~.chains.gradient_and_value`): the centre's minibatch gradient is not a gradient
        transform nested in the chains' vmap, as in :meth:`__call__`.

        Example:
            >>> import pyro, pyro.distributions as dist, torch
            >>> from pyro_scalable.bridge import ModelBridge
            >>> def model(y):
            ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
            ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
            ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
            >>> bridge = ModelBridge(model, (torch.arange(20.0),))
            >>> controlled = ControlledLogPosterior(
            ...     bridge.log_posterior_fn, full_data_gradient(bridge, {"mu": torch.tensor(9.5)}))
            >>> minibatches = Batch({"data": torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])}, bridge.args, {})
            >>> grads, values = controlled.batched_gradient({"mu": torch.tensor([8.0, 9.5])}, minibatches)
            >>> exact = bridge.log_posterior({"mu": torch.tensor(9.5)}, bridge.full_batch())
            >>> bool(torch.isclose(values[1], exact))  # the chain at the centre: exact, whatever its minibatch
            True

        """
        if self.control is None or not self.active:
            return gradient_and_value(self.inner, latents, batch)
        centre, full_gradient, full_value = self.control
        chains = next(iter(latents.values())).shape[0]
        both = {name: torch.cat([x, centre[name].expand_as(x)]) for name, x in latents.items()}
        dims = index_dims(batch.indices)
        doubled = {name: torch.cat([idx, idx]) if dims[name] == 0 else idx for name, idx in batch.indices.items()}
        grads, values = gradient_and_value(self.inner, both, Batch(doubled, batch.args, batch.kwargs))
        value = values[:chains] - values[chains:] + full_value
        controlled = {}
        for name, x in latents.items():
            correction = full_gradient[name] - grads[name][chains:]
            controlled[name] = grads[name][:chains] + correction
            value = value + (correction * (x - centre[name])).reshape(chains, -1).sum(1)
        return controlled, value


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
    fan-in-scaled priors, ``init_to_uniform``'s ±2 in every weight saturates the units and the search took 180
    full-data passes where it took 17 from a prior draw (the 90,701-weight MLP of
    ``benchmarks/diagnose_control_variate_size.py``; 81 against 14 with 3,651 weights). The search draws its
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
