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
target :math:`\mathcal{N}(0, \sigma^2)` with exact gradients the :math:`\theta`-marginal of the stationary law is
exactly :math:`T\sigma^2` for every stable step (:math:`\epsilon < 2\sigma\sqrt m`); the momentum after a full
step has variance :math:`Tm\,(1 - \epsilon^2/(4m\sigma^2))`, and the momentum this module stores (after O, see
below) exactly :math:`Tm`. For other targets configurational averages are second order in :math:`\epsilon`.

**One gradient per step.** Step :math:`t`'s closing B and step :math:`t+1`'s opening B are both at
:math:`\theta_{t+1}`. The state therefore stores :math:`\theta_t` and :math:`\tilde p_t`, the momentum after
the previous step's O (and A), still owed its closing half-kick; :func:`update` computes
:math:`\hat g(\theta_t)` once and applies the two half-kicks together:

.. math::

    p' = \tilde p_t + \tfrac{\epsilon_{t-1} + \epsilon_t}{2}\,\hat g(\theta_t), \quad
    \theta' = \theta_t + \tfrac{\epsilon_t}{2} p'/m, \quad
    \tilde p_{t+1} = c\,p' + \sqrt{(1 - c^2) T m}\,\zeta_t, \quad
    \theta_{t+1} = \theta' + \tfrac{\epsilon_t}{2}\tilde p_{t+1}/m .

*Proof that the recorded* :math:`\theta` *are BAOAB's.* Let :math:`p_t = \tilde p_t + \tfrac{\epsilon_{t-1}}{2}
\hat g(\theta_t)` (the closing B of step :math:`t-1`). Then :math:`p' = p_t + \tfrac{\epsilon_t}{2}\hat g
(\theta_t)` is step :math:`t`'s opening B, :math:`\theta'` its first A, :math:`\tilde p_{t+1}` its O,
:math:`\theta_{t+1}` its second A, and its closing B, :math:`p_{t+1} = \tilde p_{t+1} + \tfrac{\epsilon_t}{2}
\hat g(\theta_{t+1})`, is by definition the :math:`p_{t+1}` of the next step: by induction
:math:`(\theta_t, p_t)` is the BAOAB chain for every :math:`t`, the B's at :math:`\theta_{t+1}` using one and the
same minibatch gradient. The chain starts at :math:`\tilde p_0` (zero by default) with :math:`\epsilon_{-1} =
\epsilon_0`: BAOAB from :math:`p_0 = \tilde p_0 + \tfrac{\epsilon_0}{2}\hat g(\theta_0)`. A diverging step resets
:math:`\tilde p` to 0 and starts afresh in the same way.

