r"""Stochastic-gradient Nosé–Hoover thermostat with a temperature (Ding et al., 2014; posteriors paper App. B.3).

Momentum :math:`p` (unit mass), a thermostat :math:`\xi` (one scalar per chain), step size :math:`\epsilon`,
injected-noise level :math:`A` (``friction``), temperature :math:`T`, minibatch gradient :math:`\hat g` of the
log joint over :math:`d` coordinates (all sites together) and :math:`\zeta \sim \mathcal{N}(0, I)`:

.. math::

    p_{t+1} &= p_t + \epsilon\,\hat g(\theta_t) - \epsilon\,\xi_t\,p_t + \sqrt{2 A \epsilon T}\;\zeta_t, \\
    \theta_{t+1} &= \theta_t + \epsilon\,p_{t+1}, \\
    \xi_{t+1} &= \xi_t + \epsilon\,\big(p_{t+1}^\top p_{t+1} / d - T\big).

In continuous time the stationary law is :math:`\pi_T(\theta)\,\mathcal{N}(p; 0, T I)\,\mathcal{N}(\xi; A, T/d)`:
the thermostat is a friction that moves until the kinetic temperature :math:`p^\top p / d` equals :math:`T`, so
with exact gradients it settles at :math:`E[\xi] = A`. A gradient whose noise adds :math:`\epsilon^2 V` per step
raises it to about :math:`A + \epsilon\,\bar V / (2T)` (:math:`\bar V` the mean over coordinates) and the draws
stay calibrated without knowing :math:`V` — that is the point of the thermostat. At :math:`\xi` frozen the step
is SGHMC's (:mod:`.sghmc`, unit mass) with friction :math:`\xi`.

**One thermostat per chain**, as in Ding et al.: a scalar :math:`\xi` averages the kinetic energy of all :math:`d`
coordinates and fluctuates by :math:`\sqrt{T/d}`; one per site of a few coordinates would wander (even negative). It
absorbs the *mean* gradient noise; ``gradient_noise="correct"`` subtracts the rest, :math:`\epsilon^2 \hat V_j`
per coordinate, from the injected :math:`2A\epsilon T` (floored at 0), as SGHMC does. The thermostat relaxes at a
rate of about :math:`T/A` per unit time: choose :math:`A` of order :math:`\sqrt{T}` over the time scale of interest.

**No T = 0 limit**: there :math:`\xi` only grows until :math:`\epsilon\xi > 2` and the momentum diverges, so
``temperature=0`` raises (posteriors paper App. C); use :mod:`.sghmc` or :mod:`.baoab` as optimisers.

**Warm-up** (:mod:`.tuning`, ``"thermostat"``): SGHMC's rule at unit mass, and every warm-up step holds
:math:`\xi` at :math:`A` (the ``thermostat`` argument of :func:`update`): a chain falling into the posterior turns the
energy it loses into kinetic energy far above :math:`T`, which a free thermostat would store and forget only slowly
(draws too narrow by about :math:`A/\xi`). Without warm-up, start the chains near the posterior or make :math:`A`
small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.schedules import ScalarOrSchedule, resolve
from pyro_scalable.infer.sgmcmc import integrators
from pyro_scalable.infer.sgmcmc.base import (
    Latents,
    builder,
    extended_info,
    functional_step,
    gaussian_like,
    injected_noise,
    scalar_like,
    shared_info,
)
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite, zero_where_diverging
from pyro_scalable.infer.sgmcmc.kernel import MomentumKernel

__all__ = ["SGNHT", "SGNHTInfo", "SGNHTState", "build", "init", "step", "update"]

SGNHTInfo = extended_info("SGNHTInfo", "thermostat", "friction")  # the thermostat after the step, and A


class SGNHTState(NamedTuple):
    """Everything the next SGNHT step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # same keys and shapes as latents (unit mass)
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64
    thermostat: Tensor  # 0-d ξ, one per chain (NaN until warm-up chooses the friction it starts at)


