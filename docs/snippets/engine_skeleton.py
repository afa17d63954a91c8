r"""Copy-me skeleton of an SG-MCMC engine (docs/developer/adding_an_engine.md); tests/test_docs.py keeps it honest.

The update here is plain SGLD, :math:`\theta_{t+1} = \theta_t + \epsilon\,\hat g(\theta_t) + \sqrt{2\epsilon T}\,\xi_t`
(Welling & Teh, 2011), without SGLD's warm-up and gradient-noise options, so the test can check the skeleton step
for step against ``pyro_scalable.infer.sgld``. To write an engine: copy this file to
``pyro_scalable/infer/sgmcmc/<name>.py``, rename ``Skeleton``, replace the maths in :func:`update` and this
docstring (the update rule once, with its reference), and keep every signature. Warm-up is not the engine's
business: a State holds only what ``update`` reads, and where warm-up should choose a hyperparameter the class
names a rule of :mod:`pyro_scalable.infer.sgmcmc.tuning` (see docs/developer/adding_an_engine.md).
"""

from __future__ import annotations

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
    Latents,
    SGMCMCInfo,
    builder,
    functional_step,
    gaussian_like,
    injected_noise,
)
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite
from pyro_scalable.infer.sgmcmc.kernel import Kernel

__all__ = ["Skeleton", "SkeletonState", "init", "step", "update"]


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


def update(
    state: SkeletonState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SkeletonState, SGMCMCInfo]:
    """Move one chain by one step, given the minibatch gradient (estimated outside the kernel)."""
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    # The noise to inject: the wanted 2εT, less the gradient noise's share ε²V where the estimate hands V as a
    # correction (gradient_noise="correct"); without a noise estimate, 2εT and NaN statistics.
    variance, noise_ratio, uncorrected = injected_noise(
        2.0 * step_size_now * temperature_now, gradient, step_size_now**2, state.latents
    )
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = integrators.langevin(state.latents, gradient.grads, step_size_now, variance, noise)
    # A non-finite density or gradient: reject the step and go back to the last checked point.
    latents = keep_where_finite(gradient.diverging, proposal, state.checked_latents)
    checked = keep_where_finite(gradient.diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(
        gradient.log_posterior,
        gradient.grad_norm,
        step_size_now,
        temperature_now,
        gradient.diverging,
        noise_ratio,
        uncorrected,
    )
    return SkeletonState(latents, checked, state.step_count + 1), info


# ``step``: ``update`` after the minibatch gradient, for one chain outside the driver (the driver estimates the
# gradient itself and hands it to ``update``).
step = functional_step(update)
# ``build(**hyperparameters) -> Transform(init, update)``: the kernel with its hyperparameters bound, one chain's two
# pure functions; the class below runs exactly that.
build = builder(init, update)


class Skeleton(Kernel):
    """The skeleton engine for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`update`.

    :class:`~pyro_scalable.infer.sgmcmc.kernel.Kernel` gives it the calls the driver makes (``init``, ``update``,
    ``latents``, ``relocate``) from ``build`` and :meth:`hyperparameters`.

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
        StochasticMCMC(Skeleton, 2 chains x 100 draws)
        >>> mcmc.get_samples()["mu"].shape
        torch.Size([200])

    """

    build = staticmethod(build)
    adapts = False  # True where warm-up chooses something; warmup_rule then names the rule (sgmcmc/tuning.py)

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

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this class binds."""
        return {"step_size": self.step_size, "temperature": self.temperature}

    def __repr__(self) -> str:
        return f"Skeleton(step_size={self.step_size!r}, temperature={self.temperature!r})"
