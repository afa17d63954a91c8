r"""Cyclical SGLD: a cosine cycle of the step size, exploring at T = 0, then sampling (Zhang et al. 2020).

Zhang, Li, Zhang, Chen & Wilson, "Cyclical stochastic gradient MCMC for Bayesian deep learning" (ICLR 2020),
Algorithm 1. The run is cut into cycles of :math:`L` steps, counted from its first step. At step :math:`t`, with
:math:`r_t = (t \bmod L)/L` the position in its cycle, the step size falls along a cosine from :math:`\epsilon_0` to
near 0,

.. math::

    \epsilon_t = \frac{\epsilon_0}{2}\big(\cos(\pi r_t) + 1\big),

and the cycle's first share :math:`\beta` **explores**: :math:`T_t = 0`, gradient ascent with large steps towards a
mode (a new one each cycle, on a multimodal posterior); the rest **samples**: SGLD's update (:mod:`.sgld`),

.. math::

    \theta_{t+1} = \theta_t + \epsilon_t\,\hat g(\theta_t) + \sqrt{2\epsilon_t T_t}\,\xi_t,
    \qquad T_t = T\,[\,r_t \ge \lceil\beta L\rceil / L\,],

and only the sampling stage's draws are kept (:class:`~.kept.CycleStage`, the kernel's kept-draws policy). The
exploration stage's draws are no posterior draws: the driver never records them.

On a Gaussian target :math:`\mathcal N(0, \sigma^2)` with exact gradients the law of the chain is known step by step
(:math:`a_t = 1 - \epsilon_t/\sigma^2`): its mean is multiplied by :math:`a_t` and its variance becomes
:math:`a_t^2 v_t + 2\epsilon_t T_t` — the gold test compares the kept draws of many chains with that recursion.
Within a sampling stage the chain is not at the posterior (its steps shrink as it goes): cyclical SGLD trades that
bias for visiting several modes; on a unimodal posterior SGLD or SGHMC at the defaults is the better choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.arguments import check_count
from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive, resolve
from pyro_scalable.infer.sgmcmc import sgld
from pyro_scalable.infer.sgmcmc.base import SGMCMCInfo, builder, functional_step
from pyro_scalable.infer.sgmcmc.kept import CycleStage
from pyro_scalable.infer.sgmcmc.sgld import SGLD, SGLDState, init

__all__ = ["CyclicalSGLD", "build", "init", "step", "update"]


def update(
    state: SGLDState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule,
    cycle_length: int,
    exploration: float = 0.5,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SGLDState, SGMCMCInfo]:
    """One cyclical SGLD step: SGLD's update at this step's step size and temperature (module docstring)."""
    like, stage = gradient.log_posterior, math.ceil(exploration * cycle_length)

    def cycled_step_size(count: Tensor) -> Tensor:
        position = torch.remainder(count, cycle_length).to(like.dtype)
        return resolve(step_size, count, like) * 0.5 * (torch.cos(math.pi * position / cycle_length) + 1.0)

    def cycled_temperature(count: Tensor) -> Tensor:
        sampling = torch.remainder(count, cycle_length) >= stage
        return torch.where(sampling, resolve(temperature, count, like), torch.zeros_like(like))

    return sgld.update(
        state,
        gradient,
        step_size=cycled_step_size,
        temperature=cycled_temperature,
        generator=generator,
    )


step = functional_step(update)
build = builder(init, update)


class CyclicalSGLD(SGLD):
    """Cyclical SGLD for a Pyro model: cosine cycles of the step size, draws kept from each cycle's sampling stage.

    Args:
        model: a Pyro model, as for :class:`~.sgld.SGLD`.
        step_size: ε₀, each cycle's first (largest) step; a constant or a schedule.
        cycle_length: L, steps per cycle, counted from the run's first step (warm-up's included).
        exploration: β, the share of each cycle spent exploring at T = 0, whose draws are not kept.
        temperature: T in the sampling stages; a constant or a schedule.
        control_variate: as for :class:`~.sgld.SGLD` (``None``: plain minibatch gradients).
        init_strategy: a Pyro init strategy, one draw per chain.

    ``StochasticMCMC(..., num_samples=K)`` keeps K draws per chain from the sampling stages (``thin`` thins within
    them) and runs as many cycles as that takes; ``sample_stats`` has each kept draw's ``step_size`` and
    ``temperature``.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import CyclicalSGLD, StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> kernel = CyclicalSGLD(model, step_size=2e-3, cycle_length=100, exploration=0.5)
        >>> mcmc = StochasticMCMC(kernel, num_samples=100, num_chains=2, progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)  # two cycles: 50 kept draws from each one's second half
        StochasticMCMC(CyclicalSGLD, 2 chains x 100 draws)
        >>> bool((mcmc.sample_stats["temperature"] == 1.0).all())  # no exploration draw kept
        True

    """

    build = staticmethod(build)

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule,
        cycle_length: int,
        exploration: float = 0.5,
        temperature: ScalarOrSchedule = 1.0,
        *,
        control_variate: Any = None,
        init_strategy: Callable = init_to_uniform,
    ):
        if step_size is None:
            raise ValueError("CyclicalSGLD needs step_size: each cycle's first (largest) step, ε₀.")
        check_positive("step_size", step_size)
        self.cycle_length = check_count("cycle_length", cycle_length)
        CycleStage(self.cycle_length, exploration)  # refuses a share outside [0, 1), or a cycle keeping no draw
        self.exploration = float(exploration)
        super().__init__(
            model,
            step_size,
            temperature,
            gradient_noise="ignore",
            control_variate=control_variate,
            init_strategy=init_strategy,
        )

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        return {**super().hyperparameters(), "cycle_length": self.cycle_length, "exploration": self.exploration}

    def kept_draws(self, thin: int) -> CycleStage:
        """The sampling stage of every cycle, thinned by ``thin`` there."""
        return CycleStage(self.cycle_length, self.exploration, thin)
