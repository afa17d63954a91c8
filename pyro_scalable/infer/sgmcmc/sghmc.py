r"""Stochastic-gradient Hamiltonian Monte Carlo with a temperature (Chen et al., 2014; posteriors paper App. C).

Momentum :math:`m`, friction :math:`\alpha`, mass :math:`\sigma^2`, step size :math:`\epsilon`, temperature
:math:`T`, minibatch gradient :math:`\hat g` of the log joint and :math:`\xi \sim \mathcal{N}(0, I)`:

.. math::

    m_{t+1} &= m_t + \epsilon\,\hat g(\theta_t) - \epsilon\,\alpha\,\sigma^{-2} m_t
               + \sqrt{2\,\alpha\,\epsilon\,T}\;\xi_t, \\
    \theta_{t+1} &= \theta_t + \epsilon\,\sigma^{-2} m_{t+1} .

The continuous-time limit has stationary law :math:`\pi_T(\theta)\,\mathcal{N}(m; 0, T\sigma^2)`. The mass may
be a diagonal matrix (per coordinate), given or estimated in warm-up as the diagonal Fisher
(``mass="fisher"``, proportional to the gradient-noise variance, normalised to mean 1, then frozen; see
:mod:`.adaptation`).

**Gradient noise** (Chen et al.'s :math:`\hat B`; the posteriors paper's :math:`\hat\beta`). The minibatch
gradient adds :math:`\epsilon^2 V` to the momentum's noise. With ``gradient_noise="correct"`` the injected
variance is :math:`2\alpha\epsilon T - \epsilon^2 \hat V_j` per coordinate (diagonal, unbiased per-minibatch
:math:`\hat V`), possible where :math:`\epsilon \hat V_j \le 2\alpha T`; elsewhere nothing is injected and the
coordinate counts in ``sample_stats.uncorrected``. (The same term is often written
:math:`T\epsilon(2\alpha - T\epsilon\hat\beta)`, i.e. :math:`\hat\beta = V/T^2`: the gradient's noise does not
scale with the temperature.)

**A friction per coordinate.** :math:`\alpha` may be a diagonal matrix, one :math:`\alpha_j` per coordinate
(``friction`` a dict of tensors by site): the continuous-time dynamics
:math:`dm = \nabla\log\pi\,dt - \alpha\sigma^{-2}m\,dt + \sqrt{2\alpha T}\,dW` keep
:math:`\pi_T(\theta)\,\mathcal{N}(m; 0, T\sigma^2)` stationary for any positive diagonal :math:`\alpha` (the
friction and the noise it injects balance coordinate by coordinate), and each coordinate's noise bound is its own.

**Warm-up.** ``step_size=None`` chooses :math:`\epsilon \le 0.3/\sqrt{\lambda}` (:math:`\lambda` the largest
curvature in the mass metric: a stationary-variance bias of about 2%) and, where the friction is also left to
warm-up, a friction per coordinate,
:math:`\alpha_j = \min(\max(\epsilon \bar V_j / (2T\rho),\ 0.1\,m_j/\epsilon),\ 0.5\,m_j/\epsilon)` (the least
friction that keeps that coordinate's gradient noise within :math:`\rho` of the injected noise, at least SGD's
momentum 0.9), with :math:`\epsilon` small enough that every coordinate's momentum keeps at least half of itself per
step; ``sample_stats.friction`` is the largest. One friction for all, at the noisiest coordinate's need, damps every
other direction as hard: on a non-centred hierarchical logistic regression the group scale's gradient noise asked
for 3–4 times what the rest did, and a friction each took the smallest ESS from 24–61 to 87–162 over three seeds
(``docs/benchmarks.md``).
A given friction is one for all and instead bounds :math:`\epsilon \le 2\alpha T\rho / \bar V_{\max}`.

**T = 0 is SGD with momentum.** Writing :math:`b_t = -m_t / \epsilon`, the update is
:math:`b_{t+1} = \mu b_t + \nabla(-\log p)`, :math:`\theta_{t+1} = \theta_t - \eta\, b_{t+1}` — exactly
``torch.optim.SGD(lr=η, momentum=μ)`` from a zero momentum buffer — with

.. math::

    \eta = \epsilon^2 / \sigma^2, \qquad \mu = 1 - \epsilon\,\alpha / \sigma^2
    \qquad\Longleftrightarrow\qquad
    \epsilon = \sigma\sqrt{\eta}, \qquad \alpha = \sigma (1 - \mu) / \sqrt{\eta} .

(for a constant step size; :func:`sgd_hyperparameters` does the conversion).
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
    NOISE_FRACTION,
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

__all__ = ["SGHMC", "SGHMCInfo", "SGHMCState", "estimate", "init", "sgd_hyperparameters", "step", "update"]

SGHMCInfo = extended_info("SGHMCInfo", "friction")


class SGHMCState(NamedTuple):
    """Everything the next SGHMC step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # same keys and shapes as latents
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64
    noise_average: Latents  # moving average of the gradient-noise variance ({} where it is not estimated)


