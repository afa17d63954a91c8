r"""BAOAB Langevin splitting with stochastic gradients and a temperature (Leimkuhler & Matthews, 2013).

Momentum :math:`p`, diagonal mass :math:`m`, friction :math:`\gamma`, step size :math:`\epsilon`, temperature
:math:`T`, minibatch gradient :math:`\hat g` of the log joint, :math:`c = e^{-\gamma\epsilon}` and
:math:`\zeta \sim \mathcal{N}(0, I)`. One step is five sub-steps:

.. math::

    \text{B: } p \leftarrow p + \tfrac{\epsilon}{2}\hat g(\theta), \quad
    \text{A: } \theta \leftarrow \theta + \tfrac{\epsilon}{2} p / m, \quad
    \text{O: } p \leftarrow c\,p + \sqrt{(1 - c^2)\,T m}\;\zeta, \quad
    \text{A}, \quad \text{B}.

O is the exact solution of the Ornstein–Uhlenbeck part, so any :math:`\gamma\epsilon` is allowed. On a Gaussian
:math:`\mathcal{N}(0, \sigma^2)` with exact gradients the :math:`\theta`-marginal is exactly :math:`T\sigma^2` for
every stable step (:math:`\epsilon < 2\sigma\sqrt m`), and so is the stored momentum's (after O) :math:`Tm`.

**One gradient per step.** Step :math:`t`'s closing B and step :math:`t+1`'s opening B are both at
:math:`\theta_{t+1}`: the state stores :math:`\theta_t` and :math:`\tilde p_t`, the momentum still owed its closing
half-kick, and :func:`update` applies the two half-kicks together with one :math:`\hat g(\theta_t)`:

.. math::

    p' = \tilde p_t + \tfrac{\epsilon_{t-1} + \epsilon_t}{2}\,\hat g(\theta_t), \quad
    \theta' = \theta_t + \tfrac{\epsilon_t}{2} p'/m, \quad
    \tilde p_{t+1} = c\,p' + \sqrt{(1 - c^2) T m}\,\zeta_t, \quad
    \theta_{t+1} = \theta' + \tfrac{\epsilon_t}{2}\tilde p_{t+1}/m .

These are BAOAB's :math:`(\theta_t, p_t)` with :math:`p_t = \tilde p_t + \tfrac{\epsilon_{t-1}}{2}\hat g(\theta_t)`:
:math:`p'` is step :math:`t`'s opening B, :math:`\theta'` its first A, :math:`\tilde p_{t+1}` its O and
:math:`\theta_{t+1}` its second A; its closing B is the next step's :math:`p_{t+1}` by definition (induction on
:math:`t`; both B's at :math:`\theta_{t+1}` use one minibatch gradient). A chain starts, and a diverging step
restarts, from :math:`\tilde p = 0` with :math:`\epsilon_{-1} = \epsilon_0`.

At T = 0 BAOAB is ``torch.optim.SGD`` with momentum (:mod:`.sgd_limit`).

**Gradient noise.** The two half-kicks bring :math:`\epsilon^2 V` into :math:`p'`, of which :math:`c^2\epsilon^2 V`
survives O. With ``gradient_noise="correct"`` O's fresh noise is :math:`(1 - c^2) T m_j - c^2 \epsilon^2 \hat V_j`
per coordinate, floored at 0: the stored momentum's variance is then right, up to the noise's direct effect on
:math:`\theta` through the first A, of order :math:`\epsilon^4\hat V/m^2`.

**Warm-up** (:mod:`.tuning`, ``"baoab"``) chooses :math:`\epsilon \le 0.5/\sqrt\lambda` and keeps the kicks' noise
within half of O's (:func:`~.tuning.baoab_step_size`). A given ``friction`` may be one per coordinate (a dict of
tensors by site): O stays exact coordinate by coordinate.
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
from pyro_scalable.infer.sgmcmc.mass import Mass, check_mass, mass_like
from pyro_scalable.infer.sgmcmc.sgd_limit import baoab_hyperparameters as sgd_hyperparameters

__all__ = ["BAOAB", "BAOABInfo", "BAOABState", "build", "init", "sgd_hyperparameters", "step", "update"]

BAOABInfo = extended_info("BAOABInfo", "friction")


class BAOABState(NamedTuple):
    """Everything the next BAOAB step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # after the last O: still owed the closing half-kick at ``latents`` (see the module)
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64
    previous_step_size: Tensor  # 0-d ε of the last step, whose closing half-kick is owed (NaN: none, use ε)


