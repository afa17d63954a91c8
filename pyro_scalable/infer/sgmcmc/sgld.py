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
    Latents,
    LogPosteriorFn,
    SGMCMCInfo,
    evaluate,
    gaussian_like,
    keep_where_finite,
)

__all__ = ["SGLD", "SGLDState", "init", "step"]


class SGLDState(NamedTuple):
    """Everything the next SGLD step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    checked_latents: (
        Latents  # last point with finite density and gradient: the draw, and where a diverging step returns
    )
    step_count: Tensor  # 0-d int64


def init(latents: Latents) -> SGLDState:
    """Start a chain at unconstrained ``latents``."""
    first = next(iter(latents.values()))
    return SGLDState(dict(latents), dict(latents), torch.zeros((), dtype=torch.int64, device=first.device))


def step(
    state: SGLDState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SGLDState, SGMCMCInfo]:
    """Advance one chain by one SGLD step on ``batch``."""
    grads, log_posterior, grad_norm, diverging = evaluate(log_posterior_fn, state.latents, batch)
    eps = resolve(step_size, state.step_count, log_posterior)
    temp = resolve(temperature, state.step_count, log_posterior)
    noise_scale = torch.sqrt(2.0 * eps * temp)
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = {name: x + eps * grads[name] + noise_scale * noise[name] for name, x in state.latents.items()}
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(log_posterior, grad_norm, eps, temp, diverging)
    return SGLDState(latents, previous, state.step_count + 1), info


class SGLD:
    """SGLD for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`step`.

    ``model`` is kept as ``self.model``, a :class:`~pyro_scalable.bridge.FullDataModel`: the same model with
    subsampling switched off, which is what ``Predictive`` and ``arviz.from_pyro`` should run (the model as written
    is ``self.model.model``). With ``temperature=0`` the trajectory is that of
    ``torch.optim.SGD(params, lr=step_size)`` minimising the negative log joint.

    Args:
        model: a Pyro model whose likelihood sits in ``pyro.plate(name, N, subsample_size=B)`` (or
            ``subsample=idx``), so that it returns an unbiased estimate of the full-data log joint.
        step_size: ε, a constant or a schedule (:mod:`pyro_scalable.infer.schedules`).
        temperature: T; 1 is Bayes, 0 is SGD. A constant or a schedule.
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
        step_size: ScalarOrSchedule,
        temperature: ScalarOrSchedule = 1.0,
        *,
        init_strategy: Callable = init_to_uniform,
    ):
        check_positive("step_size", step_size)
        check_positive("temperature", temperature, allow_zero=True)
        self.model = FullDataModel(model)
        self.step_size = step_size
        self.temperature = temperature
        self.init_strategy = init_strategy

    def init(self, latents: Latents) -> SGLDState:
        """Start a chain at unconstrained ``latents``."""
        return init(latents)

    def step(
        self, state: SGLDState, batch: Any, log_posterior_fn: LogPosteriorFn, generator: torch.Generator | None = None
    ) -> tuple[SGLDState, SGMCMCInfo]:
        """One step with this kernel's hyperparameters."""
        return step(
            state,
            batch,
            log_posterior_fn,
            step_size=self.step_size,
            temperature=self.temperature,
            generator=generator,
        )

    def __repr__(self) -> str:
        return f"SGLD(step_size={self.step_size!r}, temperature={self.temperature!r})"