def init(latents: Latents, momenta: Latents | None = None, *, gradient_noise: str = "ignore") -> SGHMCState:
    """Start a chain at ``latents`` with zero momenta (or the given ones)."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    return SGHMCState(dict(latents), dict(momenta), dict(latents), zero, noise_start(latents, gradient_noise))


def update(
    state: SGHMCState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor | Latents = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    noise_every: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[SGHMCState, SGHMCInfo]:
    """Move one chain by one SGHMC step with the gradient ``gradient`` (from :func:`estimate`).

    ``friction`` is a scalar or, as warm-up chooses it, a tensor per site (one friction per coordinate).
    """
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    masses = mass_like(mass, state.latents)
    if isinstance(friction, dict):  # one per coordinate, as warm-up chooses it; the Info shows the largest
        frictions, friction = friction, torch.stack([f.max() for f in friction.values()]).max()
        wanted = {name: 2.0 * f * step_size_now * temperature_now for name, f in frictions.items()}
    else:
        friction = scalar_like(friction, step_size_now)
        frictions = dict.fromkeys(state.latents, friction)
        wanted = 2.0 * friction * step_size_now * temperature_now  # one for all sites
    noise_average, gradient_variance = noise_in_step(state, gradient, gradient_noise, step_size_now**2, noise_every)
    if gradient_noise == "correct":
        frictions, friction = _noise_held(frictions, gradient_variance, step_size_now, temperature_now, masses)
        wanted = {name: 2.0 * f * step_size_now * temperature_now for name, f in frictions.items()}
    variance, noise_ratio, uncorrected = injected_variance(
        wanted,
        gradient_variance,
        gradient_noise == "correct",
        state.latents,
    )
    noise = gaussian_like(state.latents, generator, temperature)
    decay = {name: 1.0 - step_size_now * frictions[name] / m for name, m in masses.items()}
    momenta = integrators.momentum(state.momenta, gradient.grads, step_size_now, decay, variance, noise)
    proposal = integrators.drift(state.latents, momenta, {name: step_size_now / m for name, m in masses.items()})
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    momenta = zero_where_diverging(diverging, momenta)
    info = SGHMCInfo(
        gradient.log_posterior,
        gradient.grad_norm,
        step_size_now,
        temperature_now,
        diverging,
        noise_ratio,
        uncorrected,
        friction,
    )
    return SGHMCState(latents, momenta, previous, state.step_count + 1, noise_average), info


def _noise_held(
    frictions: Latents, gradient_variance: Latents, step_size: Tensor, temperature: Tensor, masses: Latents
) -> tuple[Latents, Tensor]:
    """Each coordinate's friction, raised where the chain's gradient noise now asks for more than it was given.

    Warm-up chose α_j ≥ ε V̄_j / (2Tρ) from the noise it saw; a chain that wanders where its gradient is noisier (a
    control variate's noise grows with the distance to its centre) would otherwise get gradient noise the injected
    noise cannot cancel, run hot and wander further. Holding the same inequality with the chain's own moving
    average (up to a decay of 0: α_j ≤ m_j/ε) keeps it calibrated; any positive friction keeps the law.
    """
    hot = temperature > 0
    held = {}
    for name, f in frictions.items():
        need = gradient_variance[name] / torch.where(hot, 2.0 * step_size * temperature * NOISE_FRACTION, 1.0)
        need = torch.minimum(torch.where(hot, need, 0.0), masses[name] / step_size)
        held[name] = torch.maximum(f, need)
    return held, torch.stack([f.max() for f in held.values()]).max()


def step(
    state: SGHMCState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    generator: torch.Generator | None = None,
) -> tuple[SGHMCState, SGHMCInfo]:
    """Advance one chain by one SGHMC step on ``batch`` (:func:`estimate` then :func:`update`)."""
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
        >>> sgd_hyperparameters(lr=0.01, momentum=0.9)
        {'step_size': 0.1, 'friction': 1.0}

    """
    if not (lr > 0 and 0 <= momentum < 1 and mass > 0):
        raise ValueError(f"need lr > 0, 0 <= momentum < 1 and mass > 0; got {lr=}, {momentum=}, {mass=}.")
    step_size = math.sqrt(lr * mass)
    return {"step_size": step_size, "friction": round(mass * (1.0 - momentum) / step_size, 15)}


class SGHMC(Kernel):
    """SGHMC for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`step`.

    With ``temperature=0`` and a scalar mass the trajectory is that of ``torch.optim.SGD(lr=step_size**2 / mass,
    momentum=1 - step_size * friction / mass)`` minimising the negative log joint (see the module docstring).

    Args:
        model: a Pyro model whose likelihood sits in a subsampled ``pyro.plate``; kept as ``self.model``, a
            :class:`~pyro_scalable.bridge.FullDataModel` (the same model on the full data).
        step_size: ε, a constant or a schedule (:mod:`pyro_scalable.infer.schedules`); ``None`` (the default)
            chooses it in warm-up from the curvature and the gradient noise (needs ``num_warmup`` > 0).
        friction: α > 0; ``step_size * friction / mass`` must be below 1. ``None`` (the default) is 1.0 with a
            given step size, and chosen in warm-up with the step size otherwise, one per coordinate.
        mass: the diagonal mass: a positive scalar, a dict of positive tensors by site (broadcast to the site's
            unconstrained shape), or ``"fisher"``: the diagonal Fisher, estimated in warm-up then frozen.
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
        >>> from pyro_scalable.infer import SGHMC, StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> mcmc = StochasticMCMC(SGHMC(model, step_size=0.01, friction=10.0), num_samples=200,
        ...                       num_warmup=200, num_chains=2, progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)
        StochasticMCMC(SGHMC, 2 chains x 200 draws)
        >>> mcmc.get_samples(group_by_chain=True)["mu"].shape
        torch.Size([2, 200])

    """

    init_rule = staticmethod(init)
    update_rule = staticmethod(update)
    warmup_rule = "momentum"

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
        least_mass = check_mass(mass, learnt=True)
        check_positive("temperature", temperature, allow_zero=True)
        if step_size is not None:
            largest = float(step_size(torch.zeros(())) if callable(step_size) else step_size)  # schedules start highest
            if largest * friction / least_mass >= 1.0:
                raise ValueError(
                    f"step_size * friction / mass must be below 1 (got {largest * friction / least_mass:.3g}): "
                    "the momentum would change sign every step. Lower the step size or the friction."
                )
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
        """Whether warm-up chooses something: the step size (and friction) or the Fisher mass."""
        return self.step_size is None or self.mass == "fisher"

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
        mass = self.mass if isinstance(self.mass, (str, float, int)) else "{...}"
        return (
            f"SGHMC(step_size={self.step_size!r}, friction={self.friction!r}, mass={mass!r}, "
            f"temperature={self.temperature!r}, gradient_noise={self.gradient_noise!r})"
        )