def init(latents: Latents, momenta: Latents | None = None) -> BAOABState:
    """Start a chain at ``latents``; ``momenta`` (zero by default) are owed their first half-kick."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    owed = torch.full((), math.nan, dtype=first.dtype, device=first.device)
    return BAOABState(dict(latents), dict(momenta), dict(latents), zero, owed)


def update(
    state: BAOABState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor | Latents = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[BAOABState, BAOABInfo]:
    """Move one chain by one BAOAB step with ``gradient`` (its noise: the variance to correct); friction: per site."""
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    masses = mass_like(mass, state.latents)
    owed = state.previous_step_size
    kick = 0.5 * (torch.where(torch.isnan(owed), step_size_now, owed) + step_size_now)
    if isinstance(friction, dict):  # one per coordinate, where given; the Info shows the largest
        decay = {name: torch.exp(-f * step_size_now) for name, f in friction.items()}
        friction = torch.stack([f.max() for f in friction.values()]).max()
        surviving = {name: (d * kick) ** 2 for name, d in decay.items()}.__getitem__  # the kicks' noise O leaves
    else:
        friction = scalar_like(friction, step_size_now)
        shared = torch.exp(-friction * step_size_now)
        decay, surviving = dict.fromkeys(state.latents, shared), (shared * kick) ** 2
    wanted = {name: (1.0 - decay[name] ** 2) * temperature_now * m for name, m in masses.items()}
    variance, noise_ratio, uncorrected = injected_noise(wanted, gradient, surviving, state.latents)
    noise = gaussian_like(state.latents, generator, temperature)
    kicked = integrators.kick(state.momenta, gradient.grads, kick)
    momenta = integrators.ornstein_uhlenbeck(kicked, decay, variance, noise)
    proposal = integrators.baoab_position(state.latents, kicked, momenta, step_size_now, masses)
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    momenta = zero_where_diverging(diverging, momenta)
    owed = torch.where(diverging, torch.full_like(kick, math.nan), step_size_now + torch.zeros_like(kick))
    info = BAOABInfo(*shared_info(gradient, step_size_now, temperature_now, noise_ratio, uncorrected), friction)
    return BAOABState(latents, momenta, previous, state.step_count + 1, owed), info


step = functional_step(update)
build = builder(init, update)


class BAOAB(MomentumKernel):
    """BAOAB for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`update`.

    At ``temperature=0`` it is ``torch.optim.SGD`` with momentum (:func:`~.sgd_limit.baoab_hyperparameters`).

    ``model``, ``gradient_noise``, ``control_variate`` and ``init_strategy`` are as for :class:`~.sgld.SGLD`.

    Args:
        step_size: ε, a constant or a schedule; ``None`` (the default) chooses it in warm-up.
        friction: γ > 0, any size (the O step is exact). ``None`` (the default) is 1.0 with a given step size,
            and chosen in warm-up with the step size otherwise.
        mass: the diagonal mass: a positive scalar, or a dict of positive tensors by site.
        temperature: T; 1 is Bayes, 0 is SGD with momentum. A constant or a schedule.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import BAOAB, StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> mcmc = StochasticMCMC(BAOAB(model, step_size=0.01, friction=10.0), num_samples=200,
        ...                       num_warmup=200, num_chains=2, progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)
        StochasticMCMC(BAOAB, 2 chains x 200 draws)
        >>> mcmc.get_samples(group_by_chain=True)["mu"].shape
        torch.Size([2, 200])

    """

    build = staticmethod(build)
    warmup_rule = "baoab"

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None = None,
        friction: float | None = None,
        mass: Mass = 1.0,
        temperature: ScalarOrSchedule = 1.0,
        *,
        gradient_noise: str | None = None,
        control_variate: Any = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        super().__init__(model, step_size, temperature, gradient_noise, control_variate, init_strategy)
        check_mass(mass)
        self.friction = self.check_friction(friction, step_size, least_mass=None)  # O is exact: any friction
        self.mass = mass

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        names = ("step_size", "friction", "mass", "temperature")
        return {name: getattr(self, name) for name in names}
