r"""Stochastic-gradient Hamiltonian Monte Carlo with a temperature (Chen et al., 2014; posteriors paper App. C).

Momentum :math:`m`, friction :math:`\alpha`, mass :math:`\sigma^2`, step size :math:`\epsilon`, temperature
:math:`T`, minibatch gradient :math:`\hat g` of the log joint and :math:`\xi \sim \mathcal{N}(0, I)`:

.. math::

    m_{t+1} &= m_t + \epsilon\,\hat g(\theta_t) - \epsilon\,\alpha\,\sigma^{-2} m_t
               + \sqrt{2\,\alpha\,\epsilon\,T}\;\xi_t, \\
    \theta_{t+1} &= \theta_t + \epsilon\,\sigma^{-2} m_{t+1} .

The continuous-time limit has stationary law :math:`\pi_T(\theta)\,\mathcal{N}(m; 0, T\sigma^2)`. The
gradient-noise correction :math:`\hat\beta` of the posteriors paper is not estimated here (taken as 0).

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
from pyro_scalable.infer.sgmcmc.base import (
    Latents,
    LogPosteriorFn,
    SGMCMCInfo,
    evaluate,
    gaussian_like,
    keep_where_finite,
)

__all__ = ["SGHMC", "SGHMCState", "init", "sgd_hyperparameters", "step"]


class SGHMCState(NamedTuple):
    """Everything the next SGHMC step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # same keys and shapes as latents
    checked_latents: (
        Latents  # last point with finite density and gradient: the draw, and where a diverging step returns
    )
    step_count: Tensor  # 0-d int64


def init(latents: Latents, momenta: Latents | None = None) -> SGHMCState:
    """Start a chain at ``latents`` with zero momenta (or the given ones)."""
    first = next(iter(latents.values()))
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    return SGHMCState(dict(latents), dict(momenta), dict(latents), zero)


def step(
    state: SGHMCState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule,
    friction: float = 1.0,
    mass: float = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SGHMCState, SGMCMCInfo]:
    """Advance one chain by one SGHMC step on ``batch``."""
    grads, log_posterior, grad_norm, diverging = evaluate(log_posterior_fn, state.latents, batch)
    eps = resolve(step_size, state.step_count, log_posterior)
    temp = resolve(temperature, state.step_count, log_posterior)
    decay = 1.0 - eps * friction / mass
    noise_scale = torch.sqrt(2.0 * friction * eps * temp)
    noise = gaussian_like(state.latents, generator, temperature)
    momenta = {name: decay * m + eps * grads[name] + noise_scale * noise[name] for name, m in state.momenta.items()}
    proposal = {name: x + (eps / mass) * momenta[name] for name, x in state.latents.items()}
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    momenta = {name: torch.where(diverging, m.new_zeros(()), m) for name, m in momenta.items()}
    info = SGMCMCInfo(log_posterior, grad_norm, eps, temp, diverging)
    return SGHMCState(latents, momenta, previous, state.step_count + 1), info


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


class SGHMC:
    """SGHMC for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`step`.

    With ``temperature=0`` the trajectory is that of ``torch.optim.SGD(lr=step_size**2 / mass,
    momentum=1 - step_size * friction / mass)`` minimising the negative log joint (see the module docstring).

    Args:
        model: a Pyro model whose likelihood sits in a subsampled ``pyro.plate``; kept as ``self.model``, a
            :class:`~pyro_scalable.bridge.FullDataModel` (the same model on the full data).
        step_size: ε, a constant or a schedule (:mod:`pyro_scalable.infer.schedules`).
        friction: α > 0; ``step_size * friction / mass`` must be below 1.
        mass: σ², a positive scalar.
        temperature: T; 1 is Bayes, 0 is SGD with momentum. A constant or a schedule.
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
        step_size: ScalarOrSchedule,
        friction: float = 1.0,
        mass: float = 1.0,
        temperature: ScalarOrSchedule = 1.0,
        *,
        init_strategy: Callable = init_to_uniform,
    ):
        check_positive("step_size", step_size)
        check_positive("friction", friction)
        check_positive("mass", mass)
        check_positive("temperature", temperature, allow_zero=True)
        largest = float(step_size(torch.zeros(())) if callable(step_size) else step_size)  # schedules start highest
        if largest * friction / mass >= 1.0:
            raise ValueError(
                f"step_size * friction / mass must be below 1 (got {largest * friction / mass:.3g}): "
                "the momentum would change sign every step. Lower the step size or the friction."
            )
        self.model = FullDataModel(model)
        self.step_size = step_size
        self.friction = friction
        self.mass = mass
        self.temperature = temperature
        self.init_strategy = init_strategy

    def init(self, latents: Latents) -> SGHMCState:
        """Start a chain at unconstrained ``latents`` with zero momenta."""
        return init(latents)

    def step(
        self, state: SGHMCState, batch: Any, log_posterior_fn: LogPosteriorFn, generator: torch.Generator | None = None
    ) -> tuple[SGHMCState, SGMCMCInfo]:
        """One step with this kernel's hyperparameters."""
        return step(
            state,
            batch,
            log_posterior_fn,
            step_size=self.step_size,
            friction=self.friction,
            mass=self.mass,
            temperature=self.temperature,
            generator=generator,
        )

    def __repr__(self) -> str:
        return (
            f"SGHMC(step_size={self.step_size!r}, friction={self.friction!r}, mass={self.mass!r}, "
            f"temperature={self.temperature!r})"
        )
