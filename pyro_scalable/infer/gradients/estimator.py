r"""The gradient estimator: what a stochastic-gradient kernel is handed, as one object with a state of its own.

A :class:`GradientEstimator` estimates the gradient of one :class:`~.density.MinibatchDensity` at each chain's
latents on each minibatch, batched over chains as the rest of a chain's state is:

* ``init(latents) -> EstimatorState``: a chain's estimator state at the start;
* ``measure(latents, batch, noise_every) -> GradientEstimate``: the raw estimate on this minibatch, with the
  diagonal of its noise where ``noise_every > 0`` and the estimator measures it (this is the half of a step that a
  data-parallel run all-reduces, :mod:`pyro_scalable.infer.sgmcmc.distributed`);
* ``fold(state, estimate, noise_every) -> (GradientEstimate, EstimatorState)``: the estimate as a kernel takes it
  (its ``noise_variance`` the noise's moving average where the estimator keeps one), and the new state;
* ``estimate(state, latents, batch, noise_every)``: ``fold`` after ``measure``, for one chain;
* ``every_chain(latents, batch, noise_every)``: ``measure`` for every chain at once (latents with a leading chain
  dimension), outside vmap (:func:`~.estimate.chains_estimate`);
* ``over(density)``: the same kind of estimator of another density.

``noise_every`` is a Python int, the same for every chain: a measurement stands for that many steps in the moving
average (it is taken on every fourth step of sampling, :func:`~pyro_scalable.infer.sgmcmc.base.noise_phase`), 0
where this step measures nothing.

**The implementations** compose as BlackJAX's gradient estimators do, a new estimator around an old one's density:

* :class:`PlainGradient`: the minibatch gradient :math:`\hat g = \nabla\log\hat p(\theta \mid \mathcal{B})`;
* :class:`NoiseEstimatingGradient`: the same, with the per-example (or per-group) estimate of the diagonal of its
  covariance :math:`\hat V` on the steps that measure it, folded into a moving average over about
  :data:`~.noise.NOISE_WINDOW` steps (weight :math:`k/(t+k)`, at least :math:`k/50`, for a measurement standing for
  :math:`k` steps): a kernel that corrects for the noise subtracts the average, not one step's noisy
  :math:`\hat V`, which it would clip at zero where too large;
* :func:`control_variate`: the estimator of :class:`~.controlled.ControlledDensity`,
  :math:`\hat g(\theta) - \hat g(c) + \nabla\log p(c \mid \mathcal{D})` around a centre :math:`c` (an unbiased
  estimate whose noise shrinks with :math:`\lVert\theta - c\rVert`; measured on the difference itself);
* :func:`whitened`: the estimator of :class:`~.whitened.WhitenedDensity`, in warm-up's metric's variables
  :math:`z` with :math:`\theta = \mu + Lz` (:math:`\hat g_z = L^\top \hat g_\theta`).

The control variate and the metric are densities, not estimators around an estimator, because the noise of the
controlled gradient is that of the difference per example, which two estimates taken apart cannot give.

A run's default is :class:`NoiseEstimatingGradient` in warm-up (which chooses the step size from the noise) and
wherever the kernel corrects for or reports the noise, :class:`PlainGradient` where it ignores it; a user may pass
any :class:`Estimator` subclass as ``StochasticMCMC(kernel, gradient=...)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.infer.gradients.controlled import ControlledDensity
from pyro_scalable.infer.gradients.density import MinibatchDensity, as_density
from pyro_scalable.infer.gradients.estimate import GradientEstimate, chains_estimate, estimate_gradient
from pyro_scalable.infer.gradients.noise import average_noise

__all__ = [
    "Estimator",
    "EstimatorState",
    "GradientEstimator",
    "NoiseEstimatingGradient",
    "PlainGradient",
    "control_variate",
    "whitened",
]


class EstimatorState(NamedTuple):
    """A chain's gradient-estimator state: the noise's moving average and the estimates folded in. Tensors only."""

    noise: Latents  # moving average of the diagonal gradient-noise variance per site ({} where none is kept)
    count: Tensor  # 0-d int64: the estimates folded in (the moving average's t)


@runtime_checkable
class GradientEstimator(Protocol):
    """The minibatch gradient of :attr:`density` with its state (module docstring: the contract)."""

    density: MinibatchDensity
    measures_noise: bool  # whether measure() estimates the noise where asked and fold() averages it

    def init(self, latents: Latents) -> EstimatorState:
        """A chain's state at ``latents`` (the latents of one chain)."""

    def measure(self, latents: Latents, batch: Any, noise_every: int = 0) -> GradientEstimate:
        """The raw estimate on ``batch`` (its noise where ``noise_every > 0``)."""

    def fold(
        self, state: EstimatorState, estimate: GradientEstimate, noise_every: int = 0
    ) -> tuple[GradientEstimate, EstimatorState]:
        """The estimate as a kernel takes it, and the state with it folded in."""

    def estimate(
        self, state: EstimatorState, latents: Latents, batch: Any, noise_every: int = 0
    ) -> tuple[GradientEstimate, EstimatorState]:
        """:meth:`fold` after :meth:`measure`."""

    def every_chain(self, latents: Latents, batch: Batch, noise_every: int = 0) -> GradientEstimate:
        """:meth:`measure` for every chain at once (a leading chain dimension)."""

    def over(self, density: MinibatchDensity) -> GradientEstimator:
        """The same kind of estimator of ``density``."""


