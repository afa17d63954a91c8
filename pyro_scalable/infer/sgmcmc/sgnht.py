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

**One thermostat per chain**, not per site, as in Ding et al.: their invariance argument is for a scalar
:math:`\xi`, which averages the kinetic energy of all :math:`d` coordinates and so fluctuates by only
:math:`\sqrt{T/d}`; a thermostat for a site of one or two coordinates would fluctuate by :math:`O(\sqrt T)`
and let that site's friction wander (even negative). The price: a scalar thermostat absorbs the *mean* gradient
noise, not noise that differs between coordinates — for that, ``gradient_noise="correct"`` subtracts the
estimated :math:`\epsilon^2 \hat V_j` (moving average, as SGLD's) from the injected :math:`2A\epsilon T` per
coordinate, floored at 0, as
SGHMC does. Note that with a large :math:`A` the thermostat is slow: it relaxes at a rate of about
:math:`T/A` per unit time (:math:`\epsilon` per step), so choose :math:`A` of order :math:`\sqrt{T}` times the
inverse time scale of interest, not SGHMC's large frictions.

**No T = 0 limit.** At :math:`T = 0` the thermostat update is :math:`\xi \mathrel{+}= \epsilon\,p^\top p/d \ge 0`:
:math:`\xi` only grows, the dynamics are driven to zero kinetic energy and then, once :math:`\epsilon\xi > 2`,
the momentum diverges. SGNHT is not an optimiser (posteriors paper App. C); ``temperature=0`` raises a
``ValueError`` (a schedule is not checked: keep it positive). Use :mod:`.sghmc` or :mod:`.baoab` at
:math:`T = 0`.

**Warm-up.** ``step_size=None`` chooses :math:`\epsilon \le 0.3/\sqrt\lambda` (SGHMC's curvature bound) and
:math:`\epsilon A \le 1/2`; a given friction also bounds :math:`\epsilon \le 2AT\rho/\bar V_{\max}` (gradient
noise at most :math:`\rho = 1/2` of the injected noise). Where the friction is left to warm-up too it is
chosen as SGHMC's, :math:`A = \max(\epsilon\bar V_{\max}/(2T\rho),\ 0.1/\epsilon)`. Every warm-up step holds
the thermostat at :math:`A`: a chain falling from its initial point into the posterior converts the energy it
loses into kinetic energy far above :math:`T`, which a free thermostat would store (with :math:`\xi \gg A`,
the draws come out too narrow by about :math:`A/\xi`) and forget only at the slow rate above. With a given
step size there is no warm-up adaptation, so start the chains near the posterior (e.g. from a MAP) or make
:math:`A` small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.bridge.model import FullDataModel
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive, resolve
from pyro_scalable.infer.sgmcmc import integrators
from pyro_scalable.infer.sgmcmc.base import (
    GradientEstimate,
    Kernel,
    Latents,
    LogPosteriorFn,
    check_gradient_noise,
    estimate,
    extended_info,
    gaussian_like,
    injected_variance,
    noise_in_step,
    noise_start,
    scalar_like,
)
from pyro_scalable.infer.sgmcmc.control_variates import check_control_variate
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite, zero_where_diverging

__all__ = ["SGNHT", "SGNHTInfo", "SGNHTState", "estimate", "init", "step", "update"]

SGNHTInfo = extended_info("SGNHTInfo", "thermostat", "friction")  # the thermostat after the step, and A


class SGNHTState(NamedTuple):
    """Everything the next SGNHT step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # same keys and shapes as latents (unit mass)
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64
    thermostat: Tensor  # 0-d ξ, one per chain (NaN until warm-up chooses the friction it starts at)
    noise_average: Latents  # moving average of the gradient-noise variance ({} where it is not estimated)


def init(
    latents: Latents,
    momenta: Latents | None = None,
    *,
    friction: float | None = 1.0,
    thermostat: float | None = None,
    gradient_noise: str = "ignore",
) -> SGNHTState:
    """Start a chain at ``latents`` with zero momenta (or the given ones) and the thermostat at ``friction``."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    start = thermostat if thermostat is not None else math.nan if friction is None else friction
    xi = torch.full((), float(start), dtype=first.dtype, device=first.device)
    return SGNHTState(dict(latents), dict(momenta), dict(latents), zero, xi, noise_start(latents, gradient_noise))


def update(
    state: SGNHTState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    noise_every: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[SGNHTState, SGNHTInfo]:
    """Move one chain by one SGNHT step with the gradient ``gradient`` (from :func:`estimate`)."""
    _refuse_zero_temperature(temperature)
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    friction = scalar_like(friction, step_size_now)
    xi = state.thermostat
    noise_average, gradient_variance = noise_in_step(state, gradient, gradient_noise, step_size_now**2, noise_every)
    variance, noise_ratio, uncorrected = injected_variance(
        2.0 * friction * step_size_now * temperature_now,
        gradient_variance,
        gradient_noise == "correct",
        state.latents,
    )
    noise = gaussian_like(state.latents, generator, temperature)
    momenta = integrators.momentum(
        state.momenta, gradient.grads, step_size_now, 1.0 - step_size_now * xi, variance, noise
    )
    proposal = integrators.drift(state.latents, momenta, step_size_now)
    diverging = gradient.diverging
    thermostat = torch.where(diverging, xi, integrators.thermostat(xi, momenta, step_size_now, temperature_now))
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    momenta = zero_where_diverging(diverging, momenta)
    info = SGNHTInfo(
        gradient.log_posterior,
        gradient.grad_norm,
        step_size_now,
        temperature_now,
        diverging,
        noise_ratio,
        uncorrected,
        thermostat,
        friction,
    )
    return SGNHTState(latents, momenta, previous, state.step_count + 1, thermostat, noise_average), info


def _refuse_zero_temperature(temperature: ScalarOrSchedule) -> None:
    if not callable(temperature) and float(temperature) == 0.0:
        raise ValueError(
            "SGNHT has no temperature-0 limit: its thermostat only grows at T = 0 and the dynamics diverge. "
            "Use SGHMC or BAOAB (SGD with momentum at T = 0), or a positive temperature."
        )


def step(
    state: SGNHTState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    generator: torch.Generator | None = None,
) -> tuple[SGNHTState, SGNHTInfo]:
    """Advance one chain by one SGNHT step on ``batch`` (:func:`estimate` then :func:`update`).

    The thermostat starts where :func:`init` put it (at its ``friction`` by default), whatever ``friction`` is here.
    """
    gradient = estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise)
    return update(
        state,
        gradient,
        step_size=step_size,
        friction=friction,
        temperature=temperature,
        gradient_noise=gradient_noise,
        generator=generator,
    )


class SGNHT(Kernel):
    """SGNHT for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`step`.

    The thermostat tunes the friction itself (to ``friction`` with exact gradients, higher with noisy ones), so
    the draws are less sensitive to an unknown gradient noise than SGHMC's. There is no T = 0 limit (see the
    module docstring): ``temperature`` must be positive.

    Args:
        model: a Pyro model whose likelihood sits in a subsampled ``pyro.plate``; kept as ``self.model``, a
            :class:`~pyro_scalable.bridge.FullDataModel` (the same model on the full data).
        step_size: ε, a constant or a schedule (:mod:`pyro_scalable.infer.schedules`); ``None`` (the default)
            chooses it in warm-up from the curvature and the gradient noise (needs ``num_warmup`` > 0).
        friction: A > 0, the injected-noise level and the thermostat's start; ``step_size * friction`` must be
            below 1. ``None`` (the default) is 1.0 with a given step size, and chosen in warm-up otherwise.
        temperature: T > 0 (1 is Bayes). A constant or a schedule.
        gradient_noise: ``"correct"``, ``"estimate"`` or ``"ignore"``, as for :class:`~.sgld.SGLD` (default:
            ``"correct"`` when the step size is left to warm-up, else ``"ignore"``).
        control_variate: the centre of a control-variate gradient (:mod:`.control_variates`): ``"map"`` (found
            before the run), ``"warmup"`` (each of warm-up's metric windows' mean in turn), a dict of latent values
            by site, or a trained autoguide; ``None``: plain minibatch gradients; ``"auto"`` (the default): ``"map"``
            where warm-up chooses the step and ``N/B ≥ 10``, ``"warmup"`` for a hierarchy at ``N/B ≥ 4``
            (:func:`~pyro_scalable.infer.sgmcmc.control_choice.choose`).
        init_strategy: a Pyro init strategy, one draw per chain.

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

    update_rule = staticmethod(update)
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
        if step_size is not None:
            check_positive("step_size", step_size)
            friction = 1.0 if friction is None else friction
        if friction is not None:
            check_positive("friction", friction)
        check_positive("temperature", temperature, allow_zero=True)
        _refuse_zero_temperature(temperature)
        if step_size is not None:
            largest = float(step_size(torch.zeros(())) if callable(step_size) else step_size)  # schedules start highest
            if largest * friction >= 1.0:
                raise ValueError(
                    f"step_size * friction must be below 1 (got {largest * friction:.3g}): the momentum would "
                    "change sign every step. Lower the step size or the friction."
                )
        self.model = FullDataModel(model)
        self.step_size = step_size
        self.friction = friction
        self.temperature = temperature
        self.gradient_noise = check_gradient_noise(gradient_noise, step_size)
        self.control_variate = check_control_variate(control_variate)
        self.init_strategy = init_strategy

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something (here: the step size, and the friction if not given)."""
        return self.step_size is None

    def init(self, latents: Latents) -> SGNHTState:
        """Start a chain at unconstrained ``latents`` with zero momenta and the thermostat at the friction."""
        return init(latents, friction=self.friction, gradient_noise=self.gradient_noise)

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        return {
            "step_size": self.step_size,
            "friction": self.friction,
            "temperature": self.temperature,
            "gradient_noise": self.gradient_noise,
        }

    def __repr__(self) -> str:
        return (
            f"SGNHT(step_size={self.step_size!r}, friction={self.friction!r}, "
            f"temperature={self.temperature!r}, gradient_noise={self.gradient_noise!r})"
        )
