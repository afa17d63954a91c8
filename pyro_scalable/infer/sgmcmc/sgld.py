r"""Stochastic-gradient Langevin dynamics with a temperature (Welling & Teh, 2011; posteriors paper §3).

Target :math:`\pi_T(\theta) \propto \exp(\log p(\theta, \mathcal{D}) / T)`. With :math:`\hat g` the gradient of
the minibatch estimate of :math:`\log p(\theta, \mathcal{D})` (the plate does the N/B scaling), step size
:math:`\epsilon` and :math:`\xi \sim \mathcal{N}(0, I)`:

.. math::

    \theta_{t+1} = \theta_t + \epsilon\,\hat g(\theta_t) + \sqrt{2 \epsilon T}\,\xi_t .

* :math:`T = 1` is the Bayesian posterior, :math:`T < 1` a cold posterior, and :math:`T = 0` is exactly
  gradient ascent: ``torch.optim.SGD(lr=step_size)`` on the negative log joint.
* On a Gaussian target :math:`\mathcal{N}(0, \sigma^2)` with exact gradients the chain is AR(1) with stationary
  variance :math:`T\sigma^2 / (1 - \epsilon / (2\sigma^2))` — the discretisation bias the tests check.

**Gradient noise.** The minibatch gradient brings noise of covariance :math:`V` (see :mod:`.base`) into the
update on top of the injected :math:`2\epsilon T`: a step's noise is :math:`2\epsilon T + \epsilon^2 V`, and
on the Gaussian target the stationary variance grows to :math:`(2\epsilon T + \epsilon^2 V) /
(\epsilon\lambda(2 - \epsilon\lambda))`, too wide by :math:`1 + \epsilon V / (2T)`. With
``gradient_noise="correct"`` the step injects :math:`2\epsilon T - \epsilon^2\hat V_j` per coordinate
(:math:`\hat V` the unbiased per-minibatch estimate, diagonal), so the expected noise is :math:`2\epsilon T`
again. That is possible only where :math:`\epsilon\hat V_j \le 2T`; where it is not, nothing is injected and the
step counts in ``sample_stats.uncorrected``. The off-diagonal part of :math:`V` is left uncorrected.

**Step size.** ``step_size=None`` chooses :math:`\epsilon = \min(0.1/\lambda, \rho\, 2T/\max_j \bar V_j)` in
warm-up (:mod:`.warmup`): a stationary-variance bias of at most 5% in the stiffest direction, and gradient noise
of at most :math:`\rho = 1/2` of the wanted noise.
"""

from __future__ import annotations

from collections.abc import Callable
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
    SGMCMCInfo,
    check_gradient_noise,
    estimate_gradient,
    gaussian_like,
    injected_variance,
    keep_where_finite,
)

__all__ = ["SGLD", "SGLDState", "estimate", "init", "step", "update"]

CURVATURE_BOUND = 0.1  # ε λ_max chosen in warm-up


