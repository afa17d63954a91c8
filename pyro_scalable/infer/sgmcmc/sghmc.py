r"""Stochastic-gradient Hamiltonian Monte Carlo with a temperature (Chen et al., 2014; posteriors paper App. C).

Momentum :math:`m`, friction :math:`\alpha`, mass :math:`\sigma^2`, step size :math:`\epsilon`, temperature
:math:`T`, minibatch gradient :math:`\hat g` of the log joint and :math:`\xi \sim \mathcal{N}(0, I)`:

.. math::

    m_{t+1} &= m_t + \epsilon\,\hat g(\theta_t) - \epsilon\,\alpha\,\sigma^{-2} m_t
               + \sqrt{2\,\alpha\,\epsilon\,T}\;\xi_t, \\
    \theta_{t+1} &= \theta_t + \epsilon\,\sigma^{-2} m_{t+1} .

The continuous-time limit has stationary law :math:`\pi_T(\theta)\,\mathcal{N}(m; 0, T\sigma^2)`. The mass may
be a diagonal matrix (per coordinate), given or estimated in warm-up as the diagonal Fisher
(``mass="fisher"``, proportional to the gradient-noise variance, normalised to mean 1, then frozen).

**Gradient noise** (Chen et al.'s :math:`\hat B`; the posteriors paper's :math:`\hat\beta`). The minibatch
gradient adds :math:`\epsilon^2 V` to the momentum's noise. With ``gradient_noise="correct"`` the injected
variance is :math:`2\alpha\epsilon T - \epsilon^2 \hat V_j` per coordinate (diagonal, unbiased per-minibatch
:math:`\hat V`), possible where :math:`\epsilon \hat V_j \le 2\alpha T`; elsewhere nothing is injected and the
coordinate counts in ``sample_stats.uncorrected``. (DESIGN.md writes the same term as
:math:`T\epsilon(2\alpha - T\epsilon\hat\beta)`, i.e. :math:`\hat\beta = V/T^2`: the gradient's noise does not
scale with the temperature.)

**Warm-up.** ``step_size=None`` chooses :math:`\epsilon \le 0.3/\sqrt{\lambda}` (:math:`\lambda` the largest
curvature in the mass metric: a stationary-variance bias of about 2%) and, where the friction is also left to
warm-up, :math:`\alpha = \max(\epsilon \bar V_{\max} / (2T\rho),\ 0.1\,\bar m/\epsilon)` with
:math:`\epsilon` small enough that the momentum keeps at least half of itself per step; a given friction instead
bounds :math:`\epsilon \le 2\alpha T\rho / \bar V_{\max}`.

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
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.bridge.model import FullDataModel
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive, resolve
from pyro_scalable.infer.sgmcmc import warmup
from pyro_scalable.infer.sgmcmc.base import (
    GradientEstimate,
    Kernel,
    Latents,
    LogPosteriorFn,
    check_gradient_noise,
    estimate_gradient,
    gaussian_like,
    injected_variance,
    keep_where_finite,
)

__all__ = ["SGHMC", "SGHMCInfo", "SGHMCState", "estimate", "init", "sgd_hyperparameters", "step", "update"]

CURVATURE_BOUND = 0.3  # ε √λ_max chosen in warm-up
_LEAST_MASS = 1e-3  # a Fisher mass is floored at this share of its mean

Mass = float | Mapping[str, Tensor] | str


class SGHMCState(NamedTuple):
    """Everything the next SGHMC step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # same keys and shapes as latents
    checked_latents: (
        Latents  # last point with finite density and gradient: the draw, and where a diverging step returns
    )
    step_count: Tensor  # 0-d int64
    mass: Latents  # diagonal mass, shaped like the latents
    friction: Tensor  # 0-d α (NaN until warm-up chooses it)
    adaptation: warmup.Adaptation


class SGHMCInfo(NamedTuple):
    """An SGHMC step, for people and ArviZ (the fields of :class:`~.base.SGMCMCInfo`, and the friction)."""

    log_posterior: Tensor
    grad_norm: Tensor
    step_size: Tensor
    temperature: Tensor
    diverging: Tensor
    noise_ratio: Tensor
    uncorrected: Tensor
    friction: Tensor


