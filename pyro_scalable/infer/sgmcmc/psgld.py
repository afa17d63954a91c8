r"""Preconditioned SGLD with an RMSprop preconditioner (pSGLD; Li, Chen, Carlson & Carin, 2016).

With :math:`\hat g` the minibatch gradient of the log joint, a diagonal preconditioner from a moving average of its
square,

.. math::

    v_{t} = \beta v_{t-1} + (1 - \beta)\,\hat g \odot \hat g, \qquad
    G = \mathrm{diag}\big(1 / (\delta + \sqrt{v_t})\big),

and the SGLD step in the metric :math:`G` (in our convention :math:`\epsilon` is Li et al.'s :math:`\epsilon/2`):

.. math::

    \theta_{t+1} = \theta_t + \epsilon\, G \hat g(\theta_t) + \epsilon\, T\, \Gamma(\theta_t)
        + \mathcal{N}(0, 2 \epsilon T G), \qquad \Gamma_i = \sum_j \partial G_{ij} / \partial\theta_j .

Coordinates with a large gradient (stiff directions) get small steps and flat ones large steps: on a Gaussian
target with exact gradients, :math:`v_j \approx \lambda_j` at stationarity, so :math:`G_j \approx
\lambda_j^{-1/2}` and the condition number the sampler sees is the square root of the target's.

**The correction term** :math:`\Gamma`. By default (``preconditioner="warmup"``) :math:`v` is learnt in the
calibrated part of warm-up (burn-in runs with :math:`G = I`, far-off gradients would make :math:`v` too large;
:math:`v` starts at the first calibrated step's :math:`\hat g^2`) and then frozen: during sampling :math:`G` is a
constant, :math:`\Gamma = 0` exactly, and the chain is SGLD in a fixed metric, with the same stationary law
:math:`\pi_T` up to discretisation. With ``preconditioner="always"`` (Li et al.'s algorithm) :math:`v` keeps moving;
:math:`G` is then a function of the path, not of :math:`\theta`, :math:`\Gamma` is not defined as a function of the
state, and, as Li et al. do, it is left out; the bias this leaves shrinks with :math:`1 - \beta`.

**Gradient noise.** The gradient brings :math:`\epsilon^2 G V G` into a step that should carry :math:`2\epsilon T
G`: ``gradient_noise="correct"`` injects :math:`2\epsilon T G_j - \epsilon^2 G_j^2 \hat V_j`, possible where
:math:`\epsilon G_j \hat V_j \le 2T`. **Step size**: ``step_size=None`` chooses
:math:`\epsilon = \min(0.1/\lambda, \rho\,2T/\max_j G_j \bar V_j)` in warm-up, :math:`\lambda` the largest
curvature of :math:`G^{1/2} H G^{1/2}` (:mod:`.adaptation`, which also learns :math:`v` in ``"warmup"`` mode
with :func:`accumulate`).

T = 0 with ``preconditioner="always"`` is exactly ``torch.optim.RMSprop(lr=step_size, alpha=decay, eps=damping)``
on the negative log joint (the tests check it); with ``"warmup"`` the preconditioner is frozen after warm-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.bridge.model import FullDataModel
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive, resolve
from pyro_scalable.infer.sgmcmc import integrators
from pyro_scalable.infer.sgmcmc.base import (
    GradientEstimate,
    Kernel,
    Latents,
    LogPosteriorFn,
    SGMCMCInfo,
    check_gradient_noise,
    estimate,
    gaussian_like,
    injected_variance,
    noise_in_step,
    noise_start,
)
from pyro_scalable.infer.sgmcmc.control_variates import check_control_variate
from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite

__all__ = ["PSGLD", "PSGLDState", "accumulate", "estimate", "init", "preconditioner", "step", "update"]

Updates = Literal["warmup", "always"]


class PSGLDState(NamedTuple):
    """Everything the next pSGLD step needs. Every field is a tensor."""

    latents: Latents
    checked_latents: Latents  # last point with finite density and gradient (the draw)
    square_avg: Latents  # v: moving average of the squared gradient
    square_count: Tensor  # 0-d: updates of v so far (before the first, G is the identity)
    step_count: Tensor  # 0-d int64
    noise_average: Latents  # moving average of the gradient-noise variance ({} where it is not estimated)


def init(latents: Latents, *, gradient_noise: str = "ignore") -> PSGLDState:
    """Start a chain at ``latents`` with no preconditioner learnt yet."""
    first = next(iter(latents.values()))
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    squares = {name: torch.zeros_like(x) for name, x in latents.items()}
    return PSGLDState(dict(latents), dict(latents), squares, zero, zero, noise_start(latents, gradient_noise))


def preconditioner(state: PSGLDState, damping: float = 1e-5) -> Latents:
    """G's diagonal, by site: ``1 / (damping + sqrt(v))`` (the identity before the first update of v)."""
    count = state.square_count
    return {
        name: torch.where(count > 0, 1.0 / (damping + torch.sqrt(v)), torch.ones_like(v))
        for name, v in state.square_avg.items()
    }


