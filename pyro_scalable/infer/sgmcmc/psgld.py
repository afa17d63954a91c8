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

On a Gaussian with exact gradients :math:`G_j \approx \lambda_j^{-1/2}`: the sampler sees the square root of the
target's condition number. With ``preconditioner="warmup"`` (the default) :math:`v` is learnt in the calibrated part
of warm-up (from its first :math:`\hat g^2`) and then frozen, so :math:`\Gamma = 0` exactly; with ``"always"`` (Li et
al.'s algorithm) :math:`v` keeps moving and :math:`\Gamma` is left out, as they do (a bias that shrinks with
:math:`1 - \beta`; at T = 0 this is exactly ``torch.optim.RMSprop(lr=step_size, alpha=decay, eps=damping)``).

**Gradient noise.** ``gradient_noise="correct"`` injects :math:`2\epsilon T G_j - \epsilon^2 G_j^2 \hat V_j`, possible
where :math:`\epsilon G_j \hat V_j \le 2T`. **Warm-up** (:mod:`.tuning`, ``"preconditioned"``) chooses SGLD's step in
the metric :math:`G` and, with ``"warmup"``, has the update learn :math:`v` (``updates="learn"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor

from pyro_scalable.infer.gradients import GradientEstimate
from pyro_scalable.infer.schedules import ScalarOrSchedule, check_positive, resolve
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

__all__ = ["PSGLD", "PSGLDState", "accumulate", "build", "init", "preconditioner", "step", "update"]

Updates = Literal["warmup", "always", "learn"]


class PSGLDState(NamedTuple):
    """Everything the next pSGLD step needs. Every field is a tensor."""

    latents: Latents
    checked_latents: Latents  # last point with finite density and gradient (the draw)
    square_avg: Latents  # v: moving average of the squared gradient
    square_count: Tensor  # 0-d: updates of v so far (before the first, G is the identity)
    step_count: Tensor  # 0-d int64


def init(latents: Latents) -> PSGLDState:
    """Start a chain at ``latents`` with no preconditioner learnt yet."""
    first = next(iter(latents.values()))
    zero = torch.zeros((), dtype=torch.int64, device=first.device)
    squares = {name: torch.zeros_like(x) for name, x in latents.items()}
    return PSGLDState(dict(latents), dict(latents), squares, zero, zero)


def preconditioner(state: PSGLDState, damping: float = 1e-5) -> Latents:
    """G's diagonal, by site: ``1 / (damping + sqrt(v))`` (the identity before the first update of v)."""
    learnt, v = state.square_count > 0, state.square_avg
    return {name: torch.where(learnt, 1.0 / (damping + torch.sqrt(x)), torch.ones_like(x)) for name, x in v.items()}


def accumulate(state: PSGLDState, gradient: GradientEstimate, decay: float, *, restart: bool = False) -> PSGLDState:
    """Fold ``gradient``'s square into v (not on a diverging step); ``restart``: from ĝ², without RMSprop's bias."""
    keep = gradient.diverging
    first = (state.square_count == 0) if restart else torch.zeros_like(keep)
    squares = {}
    for name, v in state.square_avg.items():
        g2 = gradient.grads[name].square()
        squares[name] = torch.where(keep, v, torch.where(first, g2, decay * v + (1.0 - decay) * g2))
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
    generator: torch.Generator | None = None,
) -> tuple[PSGLDState, SGMCMCInfo]:
    """Move one chain by one pSGLD step with ``gradient`` (its noise: the variance to correct).

    ``updates``: ``"always"`` folds the gradient into v first, ``"learn"`` too (warm-up, with ``restart``).
    """
    temperature_now = resolve(temperature, state.step_count, gradient.log_posterior)
    if updates != "warmup":
        state = accumulate(state, gradient, decay, restart=updates == "learn")
    metric = preconditioner(state, damping)
    step_size_now = resolve(step_size, state.step_count, gradient.log_posterior)
    wanted = {name: 2.0 * step_size_now * temperature_now * g for name, g in metric.items()}
    share = lambda site: step_size_now**2 * metric[site].square()  # noqa: E731 -- the gradient noise's in the update
    variance, noise_ratio, uncorrected = injected_noise(wanted, gradient, share, state.latents)
    noise = gaussian_like(state.latents, generator, temperature)
    proposal = integrators.langevin(state.latents, gradient.grads, step_size_now, variance, noise, metric)
    diverging = gradient.diverging
    latents = keep_where_finite(diverging, proposal, state.checked_latents)
    previous = keep_where_finite(diverging, state.latents, state.checked_latents)
    info = SGMCMCInfo(*shared_info(gradient, step_size_now, temperature_now, noise_ratio, uncorrected))
    return state._replace(latents=latents, checked_latents=previous, step_count=state.step_count + 1), info


step = functional_step(update)
build = builder(init, update)


class PSGLD(Kernel):
    r"""Preconditioned SGLD (RMSprop metric) for a Pyro model; the maths is in the module docstring.

    ``model``, ``gradient_noise``, ``control_variate`` and ``init_strategy`` are as for :class:`~.sgld.SGLD`.

    Args:
        step_size: ε, a constant or a schedule; ``None`` (the default) chooses it in warm-up.
        temperature: T; 1 is Bayes, 0 is preconditioned gradient ascent.
        decay: β of the moving average of the squared gradient (RMSprop's ``alpha``).
        damping: δ added to :math:`\sqrt{v}` (RMSprop's ``eps``).
        preconditioner: ``"warmup"`` learns v in warm-up, then freezes it (Γ = 0); ``"always"``: Li et al.'s.

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

    build = staticmethod(build)
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
        super().__init__(model, step_size, temperature, gradient_noise, control_variate, init_strategy)
        check_positive("damping", damping)
        if not 0.0 < float(decay) < 1.0 or preconditioner not in ("warmup", "always"):
            raise ValueError(
                f"need 0 < decay < 1 and preconditioner 'warmup' or 'always'; got {decay=}, {preconditioner=}."
            )
        self.decay, self.damping, self.preconditioner = float(decay), float(damping), preconditioner

    @property
    def adapts(self) -> bool:
        """Whether warm-up chooses something: the step size, or the preconditioner it then freezes."""
        return self.step_size is None or self.preconditioner == "warmup"

    def metric(self, state: PSGLDState, gradient: GradientEstimate | None = None, *, restart: bool = False) -> Latents:
        """G in ``state``, or after folding ``gradient`` into v (:func:`accumulate`), as this step's update will."""
        if gradient is not None:
            state = accumulate(state, gradient, self.decay, restart=restart)
        return preconditioner(state, self.damping)

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of :func:`update` this kernel binds."""
        bound = {name: getattr(self, name) for name in ("step_size", "temperature", "decay", "damping")}
        return {**bound, "updates": self.preconditioner}
