r"""Copy-me skeleton of an SG-MCMC engine (docs/developer/adding_an_engine.md); tests/test_docs.py keeps it honest.

The update here is plain SGLD, :math:`\theta_{t+1} = \theta_t + \epsilon\,\hat g(\theta_t) + \sqrt{2\epsilon T}\,\xi_t`
(Welling & Teh, 2011), without SGLD's warm-up and gradient-noise options, so the test can check the skeleton step
for step against ``pyro_scalable.infer.sgld``. To write an engine: copy this file to
``pyro_scalable/infer/sgmcmc/<name>.py``, rename ``Skeleton``, replace the maths in :func:`update` and this
docstring (the update rule once, with its reference), and keep every signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.bridge.model import FullDataModel
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive, resolve
from pyro_scalable.infer.sgmcmc.base import (
    GradientEstimate,
    Latents,
    LogPosteriorFn,
    SGMCMCInfo,
    estimate_gradient,
    gaussian_like,
    injected_variance,
    keep_where_finite,
)

__all__ = ["Skeleton", "SkeletonState", "estimate", "init", "step", "update"]


class SkeletonState(NamedTuple):
    """Everything the next step needs. Every field is a tensor (no None, no Python numbers): vmap batches it."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64
    # An engine with more state adds tensor fields here (SGHMC: momentum, a dict shaped like latents).


def init(latents: Latents) -> SkeletonState:
    """Start a chain at unconstrained ``latents``."""
    first = next(iter(latents.values()))
    return SkeletonState(dict(latents), dict(latents), torch.zeros((), dtype=torch.int64, device=first.device))


def estimate(state: SkeletonState, batch: Any, log_posterior_fn: LogPosteriorFn) -> GradientEstimate:
    """The minibatch gradient at ``state.latents`` (the half of a step a data-parallel run all-reduces)."""
    return estimate_gradient(log_posterior_fn, state.latents, batch)


def update(
    state: SkeletonState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SkeletonState, SGMCMCInfo]:
    """Move one chain by one step, given the gradient from :func:`estimate`."""
    eps = resolve(step_size, state.step_count, gradient.log_posterior)
    temp = resolve(temperature, state.step_count, gradient.log_posterior)
    # No gradient-noise estimate here: injected_variance returns the wanted 2εT and NaN statistics.
    variance, noise_ratio, uncorrected = injected_variance(2.0 * eps * temp, {}, False, state.latents)
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = {
        name: x + eps * gradient.grads[name] + torch.sqrt(variance[name]) * noise[name]
        for name, x in state.latents.items()
    }
    # A non-finite density or gradient: reject the step and go back to the last checked point (DESIGN.md §6).
    latents = keep_where_finite(gradient.diverging, proposal, state.checked_latents)
    checked = keep_where_finite(gradient.diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(
        gradient.log_posterior, gradient.grad_norm, eps, temp, gradient.diverging, noise_ratio, uncorrected
    )
    return SkeletonState(latents, checked, state.step_count + 1), info


def step(
    state: SkeletonState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SkeletonState, SGMCMCInfo]:
    """Advance one chain by one step on ``batch`` (:func:`estimate` then :func:`update`)."""
    gradient = estimate(state, batch, log_posterior_fn)
    return update(state, gradient, step_size=step_size, temperature=temperature, generator=generator)


class Skeleton:
    """The skeleton engine for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`update`.

    Args:
        model: a Pyro model whose likelihood sits in ``pyro.plate(name, N, subsample_size=B)``.
        step_size: ε, a constant or a schedule.
        temperature: T; 1 is Bayes, 0 is optimisation. A constant or a schedule.
        init_strategy: a Pyro init strategy, one draw per chain.

    Examples:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> mcmc = StochasticMCMC(Skeleton(model, step_size=1e-3), num_samples=100, num_warmup=100,
        ...                       num_chains=2, progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)
        >>> mcmc.get_samples()["mu"].shape
        torch.Size([200])

    """

    adapts = False  # True if warm-up chooses something: the driver then passes adapt= to step

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule,
        temperature: ScalarOrSchedule = 1.0,
        *,
        init_strategy: Callable = init_to_uniform,
    ):
        check_positive("step_size", step_size)
        check_positive("temperature", temperature, allow_zero=True)
        self.model = FullDataModel(model)  # subsampling switched off: what Predictive and ArviZ should run
        self.step_size = step_size
        self.temperature = temperature
        self.init_strategy = init_strategy

    def init(self, latents: Latents) -> SkeletonState:
        """Start a chain at unconstrained ``latents``."""
        return init(latents)

    def estimate(self, state: SkeletonState, batch: Any, log_posterior_fn: LogPosteriorFn, adapt: int = 0):
        """The gradient the next update needs (``adapt`` is unused: this engine does not adapt)."""
        return estimate(state, batch, log_posterior_fn)

    def update(self, state: SkeletonState, gradient: GradientEstimate, generator: torch.Generator | None = None):
        """One update with this kernel's hyperparameters, given the gradient."""
        return update(state, gradient, step_size=self.step_size, temperature=self.temperature, generator=generator)

    def step(
        self,
        state: SkeletonState,
        batch: Any,
        log_posterior_fn: LogPosteriorFn,
        generator: torch.Generator | None = None,
        adapt: int = 0,
    ) -> tuple[SkeletonState, SGMCMCInfo]:
        """One step with this kernel's hyperparameters."""
        return self.update(state, self.estimate(state, batch, log_posterior_fn, adapt), generator)

    def __repr__(self) -> str:
        return f"Skeleton(step_size={self.step_size!r}, temperature={self.temperature!r})"