def accumulate(state: PSGLDState, gradient: GradientEstimate, decay: float, *, restart: bool = False) -> PSGLDState:
    """Fold ``gradient``'s square into v (a diverging step leaves v alone).

    ``restart`` starts v at the first update's ĝ² instead of RMSprop's ``(1 - β) ĝ²``: a v learnt in warm-up and then
    frozen must not carry RMSprop's start-up bias ``(1 - β^t) v``.
    """
    keep = gradient.diverging
    first = (state.square_count == 0) if restart else torch.zeros_like(keep)
    squares = {
        name: torch.where(
            keep,
            v,
            torch.where(
                first, gradient.grads[name].square(), decay * v + (1.0 - decay) * gradient.grads[name].square()
            ),
        )
        for name, v in state.square_avg.items()
    }
    count = state.square_count + (~keep).to(state.square_count.dtype)
    return state._replace(square_avg=squares, square_count=count)


def update(
    state: PSGLDState,
    gradient: GradientEstimate,
    *,
    step_size: ScalarOrSchedule | Tensor,
    temperature: ScalarOrSchedule = 1.0,
    decay: float = 0.99,
    damping: float = 1e-5,
    updates: Updates = "warmup",
    gradient_noise: str = "ignore",
    noise_every: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[PSGLDState, SGMCMCInfo]:
    """Move one chain by one pSGLD step with the gradient ``gradient`` (from :func:`estimate`).

    ``updates="always"`` folds every gradient into v first; with ``"warmup"`` v stays as it is (warm-up learns it).
    """
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    if updates == "always":
        state = accumulate(state, gradient, decay)
    metric = preconditioner(state, damping)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    noise_average, gradient_variance = noise_in_step(
        state, gradient, gradient_noise, lambda name: step_size_now**2 * metric[name].square(), noise_every
    )
    wanted = {name: 2.0 * step_size_now * temperature_now * g for name, g in metric.items()}
    variance, noise_ratio, uncorrected = injected_variance(
        wanted, gradient_variance, gradient_noise == "correct", state.latents
    )
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = integrators.langevin(state.latents, gradient.grads, step_size_now, variance, noise, metric)
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(
        gradient.log_posterior, gradient.grad_norm, step_size_now, temperature_now, diverging, noise_ratio, uncorrected
    )
    new = state._replace(
        latents=latents, checked_latents=previous, step_count=state.step_count + 1, noise_average=noise_average
    )
    return new, info


def step(
    state: PSGLDState,
    batch: Any,
    log_posterior_fn: LogPosteriorFn,
    *,
    step_size: ScalarOrSchedule | Tensor,
    temperature: ScalarOrSchedule = 1.0,
    decay: float = 0.99,
    damping: float = 1e-5,
    updates: Updates = "warmup",
    gradient_noise: str = "ignore",
    generator: torch.Generator | None = None,
) -> tuple[PSGLDState, SGMCMCInfo]:
    """Advance one chain by one pSGLD step on ``batch`` (:func:`estimate` then :func:`update`)."""
    gradient = estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise)
    return update(
        state,
        gradient,
        step_size=step_size,
        temperature=temperature,
        decay=decay,
        damping=damping,
        updates=updates,
        gradient_noise=gradient_noise,
        generator=generator,
    )


