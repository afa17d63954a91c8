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
warm-up (:mod:`.adaptation`): a stationary-variance bias of at most 5% in the stiffest direction, and gradient
noise of at most :math:`\rho = 1/2` of the wanted noise.
"""

from __future__ import annotations

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
    SGMCMCInfo,
    builder,
    functional_step,
    gaussian_like,
    injected_noise,
    shared_info,
)
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite
from pyro_scalable.infer.sgmcmc.kernel import Kernel

__all__ = ["SGLD", "SGLDState", "build", "init", "step", "update"]


class SGLDState(NamedTuple):
    """Everything the next SGLD step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64


def init(latents: Latents) -> SGLDState:
    """Start a chain at unconstrained ``latents``."""
    first = next(iter(latents.values()))
    return SGLDState(dict(latents), dict(latents), torch.zeros((), dtype=torch.int64, device=first.device))


def update(
    state: SGLDState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SGLDState, SGMCMCInfo]:
    """Move one chain by one SGLD step with the gradient ``gradient`` (its noise, if any, the variance to correct)."""
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    # the gradient noise ε² V is part of the step's noise: where the estimate hands it as a correction, less is injected
    variance, noise_ratio, uncorrected = injected_noise(
        2.0 * step_size_now * temperature_now, gradient, step_size_now**2, state.latents
    )
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = integrators.langevin(state.latents, gradient.grads, step_size_now, variance, noise)
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(*shared_info(gradient, step_size_now, temperature_now, noise_ratio, uncorrected))
    return SGLDState(latents, previous, state.step_count + 1), info


step = functional_step(update)
build = builder(init, update)


class SGLD(Kernel):
    """SGLD for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`update`.

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
        control_variate: the centre of a control-variate gradient (:mod:`.control_variates`): ``"map"`` (found
            before the run), ``"warmup"`` (each of warm-up's metric windows' mean in turn), a dict of latent values
            by site, or a trained autoguide; ``None``: plain minibatch gradients; ``"auto"`` (the default): ``"map"``
            where warm-up chooses the step and ``N/B ≥ 10``, ``"warmup"`` for a hierarchy at ``N/B ≥ 4``
            (:func:`~pyro_scalable.infer.sgmcmc.control_choice.choose`).
        init_strategy: a Pyro init strategy (``pyro.infer.autoguide.init_to_*``), one draw per chain. Left at its
            default (``init_to_uniform`` itself), a run whose control variate is at a mode it searched for starts
            every chain at that mode; ``init_to_uniform(radius=2.0)`` draws as Pyro does.

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
        StochasticMCMC(SGLD, 2 chains x 200 draws)
        >>> mcmc.get_samples()["mu"].shape
        torch.Size([400])

    """

    build = staticmethod(build)
    warmup_rule = "langevin"

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None = None,
        temperature: ScalarOrSchedule = 1.0,
        *,
        gradient_noise: str | None = None,
        control_variate: Any = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        super().__init__(model, step_size, temperature, gradient_noise, control_variate, init_strategy)

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        return {"step_size": self.step_size, "temperature": self.temperature}