def init(
    latents: Latents,
    momenta: Latents | None = None,
    *,
    step_size: ScalarOrSchedule | None = None,
    friction: float | None = 1.0,
    mass: Mass = 1.0,
) -> SGHMCState:
    """Start a chain at ``latents`` with zero momenta (or the given ones); ``None``/"fisher": chosen in warm-up."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    masses = {name: _mass_of(mass, name, x) for name, x in latents.items()}
    alpha = torch.full((), math.nan if friction is None else float(friction), dtype=first.dtype, device=first.device)
    adaptation = warmup.init_adaptation(latents, step_size)
    return SGHMCState(dict(latents), dict(momenta), dict(latents), zero, masses, alpha, adaptation)


def _mass_of(mass: Mass, name: str, x: Tensor) -> Tensor:
    if isinstance(mass, str):
        return torch.ones_like(x)
    if isinstance(mass, Mapping):
        return torch.as_tensor(mass[name], dtype=x.dtype, device=x.device) + torch.zeros_like(x)
    return torch.full_like(x, float(mass))


def estimate(
    state: SGHMCState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    gradient_noise: str = "ignore",
    adapt: int = 0,
) -> GradientEstimate:
    """The minibatch gradient, its noise, and in warm-up the curvature in the mass metric."""
    noise = gradient_noise != "ignore" or adapt > 0
    result = estimate_gradient(log_posterior_fn, state.latents, batch, noise=noise)
    if adapt > 0:
        inverse_mass = {name: 1.0 / m for name, m in state.mass.items()}
        product = warmup.hessian_product(
            log_posterior_fn, state.latents, batch, state.adaptation, inverse_mass, iterations=adapt
        )
        result = result._replace(hessian_product=product)
    return result


def update(
    state: SGHMCState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | None,
    friction: float | None = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    burn_in: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[SGHMCState, SGHMCInfo]:
    """Move one chain by one SGHMC step with the gradient ``gradient`` (from :func:`estimate`)."""
    temp = resolve(temperature, state.step_count, gradient.log_posterior)
    masses, alpha = state.mass, state.friction
    adaptation = warmup.observe(state.adaptation, gradient)
    if gradient.hessian_product:
        if mass == "fisher":
            masses = _fisher_mass(adaptation.noise)
        if step_size is None:
            eps, alpha = warmup.momentum_step_size(
                adaptation, friction, temp if not burn_in else torch.zeros_like(temp), masses, CURVATURE_BOUND
            )
            adaptation = adaptation._replace(step_size=eps)
    eps = adaptation.step_size if step_size is None else resolve(step_size, state.step_count, gradient.log_posterior)
    gradient_variance = (
        {}
        if gradient_noise == "ignore"
        else {name: eps**2 * adaptation.noise[name] for name in gradient.noise_variance}
    )
    variance, noise_ratio, uncorrected = injected_variance(
        2.0 * alpha * eps * temp, gradient_variance, gradient_noise == "correct", state.latents
    )
    noise = gaussian_like(state.latents, generator, temperature)
    momenta = {
        name: (1.0 - eps * alpha / masses[name]) * m
        + eps * gradient.grads[name]
        + torch.sqrt(variance[name]) * noise[name]
        for name, m in state.momenta.items()
    }
    proposal = {name: x + (eps / masses[name]) * momenta[name] for name, x in state.latents.items()}
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    momenta = {name: torch.where(diverging, m.new_zeros(()), m) for name, m in momenta.items()}
    latents, jumped, adaptation = warmup.settle(adaptation, latents, burn_in, bool(gradient.hessian_product))
    momenta = {name: torch.where(jumped, p.new_zeros(()), p) for name, p in momenta.items()}
    info = SGHMCInfo(gradient.log_posterior, gradient.grad_norm, eps, temp, diverging, noise_ratio, uncorrected, alpha)
    new = SGHMCState(latents, momenta, previous, state.step_count + 1, masses, alpha, adaptation)
    return new, info


def _fisher_mass(noise: Latents) -> Latents:
    """The diagonal Fisher up to a constant (the gradient-noise variance), normalised to mean 1 and floored."""
    flat = torch.cat([v.reshape(-1) for v in noise.values()])
    mean = flat.mean()
    scale = torch.where(mean > 0, mean, torch.ones_like(mean))
    return {name: torch.clamp(v / scale, min=_LEAST_MASS) for name, v in noise.items()}


def step(
    state: SGHMCState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule | None,
    friction: float | None = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    adapt: int = 0,
    burn_in: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[SGHMCState, SGHMCInfo]:
    """Advance one chain by one SGHMC step on ``batch`` (:func:`estimate` then :func:`update`).

    A state made by :func:`init` carries its mass and friction; ``friction`` and ``mass`` here say only whether
    warm-up chooses them (``None`` / ``"fisher"``), except that a state started with the defaults takes them.
    """
    if not isinstance(mass, str):
        state = state._replace(mass={name: _mass_of(mass, name, x) for name, x in state.latents.items()})
    if friction is not None:
        state = state._replace(friction=torch.full_like(state.friction, float(friction)))
    gradient = estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise, adapt=adapt)
    return update(
        state,
        gradient,
        step_size=step_size,
        friction=friction,
        mass=mass,
        temperature=temperature,
        gradient_noise=gradient_noise,
        burn_in=burn_in,
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
            given step size, and chosen in warm-up with the step size otherwise.
        mass: the diagonal mass: a positive scalar, a dict of positive tensors by site (broadcast to the site's
            unconstrained shape), or ``"fisher"``: the diagonal Fisher, estimated in warm-up then frozen.
        temperature: T; 1 is Bayes, 0 is SGD with momentum. A constant or a schedule.
        gradient_noise: ``"correct"``, ``"estimate"`` or ``"ignore"``, as for :class:`~.sgld.SGLD` (default:
            ``"correct"`` when the step size is left to warm-up, else ``"ignore"``).
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
        >>> mcmc.get_samples(group_by_chain=True)["mu"].shape
        torch.Size([2, 200])

    """

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None = None,
        friction: float | None = None,
        mass: Mass = 1.0,
        temperature: ScalarOrSchedule = 1.0,
        *,
        gradient_noise: str | None = None,
        init_strategy: Callable = init_to_uniform,
    ):
        if step_size is not None:
            check_positive("step_size", step_size)
            friction = 1.0 if friction is None else friction
        if friction is not None:
            check_positive("friction", friction)
        least_mass = _check_mass(mass)
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
        self.init_strategy = init_strategy

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something: the step size (and friction) or the Fisher mass."""
        return self.step_size is None or self.mass == "fisher"

    def init(self, latents: Latents) -> SGHMCState:
        """Start a chain at unconstrained ``latents`` with zero momenta."""
        return init(latents, step_size=self.step_size, friction=self.friction, mass=self.mass)

    def estimate(self, state: SGHMCState, batch: Any, log_posterior_fn: LogPosteriorFn, adapt: int = 0):
        """The gradient (and its noise, and in warm-up the curvature) the next update needs."""
        return estimate(state, batch, log_posterior_fn, gradient_noise=self.gradient_noise, adapt=adapt)

    def update(
        self,
        state: SGHMCState,
        gradient: GradientEstimate,
        generator: torch.Generator | None = None,
        burn_in: bool = False,
    ):
        """One update with this kernel's hyperparameters, given the gradient (``burn_in``: early warm-up)."""
        return update(
            state,
            gradient,
            step_size=self.step_size,
            friction=self.friction,
            mass=self.mass,
            temperature=self.temperature,
            gradient_noise=self.gradient_noise,
            burn_in=burn_in,
            generator=generator,
        )

    def __repr__(self) -> str:
        mass = self.mass if isinstance(self.mass, (str, float, int)) else "{...}"
        return (
            f"SGHMC(step_size={self.step_size!r}, friction={self.friction!r}, mass={mass!r}, "
            f"temperature={self.temperature!r}, gradient_noise={self.gradient_noise!r})"
        )


def _check_mass(mass: Mass) -> float:
    """Validate ``mass`` and return its smallest value (1 for a mass warm-up estimates)."""
    if isinstance(mass, str):
        if mass != "fisher":
            raise ValueError(
                f"mass must be a positive number, a dict of positive tensors by site, or 'fisher'; got {mass!r}."
            )
        return 1.0
    if isinstance(mass, Mapping):
        least = math.inf
        for name, value in mass.items():
            value = torch.as_tensor(value)
            if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
                raise ValueError(f"mass['{name}'] must be finite and positive everywhere.")
            least = min(least, float(value.min()))
        return least
    check_positive("mass", mass)
    return float(mass)