class PSGLD(Kernel):
    r"""Preconditioned SGLD (RMSprop metric) for a Pyro model; the maths is in the module docstring.

    Args:
        model: a Pyro model whose likelihood sits in a subsampled ``pyro.plate``; kept as ``self.model``, a
            :class:`~pyro_scalable.bridge.FullDataModel`.
        step_size: ε, a constant or a schedule; ``None`` (the default) chooses it in warm-up.
        temperature: T; 1 is Bayes, 0 is preconditioned gradient ascent.
        decay: β of the moving average of the squared gradient (RMSprop's ``alpha``).
        damping: δ added to :math:`\sqrt{v}` (RMSprop's ``eps``).
        preconditioner: ``"warmup"`` learns v in warm-up and freezes it (the correction term Γ is then exactly
            0), ``"always"`` updates it every step as Li et al. do (Γ left out).
        gradient_noise: ``"correct"``, ``"estimate"`` or ``"ignore"``, as for :class:`~.sgld.SGLD`.
        control_variate: the centre of a control-variate gradient (:mod:`.control_variates`): ``"map"`` (found
            before the run), ``"warmup"`` (each of warm-up's metric windows' mean in turn), a dict of latent values
            by site, or a trained autoguide; ``None``: plain minibatch gradients; ``"auto"`` (the default): ``"map"``
            where warm-up chooses the step and ``N/B ≥ 10``, ``"warmup"`` for a hierarchy at ``N/B ≥ 4``
            (:func:`~pyro_scalable.infer.sgmcmc.control_choice.choose`).
        init_strategy: a Pyro init strategy, one draw per chain.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import PSGLD, StochasticMCMC
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=20) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> mcmc = StochasticMCMC(PSGLD(model), num_samples=100, num_warmup=100, num_chains=2,
        ...                       progress_bar=False, seed=0)
        >>> mcmc.run(torch.randn(500) + 3.0)
        StochasticMCMC(PSGLD, 2 chains x 100 draws)
        >>> mcmc.get_samples()["mu"].shape
        torch.Size([200])

    """

    init_rule = staticmethod(init)
    update_rule = staticmethod(update)
    warmup_rule = "preconditioned"

    def __init__(
        self,
        model: Callable,
        step_size: ScalarOrSchedule | None = None,
        temperature: ScalarOrSchedule = 1.0,
        *,
        decay: float = 0.99,
        damping: float = 1e-5,
        preconditioner: Updates = "warmup",
        gradient_noise: str | None = None,
        control_variate: Any = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        if step_size is not None:
            check_positive("step_size", step_size)
        check_positive("temperature", temperature, allow_zero=True)
        check_positive("damping", damping)
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}.")
        if preconditioner not in ("warmup", "always"):
            raise ValueError(f"preconditioner must be 'warmup' or 'always', got {preconditioner!r}.")
        self.model = FullDataModel(model)
        self.step_size = step_size
        self.temperature = temperature
        self.decay = float(decay)
        self.damping = float(damping)
        self.preconditioner = preconditioner
        self.gradient_noise = check_gradient_noise(gradient_noise, step_size)
        self.control_variate = check_control_variate(control_variate)
        self.init_strategy = init_strategy

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something: the step size, or the preconditioner it then freezes."""
        return self.step_size is None or self.preconditioner == "warmup"

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        return {
            "step_size": self.step_size,
            "temperature": self.temperature,
            "decay": self.decay,
            "damping": self.damping,
            "updates": self.preconditioner,
            "gradient_noise": self.gradient_noise,
        }

    def __repr__(self) -> str:
        return (
            f"PSGLD(step_size={self.step_size!r}, temperature={self.temperature!r}, decay={self.decay!r}, "
            f"preconditioner={self.preconditioner!r}, gradient_noise={self.gradient_noise!r})"
        )