**T = 0 is SGD with momentum.** O becomes :math:`p \leftarrow c\,p`. Writing :math:`b_t = -p'_t/\epsilon`
(:math:`p'_t` the momentum after step :math:`t`'s kick), a constant step gives
:math:`b_t = c\,b_{t-1} + \nabla(-\log p)(\theta_t)` and :math:`\theta_{t+1} = \theta_t - \tfrac{\epsilon^2(1 + c)}
{2m} b_t` — exactly ``torch.optim.SGD(lr=η, momentum=μ)`` from a zero momentum buffer, with

.. math::

    \eta = \frac{\epsilon^2 (1 + c)}{2m}, \quad \mu = c = e^{-\gamma\epsilon}
    \qquad\Longleftrightarrow\qquad
    \epsilon = \sqrt{\frac{2 m \eta}{1 + \mu}}, \quad \gamma = -\frac{\ln\mu}{\epsilon}

(:func:`sgd_hyperparameters`; :math:`0 < \mu < 1`).

**Gradient noise.** The two half-kicks bring :math:`\epsilon^2 V` into :math:`p'`, of which :math:`c^2\epsilon^2
V` survives O (to first order in :math:`\gamma\epsilon`, :math:`\epsilon^2 V`). With ``gradient_noise="correct"``
O's fresh noise is :math:`(1 - c^2) T m_j - c^2 \epsilon^2 \hat V_j` per coordinate, floored at 0 (diagonal,
the moving average of the per-minibatch estimates, as SGLD's): the stored momentum's variance is then right; what
the approximation
leaves is the gradient noise's direct effect on :math:`\theta` through the first A, of order
:math:`\epsilon^4\hat V/m^2`.

**Warm-up.** ``step_size=None`` chooses :math:`\epsilon \le 0.5/\sqrt\lambda` (:math:`\lambda` the largest
curvature in the mass metric) and, with a given friction, a step small enough that the kicks' noise is at most
:math:`\rho = 1/2` of O's (using :math:`1 - c^2 \ge 2\gamma\epsilon/(1 + 2\gamma\epsilon)`); where the friction is
left to warm-up, :math:`\epsilon^2 \bar V_{\max}/m \le 3\rho T` and :math:`c` is the largest value up to 0.9 for
which the noise bound holds (:mod:`.adaptation`). A given ``friction`` may be one per coordinate (a dict of tensors
by site): O stays exact coordinate by coordinate, and the :math:`\theta`-marginal stays exact on a Gaussian,
correlated or not (``tests/infer/sgmcmc/test_baoab.py``).
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
from pyro_scalable.infer.sgmcmc.mass import Mass, check_mass, mass_like

__all__ = ["BAOAB", "BAOABInfo", "BAOABState", "estimate", "init", "sgd_hyperparameters", "step", "update"]

BAOABInfo = extended_info("BAOABInfo", "friction")


class BAOABState(NamedTuple):
    """Everything the next BAOAB step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # after the last O: still owed the closing half-kick at ``latents`` (see the module)
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64
    previous_step_size: Tensor  # 0-d ε of the last step, whose closing half-kick is owed (NaN: none, use ε)
    noise_average: Latents  # moving average of the gradient-noise variance ({} where it is not estimated)


def init(latents: Latents, momenta: Latents | None = None, *, gradient_noise: str = "ignore") -> BAOABState:
    """Start a chain at ``latents``; ``momenta`` (zero by default) are owed their first half-kick."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    owed = torch.full((), math.nan, dtype=first.dtype, device=first.device)
    return BAOABState(dict(latents), dict(momenta), dict(latents), zero, owed, noise_start(latents, gradient_noise))


def update(
    state: BAOABState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor | Latents = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    noise_every: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[BAOABState, BAOABInfo]:
    """Move one chain by one BAOAB step with the gradient ``gradient`` (from :func:`estimate`).

    ``friction`` is a scalar or a tensor per site (one friction per coordinate).
    """
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
    noise_average, gradient_variance = noise_in_step(state, gradient, gradient_noise, surviving, noise_every)
    variance, noise_ratio, uncorrected = injected_variance(
        wanted, gradient_variance, gradient_noise == "correct", state.latents
    )
    noise = gaussian_like(state.latents, generator, temperature)
    kicked = integrators.kick(state.momenta, gradient.grads, kick)
    momenta = integrators.ornstein_uhlenbeck(kicked, decay, variance, noise)
    proposal = integrators.baoab_position(state.latents, kicked, momenta, step_size_now, masses)
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    momenta = zero_where_diverging(diverging, momenta)
    owed = torch.where(diverging, torch.full_like(kick, math.nan), step_size_now + torch.zeros_like(kick))
    info = BAOABInfo(
        gradient.log_posterior,
        gradient.grad_norm,
        step_size_now,
        temperature_now,
        diverging,
        noise_ratio,
        uncorrected,
        friction,
    )
    return BAOABState(latents, momenta, previous, state.step_count + 1, owed, noise_average), info


def step(
    state: BAOABState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    generator: torch.Generator | None = None,
) -> tuple[BAOABState, BAOABInfo]:
    """Advance one chain by one BAOAB step on ``batch`` (:func:`estimate` then :func:`update`)."""
    gradient = estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise)
    return update(
        state,
        gradient,
        step_size=step_size,
        friction=friction,
        mass=mass,
        temperature=temperature,
        gradient_noise=gradient_noise,
        generator=generator,
    )


def sgd_hyperparameters(lr: float, momentum: float, mass: float = 1.0) -> dict[str, float]:
    """The ``step_size`` and ``friction`` whose T = 0 trajectory is ``torch.optim.SGD(lr=lr, momentum=momentum)``.

    Example:
        >>> {k: round(v, 6) for k, v in sgd_hyperparameters(lr=0.01, momentum=0.9).items()}
        {'step_size': 0.102598, 'friction': 1.026927}

    """
    if not (lr > 0 and 0 < momentum < 1 and mass > 0):
        raise ValueError(f"need lr > 0, 0 < momentum < 1 and mass > 0; got {lr=}, {momentum=}, {mass=}.")
    step_size = math.sqrt(2.0 * mass * lr / (1.0 + momentum))
    return {"step_size": step_size, "friction": -math.log(momentum) / step_size}


class BAOAB(Kernel):
    """BAOAB for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`step`.

    With ``temperature=0`` and a scalar mass the trajectory is that of ``torch.optim.SGD(lr=step_size**2 * (1 + c)
    / (2 * mass), momentum=c)``, ``c = exp(-friction * step_size)`` (see :func:`sgd_hyperparameters`).

    Args:
        model: a Pyro model whose likelihood sits in a subsampled ``pyro.plate``; kept as ``self.model``, a
            :class:`~pyro_scalable.bridge.FullDataModel` (the same model on the full data).
        step_size: ε, a constant or a schedule (:mod:`pyro_scalable.infer.schedules`); ``None`` (the default)
            chooses it in warm-up from the curvature and the gradient noise (needs ``num_warmup`` > 0).
        friction: γ > 0, any size (the O step is exact). ``None`` (the default) is 1.0 with a given step size,
            and chosen in warm-up with the step size otherwise.
        mass: the diagonal mass: a positive scalar, or a dict of positive tensors by site.
        temperature: T; 1 is Bayes, 0 is SGD with momentum. A constant or a schedule.
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

    init_rule = staticmethod(init)
    update_rule = staticmethod(update)
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
        if step_size is not None:
            check_positive("step_size", step_size)
            friction = 1.0 if friction is None else friction
        if friction is not None:
            check_positive("friction", friction)
        check_mass(mass)
        check_positive("temperature", temperature, allow_zero=True)
        self.model = FullDataModel(model)
        self.step_size = step_size
        self.friction = friction
        self.mass = mass
        self.temperature = temperature
        self.gradient_noise = check_gradient_noise(gradient_noise, step_size)
        self.control_variate = check_control_variate(control_variate)
        self.init_strategy = init_strategy

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something (here: the step size, and the friction if not given)."""
        return self.step_size is None

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        return {
            "step_size": self.step_size,
            "friction": self.friction,
            "mass": self.mass,
            "temperature": self.temperature,
            "gradient_noise": self.gradient_noise,
        }

    def __repr__(self) -> str:
        mass = self.mass if isinstance(self.mass, (float, int)) else "{...}"
        return (
            f"BAOAB(step_size={self.step_size!r}, friction={self.friction!r}, mass={mass!r}, "
            f"temperature={self.temperature!r}, gradient_noise={self.gradient_noise!r})"
        )