class SGLDState(NamedTuple):
    """Everything the next SGLD step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    checked_latents: (
        Latents  # last point with finite density and gradient: the draw, and where a diverging step returns
    )
    step_count: Tensor  # 0-d int64
    adaptation: warmup.Adaptation  # the step size chosen in warm-up and what it was chosen from


def init(latents: Latents, step_size: ScalarOrSchedule | None = None) -> SGLDState:
    """Start a chain at unconstrained ``latents`` (``step_size=None``: to be chosen in warm-up)."""
    first = next(iter(latents.values()))
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    return SGLDState(dict(latents), dict(latents), zero, warmup.init_adaptation(latents, step_size))


def estimate(
    state: SGLDState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    gradient_noise: str = "ignore",
    adapt: int = 0,
) -> GradientEstimate:
    """The minibatch gradient at ``state.latents``, its noise, and in warm-up (``adapt`` > 0) the curvature."""
    noise = gradient_noise != "ignore" or adapt > 0
    result = estimate_gradient(log_posterior_fn, state.latents, batch, noise=noise)
    if adapt > 0:
        product = warmup.hessian_product(
            log_posterior_fn, state.latents, batch, state.adaptation, None, iterations=adapt
        )
        result = result._replace(hessian_product=product)
    return result


def update(
    state: SGLDState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | None,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    burn_in: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[SGLDState, SGMCMCInfo]:
    """Move one chain by one SGLD step with the gradient ``gradient`` (from :func:`estimate`)."""
    temp = resolve(temperature, state.step_count, gradient.log_posterior)
    adaptation = warmup.observe(state.adaptation, gradient)
    if gradient.hessian_product and step_size is None:
        chosen = CURVATURE_BOUND / adaptation.curvature
        if not burn_in:
            chosen = torch.minimum(chosen, warmup.noise_bound(adaptation.noise, None, 2.0 * temp))
        adaptation = adaptation._replace(step_size=chosen)
    eps = adaptation.step_size if step_size is None else resolve(step_size, state.step_count, gradient.log_posterior)
    gradient_variance = (
        {}
        if gradient_noise == "ignore"
        else {name: eps**2 * adaptation.noise[name] for name in gradient.noise_variance}
    )
    variance, noise_ratio, uncorrected = injected_variance(
        2.0 * eps * temp, gradient_variance, gradient_noise == "correct", state.latents
    )
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = {
        name: x + eps * gradient.grads[name] + torch.sqrt(variance[name]) * noise[name]
        for name, x in state.latents.items()
    }
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    latents, _, adaptation = warmup.settle(adaptation, latents, burn_in, bool(gradient.hessian_product))
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(gradient.log_posterior, gradient.grad_norm, eps, temp, diverging, noise_ratio, uncorrected)
    return SGLDState(latents, previous, state.step_count + 1, adaptation), info


def step(
    state: SGLDState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule | None,
    temperature: ScalarOrSchedule = 1.0,
    gradient_noise: str = "ignore",
    adapt: int = 0,
    burn_in: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[SGLDState, SGMCMCInfo]:
    """Advance one chain by one SGLD step on ``batch`` (:func:`estimate` then :func:`update`)."""
    gradient = estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise, adapt=adapt)
    return update(
        state,
        gradient,
        step_size=step_size,
        temperature=temperature,
        gradient_noise=gradient_noise,
        burn_in=burn_in,
        generator=generator,
    )


class SGLD(Kernel):
    """SGLD for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`step`.

    ``model`` is kept as ``self.model``, a :class:`~pyro_scalable.bridge.FullDataModel`: the same model with
    subsampling switched off, which is what ``Predictive`` and ``arviz.from_pyro`` should run (the model as written
    is ``self.model.model``). With ``temperature=0`` and a given step size the trajectory is that of
    ``torch.optim.SGD(params, lr=step_size)`` minimising the negative log joint.

    Args:
        model: a Pyro model whose likelihood sits in ``pyro.plate(name, N, subsample_size=B)`` (or
            ``subsample=idx``), so that it returns an unbiased estimate of the full-data log joint.
        step_size: ε, a constant or a schedule (:mod:`pyro_scalable.infer.schedules`); ``None`` (the default)
            chooses it in warm-up from the curvature and the gradient noise (needs ``num_warmup`` > 0).
        temperature: T; 1 is Bayes, 0 is SGD. A constant or a schedule.
        gradient_noise: ``"correct"`` subtracts the minibatch gradient's estimated noise from the injected noise
            (per-example gradients; one subsampled plate with ``subsample_size`` >= 2), ``"estimate"`` only
            reports it in ``sample_stats.noise_ratio``, ``"ignore"`` does neither. Default: ``"correct"`` when
            the step size is left to warm-up, else ``"ignore"``.
        init_strategy: a Pyro init strategy (``pyro.infer.autoguide.init_to_*``), one draw per chain.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import SGLD, StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> mcmc = StochasticMCMC(SGLD(model, step_size=1e-3), num_samples=200, num_warmup=200,
        ...                       num_chains=2, progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)
        >>> mcmc.get_samples()["mu"].shape
        torch.Size([400])

    """

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None = None,
        temperature: ScalarOrSchedule = 1.0,
        *,
        gradient_noise: str | None = None,
        init_strategy: Callable = init_to_uniform,
    ):
        if step_size is not None:
            check_positive("step_size", step_size)
        check_positive("temperature", temperature, allow_zero=True)
        self.model = FullDataModel(model)
        self.step_size = step_size
        self.temperature = temperature
        self.gradient_noise = check_gradient_noise(gradient_noise, step_size)
        self.init_strategy = init_strategy

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something (here: the step size)."""
        return self.step_size is None

    def init(self, latents: Latents) -> SGLDState:
        """Start a chain at unconstrained ``latents``."""
        return init(latents, self.step_size)

    def estimate(self, state: SGLDState, batch: Any, log_posterior_fn: LogPosteriorFn, adapt: int = 0):
        """The gradient (and its noise, and in warm-up the curvature) the next update needs."""
        return estimate(state, batch, log_posterior_fn, gradient_noise=self.gradient_noise, adapt=adapt)

    def update(
        self,
        state: SGLDState,
        gradient: GradientEstimate,
        generator: torch.Generator | None = None,
        burn_in: bool = False,
    ):
        """One update with this kernel's hyperparameters, given the gradient (``burn_in``: early warm-up)."""
        return update(
            state,
            gradient,
            step_size=self.step_size,
            temperature=self.temperature,
            gradient_noise=self.gradient_noise,
            burn_in=burn_in,
            generator=generator,
        )

    def __repr__(self) -> str:
        return (
            f"SGLD(step_size={self.step_size!r}, temperature={self.temperature!r}, "
            f"gradient_noise={self.gradient_noise!r})"
        )