class Estimator:
    """A base for a :class:`GradientEstimator` of ``density``: the minibatch gradient, no noise kept.

    A subclass overrides what it changes (``measure`` to transform the raw estimate, ``fold`` to keep something
    else); ``over`` builds the same class around another density, so a subclass whose constructor takes more than
    the density overrides it too.
    """

    measures_noise = False

    def __init__(self, density: Any):
        self.density: MinibatchDensity = as_density(density)

    def init(self, latents: Latents) -> EstimatorState:
        first = next(iter(latents.values()))
        return EstimatorState({}, torch.zeros((), dtype=torch.int64, device=first.device))

    def measure(self, latents: Latents, batch: Any, noise_every: int = 0) -> GradientEstimate:
        return estimate_gradient(self.density, latents, batch, noise=self.measures_noise and bool(noise_every))

    def fold(
        self, state: EstimatorState, estimate: GradientEstimate, noise_every: int = 0
    ) -> tuple[GradientEstimate, EstimatorState]:
        return estimate._replace(noise_variance={}), EstimatorState(state.noise, state.count + 1)

    def estimate(
        self, state: EstimatorState, latents: Latents, batch: Any, noise_every: int = 0
    ) -> tuple[GradientEstimate, EstimatorState]:
        return self.fold(state, self.measure(latents, batch, noise_every), noise_every)

    def every_chain(self, latents: Latents, batch: Batch, noise_every: int = 0) -> GradientEstimate:
        return chains_estimate(self.density, latents, batch, noise=self.measures_noise and bool(noise_every))

    def over(self, density: MinibatchDensity) -> Estimator:
        return type(self)(density)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.density).__name__})"


class PlainGradient(Estimator):
    """The minibatch gradient, nothing else: what a kernel that ignores the gradient noise is handed.

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> from pyro_scalable.infer.gradients import PlainGradient
        >>> estimator = PlainGradient(lambda latents, batch: -latents["w"].square().sum())
        >>> latents = {"w": torch.tensor([1.0, -2.0])}
        >>> gradient, state = estimator.estimate(estimator.init(latents), latents, Batch({}, (), {}))
        >>> gradient.grads["w"], int(state.count)
        (tensor([-2.,  4.]), 1)

    """


class NoiseEstimatingGradient(Estimator):
    """The minibatch gradient with the moving average of the diagonal of its noise (module docstring).

    The density must offer its minibatch's examples (the Pyro bridge's log posterior does for a model with one
    subsampled plate and ``subsample_size >= 2``).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import Batch, ModelBridge
        >>> from pyro_scalable.infer.gradients import NoiseEstimatingGradient
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=10) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.randn(100),))
        >>> estimator = NoiseEstimatingGradient(bridge.log_posterior_fn)
        >>> latents = {"mu": torch.tensor(0.5)}
        >>> batch = Batch({"data": torch.arange(10)}, bridge.args, bridge.kwargs)
        >>> gradient, state = estimator.estimate(estimator.init(latents), latents, batch, noise_every=1)
        >>> bool(gradient.noise_variance["mu"] > 0), int(state.count)
        (True, 1)

    """

    measures_noise = True

    def init(self, latents: Latents) -> EstimatorState:
        start = super().init(latents)
        return start._replace(noise={name: torch.zeros_like(x) for name, x in latents.items()})

    def fold(
        self, state: EstimatorState, estimate: GradientEstimate, noise_every: int = 0
    ) -> tuple[GradientEstimate, EstimatorState]:
        noise = average_noise(state.noise, estimate, state.count, noise_every) if noise_every else state.noise
        return estimate._replace(noise_variance=noise), EstimatorState(noise, state.count + 1)


def control_variate(estimator: GradientEstimator, control: Any) -> GradientEstimator:
    """``estimator`` of the control-variate density around ``control`` (:class:`~.controlled.ControlledDensity`).

    ``control``: a :class:`~pyro_scalable.infer.sgmcmc.control_variates.ControlVariate` (centre, full-data value and
    gradient there); ``None`` leaves the density as it is until a centre is given (warm-up's windows).
    """
    return estimator.over(ControlledDensity(estimator.density, control))


def whitened(estimator: GradientEstimator, wrap: Any) -> GradientEstimator:
    """``estimator`` of ``wrap(estimator.density)``: warm-up's metric's density in z (``MetricSchedule.wrap``)."""
    return estimator.over(wrap(estimator.density))