def init(
    latents: Latents,
    momenta: Latents | None = None,
    *,
    friction: float | None = 1.0,
    thermostat: float | None = None,
) -> SGNHTState:
    """Start a chain at ``latents`` with zero momenta (or the given ones) and the thermostat at ``friction``."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    start = thermostat if thermostat is not None else math.nan if friction is None else friction
    xi = torch.full((), float(start), dtype=first.dtype, device=first.device)
    return SGNHTState(dict(latents), dict(momenta), dict(latents), zero, xi)


def update(
    state: SGNHTState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    thermostat: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[SGNHTState, SGNHTInfo]:
    """Move one chain by one SGNHT step with the gradient ``gradient`` (its noise, if any, the variance to correct).

    ``thermostat``: where given, ξ is held there for this step (warm-up holds it at the friction it chose).
    """
    _refuse_zero_temperature(temperature)
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    friction = scalar_like(friction, step_size_now)
    xi = state.thermostat if thermostat is None else thermostat + torch.zeros_like(state.thermostat)
    wanted = 2.0 * friction * step_size_now * temperature_now
    variance, noise_ratio, uncorrected = injected_noise(wanted, gradient, step_size_now**2, state.latents)
    noise = gaussian_like(state.latents, generator, temperature)
    decay = 1.0 - step_size_now * xi
    momenta = integrators.momentum(state.momenta, gradient.grads, step_size_now, decay, variance, noise)
    proposal = integrators.drift(state.latents, momenta, step_size_now)
    diverging = gradient.diverging
    xi_next = torch.where(diverging, xi, integrators.thermostat(xi, momenta, step_size_now, temperature_now))
    latents, previous = (keep_where_finite(diverging, x, state.checked_latents) for x in (proposal, state.latents))
    momenta = zero_where_diverging(diverging, momenta)
    shared = shared_info(gradient, step_size_now, temperature_now, noise_ratio, uncorrected)
    info = SGNHTInfo(*shared, xi_next, friction)
    return SGNHTState(latents, momenta, previous, state.step_count + 1, xi_next), info


def _refuse_zero_temperature(temperature: ScalarOrSchedule) -> None:
    if not callable(temperature) and float(temperature) == 0.0:
        raise ValueError(
            "SGNHT has no temperature-0 limit: its thermostat only grows at T = 0 and the dynamics diverge. "
            "Use SGHMC or BAOAB (SGD with momentum at T = 0), or a positive temperature."
        )


step = functional_step(update)


build = builder(init, update, init_keywords=("friction",))  # the thermostat starts at the friction


class SGNHT(MomentumKernel):
    """SGNHT for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`update`.

    The thermostat tunes the friction itself (to ``friction`` with exact gradients, higher with noisy ones), so
    the draws are less sensitive to an unknown gradient noise than SGHMC's. There is no T = 0 limit (see the
    module docstring): ``temperature`` must be positive.

    ``model``, ``gradient_noise``, ``control_variate`` and ``init_strategy`` are as for :class:`~.sgld.SGLD`.

    Args:
        step_size: ε, a constant or a schedule; ``None`` (the default) chooses it in warm-up.
        friction: A > 0, the injected-noise level and the thermostat's start; ``step_size * friction`` must be
            below 1. ``None`` (the default) is 1.0 with a given step size, and chosen in warm-up otherwise.
        temperature: T > 0 (1 is Bayes). A constant or a schedule.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import SGNHT, StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> mcmc = StochasticMCMC(SGNHT(model, step_size=0.01, friction=10.0), num_samples=200,
        ...                       num_warmup=200, num_chains=2, progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)
        StochasticMCMC(SGNHT, 2 chains x 200 draws)
        >>> mcmc.get_samples(group_by_chain=True)["mu"].shape
        torch.Size([2, 200])
        >>> mcmc.sample_stats["thermostat"].shape
        torch.Size([2, 200])

    """

    build = staticmethod(build)
    warmup_rule = "thermostat"

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None = None,
        friction: float | None = None,
        temperature: ScalarOrSchedule = 1.0,
        *,
        gradient_noise: str | None = None,
        control_variate: Any = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        super().__init__(model, step_size, temperature, gradient_noise, control_variate, init_strategy)
        _refuse_zero_temperature(temperature)
        self.friction = self.check_friction(friction, step_size, least_mass=1.0)  # unit mass

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        return {name: getattr(self, name) for name in ("step_size", "friction", "temperature")}
