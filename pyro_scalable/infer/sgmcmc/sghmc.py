r"""Stochastic-gradient Hamiltonian Monte Carlo with a temperature (Chen et al., 2014; posteriors paper App. C).

Momentum :math:`m`, friction :math:`\alpha`, mass :math:`\sigma^2`, step size :math:`\epsilon`, temperature
:math:`T`, minibatch gradient :math:`\hat g` of the log joint and :math:`\xi \sim \mathcal{N}(0, I)`:

.. math::

    m_{t+1} &= m_t + \epsilon\,\hat g(\theta_t) - \epsilon\,\alpha\,\sigma^{-2} m_t
               + \sqrt{2\,\alpha\,\epsilon\,T}\;\xi_t, \\
    \theta_{t+1} &= \theta_t + \epsilon\,\sigma^{-2} m_{t+1} .

The continuous-time limit has stationary law :math:`\pi_T(\theta)\,\mathcal{N}(m; 0, T\sigma^2)`, for a diagonal
mass (given, or ``mass="fisher"``: the gradient-noise variance, normalised to mean 1, learnt in warm-up) and for a
positive diagonal friction (``friction`` a dict by site): friction and injected noise balance per coordinate.

**Gradient noise** (Chen et al.'s :math:`\hat B`). The gradient adds :math:`\epsilon^2 V` to the momentum's noise;
``gradient_noise="correct"`` injects :math:`2\alpha_j\epsilon T - \epsilon^2 \hat V_j` per coordinate (:math:`\hat V`
handed in with the gradient), possible where :math:`\epsilon \hat V_j \le 2\alpha_j T`; elsewhere nothing, and the
coordinate counts in ``sample_stats.uncorrected``. The gradient's noise does not scale with the temperature.

**Warm-up** (:mod:`.tuning`, ``"momentum"``) chooses :math:`\epsilon \le 0.3/\sqrt{\lambda}` and, where the friction
is left to it, the least friction per coordinate that keeps its gradient noise within half of the injected noise
(:func:`~.tuning.coordinate_frictions`; ``sample_stats.friction`` is the largest). During sampling a coordinate's
friction rises where the chain's noise average asks for more (:func:`_noise_held`).

At T = 0 SGHMC is ``torch.optim.SGD`` with momentum (:mod:`.sgd_limit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.schedules import ScalarOrSchedule, resolve
from pyro_scalable.infer.sgmcmc import base, integrators
from pyro_scalable.infer.sgmcmc.base import Latents
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite, zero_where_diverging
from pyro_scalable.infer.sgmcmc.kernel import MomentumKernel, RunConstants
from pyro_scalable.infer.sgmcmc.mass import Mass, check_mass, mass_like
from pyro_scalable.infer.sgmcmc.sgd_limit import sghmc_hyperparameters as sgd_hyperparameters

__all__ = ["SGHMC", "SGHMCInfo", "SGHMCState", "build", "init", "sgd_hyperparameters", "step", "update"]

SGHMCInfo = base.extended_info("SGHMCInfo", "friction")


class SGHMCState(NamedTuple):
    """Everything the next SGHMC step needs. Every field is a tensor."""

    latents: Latents  # unconstrained values, keyed by Pyro site name
    momenta: Latents  # same keys and shapes as latents
    checked_latents: Latents  # last point with finite density and gradient: the draw, and where a divergence returns
    step_count: Tensor  # 0-d int64


def init(latents: Latents, momenta: Latents | None = None) -> SGHMCState:
    """Start a chain at ``latents`` with zero momenta (or the given ones)."""
    if momenta is None:
        momenta = {name: torch.zeros_like(x) for name, x in latents.items()}
    zero = torch.zeros((), dtype=torch.int64, device=next(iter(latents.values())).device)
    return SGHMCState(dict(latents), dict(momenta), dict(latents), zero)


def update(
    state: SGHMCState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    friction: float | Tensor | Latents = 1.0,
    mass: Mass = 1.0,
    temperature: ScalarOrSchedule = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[SGHMCState, SGHMCInfo]:
    """Move one chain by one SGHMC step with ``gradient`` (its noise: the variance to correct); friction: per site."""
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    noise, correct = gradient.noise_variance, bool(gradient.noise_correction)  # as the program hands them
    coefficients = _coefficients(state.latents, step_size_now, temperature_now, friction, mass, noise, correct)
    decay, std, scale, noise_ratio, uncorrected, friction = coefficients
    noise = base.gaussian_like(state.latents, generator, temperature)
    momenta = integrators.momentum(state.momenta, gradient.grads, step_size_now, decay, None, noise, std=std)
    proposal = integrators.drift(state.latents, momenta, scale)
    diverging = gradient.diverging
    latents, previous = (keep_where_finite(diverging, x, state.checked_latents) for x in (proposal, state.latents))
    momenta = zero_where_diverging(diverging, momenta)
    info = SGHMCInfo(*base.shared_info(gradient, step_size_now, temperature_now, noise_ratio, uncorrected), friction)
    return SGHMCState(latents, momenta, previous, state.step_count + 1), info


@RunConstants
def _coefficients(latents, step_size_now, temperature_now, friction, mass, noise_variance, correct) -> tuple:
    """The decay, noise scale √v and drift scale ε/m per site, the noise statistics and the largest friction."""
    masses = mass_like(mass, latents)
    if isinstance(friction, dict):  # one per coordinate, as warm-up chooses it; the Info shows the largest
        frictions, friction = friction, torch.stack([f.max() for f in friction.values()]).max()
        wanted = {name: 2.0 * f * step_size_now * temperature_now for name, f in frictions.items()}
    else:
        friction = base.scalar_like(friction, step_size_now)
        frictions = dict.fromkeys(latents, friction)
        wanted = 2.0 * friction * step_size_now * temperature_now  # one for all sites
    gradient_variance = {name: step_size_now**2 * v for name, v in noise_variance.items()}  # base.noise_share
    if correct:
        frictions, friction = _noise_held(frictions, gradient_variance, step_size_now, temperature_now, masses)
        wanted = {name: 2.0 * f * step_size_now * temperature_now for name, f in frictions.items()}
    variance, noise_ratio, uncorrected = base.injected_variance(wanted, gradient_variance, correct, latents)
    decay = {name: 1.0 - step_size_now * frictions[name] / m for name, m in masses.items()}
    std = {name: v.sqrt() for name, v in variance.items()}
    return decay, std, {name: step_size_now / m for name, m in masses.items()}, noise_ratio, uncorrected, friction


def _noise_held(frictions, gradient_variance, step_size, temperature, masses) -> tuple[Latents, Tensor]:
    """Each coordinate's friction, raised to α_j ≥ ε V̄_j / (2Tρ) (at most m_j/ε) with the chain's own noise average.

    Warm-up chose the frictions from the noise it saw; where a chain's gradient is noisier (a control variate's noise
    grows away from its centre) the injected noise could not cancel it. Any positive friction keeps the law.
    """
    hot = temperature > 0
    wanted = torch.where(hot, 2.0 * step_size * temperature * base.NOISE_FRACTION, 1.0)  # the same for every site
    held = {}
    for name, f in frictions.items():
        need = torch.minimum(torch.where(hot, gradient_variance[name] / wanted, 0.0), masses[name] / step_size)
        held[name] = torch.maximum(f, need)
    return held, torch.stack([f.max() for f in held.values()]).max()


step = base.functional_step(update)
build = base.builder(init, update)


class SGHMC(MomentumKernel):
    """SGHMC for a Pyro model: binds the model and the hyperparameters; the maths is in :func:`update`.

    At ``temperature=0`` it is ``torch.optim.SGD`` with momentum (:func:`~.sgd_limit.sghmc_hyperparameters`).

    ``model``, ``gradient_noise``, ``control_variate`` and ``init_strategy`` are as for :class:`~.sgld.SGLD`.

    Args:
        step_size: ε, a constant or a schedule; ``None`` (the default) chooses it in warm-up.
        friction: α > 0; ``step_size * friction / mass`` must be below 1. ``None`` (the default) is 1.0 with a
            given step size, and chosen in warm-up with the step size otherwise, one per coordinate.
        mass: the diagonal mass: a positive scalar, a dict of positive tensors by site (broadcast to the site's
            unconstrained shape), or ``"fisher"``: the diagonal Fisher, estimated in warm-up then frozen.
        temperature: T; 1 is Bayes, 0 is SGD with momentum. A constant or a schedule.

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

    build = staticmethod(build)
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
        super().__init__(model, step_size, temperature, gradient_noise, control_variate, init_strategy)
        self.friction = self.check_friction(friction, step_size, check_mass(mass, learnt=True))
        self.mass = mass

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something: the step size (and friction) or the Fisher mass."""
        return self.step_size is None or self.mass == "fisher"

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        names = ("step_size", "friction", "mass", "temperature")
        return {name: getattr(self, name) for name in names}
