r"""Warm-up as a wrapper around a kernel: choose the step size (and friction, mass, metric) from curvature and noise.

:class:`Adaptation` wraps a kernel (as BlackJAX's adaptation wraps its kernels) with a state of its own,
:class:`AdaptationState`: the kernel's State, the hyperparameters chosen so far, and what they are chosen from.
During warm-up each step also measures, on its own minibatch,

* the **gradient noise** :math:`\hat V` (diagonal, from per-example gradients; see :mod:`.base`), averaged over
  the warm-up steps with an exponential moving average, and
* the **curvature** :math:`\lambda = \max|\mathrm{eig}(S^{1/2} H S^{1/2})|` of the minibatch Hessian
  :math:`H` of the negative log joint in the sampler's metric :math:`S` (the preconditioner or inverse mass;
  :math:`S = I` for plain SGLD/SGHMC), by power iteration with Hessian-vector products (the vjp of
  the gradient: :mod:`.curvature`), a few iterations at the first warm-up step and then one
  on every fourth (a product costs about two gradients, and a curvature averaged over 50 steps changes little in
  four).

Each sampler turns the two into a step size with a stability bound (:math:`\epsilon\lambda \le c` for Langevin,
:math:`\epsilon\sqrt\lambda \le c` for the momentum samplers, which keeps the discretisation bias of the
stationary variance to a few per cent) and a **noise bound**: the gradient noise a step adds must stay below a
fraction :math:`\rho = 1/2` of the noise the sampler is meant to inject in every coordinate, so that the
noise correction is possible and the draws are calibrated (for SGLD :math:`\epsilon S_j \hat V_j \le 2 T \rho`).
The rules, one per kind of kernel (a kernel class names its own in ``warmup_rule``), are in :mod:`.tuning`.

**Burn-in.** The first half of warm-up only has to bring the chains to the typical set, so it uses the stability
bound alone: a larger step, with the gradient noise uncorrected and the chains spread too wide around the mode.
The calibrated rest of warm-up starts each chain at the moving average of its burn-in positions (:func:`settle`;
momenta zeroed): near the mode and *narrower* than the posterior, which the calibrated sampler widens to the
posterior at its own relaxation rate — from a cloud many times too wide it would have to shrink instead, which
at a small minibatch takes several times longer.

**After warm-up** :meth:`Adaptation.finish` unwraps the state into a :class:`TunedState`: the kernel's own State
(only what its update rule reads) and the chosen per-chain hyperparameters, which :class:`Tuned` hands to the
kernel's ``update`` at every sampling step. The values chosen are in ``sample_stats``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import vmap

from pyro_scalable.infer.gradients import NOISE_WINDOW, GradientEstimate
from pyro_scalable.infer.gradients.estimator import EstimatorState, GradientEstimator
from pyro_scalable.infer.schedules import resolve
from pyro_scalable.infer.sgmcmc import tuning
from pyro_scalable.infer.sgmcmc.base import CURVATURE_EVERY, SAMPLING, Latents, Phase, for_mode, noise_phase
from pyro_scalable.infer.sgmcmc.curvature import (
    chainwise,
    curvature_measurements,
    hessian_product,
    normalised,
    power_iterations,
    start_direction,
)

__all__ = [
    "Adaptation",
    "AdaptationState",
    "Tuned",
    "TunedState",
    "observe",
    "settle",
]

_CENTRE_WINDOW = 20  # steps: the burn-in's position average forgets older positions at this rate


class AdaptationState(NamedTuple):
    """A chain in warm-up: its kernel's State, and what warm-up has learnt so far. Every leaf is a tensor."""

    kernel: Any  # the kernel's own State
    tuned: dict[str, Any]  # the hyperparameters being chosen (step_size, friction, mass: per chain), by name
    estimator: EstimatorState  # the gradient estimator's: the moving average of the diagonal gradient-noise variance
    curvature: Tensor  # 0-d moving average of the largest |eigenvalue| of the minibatch Hessian in the metric
    direction: Latents  # the power-iteration vector (unit norm over all sites)
    count: Tensor  # 0-d: warm-up steps seen
    centre: Latents  # moving average of the burn-in's positions: where the calibrated half of warm-up starts
    burning: Tensor  # 0-d bool: the last warm-up step was a burn-in step
    backoff: Tensor  # 0-d: the step's share of what the rule chooses, halved by each diverging step (reset at settle)


class TunedState(NamedTuple):
    """A chain after warm-up: its kernel's State, the hyperparameters warm-up chose, its gradient estimator's state."""

    kernel: Any
    hyperparameters: dict[str, Any]
    estimator: EstimatorState  # the noise's moving average ({} where the kernel ignores the noise)


def handed(kernel: Any, gradient: GradientEstimate) -> GradientEstimate:
    """``gradient`` as the kernel's update takes it, under the kernel's ``gradient_noise`` (:func:`~.base.for_mode`).

    Where the kernel ignores the noise, warm-up has measured it for itself.
    """
    return for_mode(gradient, kernel.gradient_noise)


class Adaptation:
    """Warm-up around ``kernel`` for its first ``num_warmup`` steps; the chain stepper steps it as it would a kernel.

    Its calls are the kernel's (``init``, ``phase``, ``step``, ``estimate``, ``update``, ``latents``) on an
    :class:`AdaptationState`; ``finish`` turns that into the :class:`TunedState` that :attr:`sampler` steps after.
    ``estimator`` starts each chain's estimator state; it measures the gradient noise (warm-up chooses the step
    size from it). ``sampling``: the estimator sampling goes on with (the run's; a plain one where the kernel ignores
    the noise). Each step hands the estimator of its density (:class:`~pyro_scalable.infer.gradients.
    GradientEstimator`).
    """

    def __init__(self, kernel: Any, num_warmup: int, estimator: GradientEstimator, sampling: GradientEstimator):
        self.kernel = kernel
        self.num_warmup = num_warmup
        self.rule = tuning.RULES[kernel.warmup_rule]
        self.chooses_step_size = kernel.step_size is None
        self.estimator = estimator
        self.sampler = Tuned(kernel, sampling)

    def init(self, latents: Latents) -> AdaptationState:
        """Start a chain at ``latents``, with nothing learnt yet (a chosen step size and friction start as NaN)."""
        first = next(iter(latents.values()))
        zero = torch.zeros((), dtype=first.dtype, device=first.device)
        direction = normalised({name: start_direction(x) for name, x in latents.items()})
        return AdaptationState(
            self.kernel.init(latents),
            self.rule.start(self.kernel, latents),
            self.estimator.init(latents),
            zero,
            direction,
            zero.to(torch.int64),
            {name: x.clone() for name, x in latents.items()},
            zero.to(torch.bool),
            torch.ones_like(zero),
        )

    def phase(self, step_index: int) -> Phase:
        """Warm-up step ``step_index``: its power iterations, burn-in, and whether it measures the gradient noise.

        Power iterations: none where the step size is given. The noise: on every step of the calibrated half, whose
        friction and step size follow the largest coordinate's average (an average over fewer measurements is
        noisier, and its largest coordinate larger); on every :data:`~.base.NOISE_EVERY`-th step of burn-in
        (:func:`~.base.noise_phase`), which does not use it (T = 0) but hands its average on.
        """
        iterations = power_iterations(step_index) if self.chooses_step_size else 0
        burn_in = step_index < self.num_warmup // 2
        measured = noise_phase(step_index) if burn_in else SAMPLING
        return measured._replace(power_iterations=iterations, burn_in=burn_in)

    def estimate(
        self,
        state: AdaptationState,
        batch: Any,
        estimator: GradientEstimator,
        phase: Phase = SAMPLING,
        direction: Latents | None = None,
    ) -> GradientEstimate:
        """The gradient with its noise and, for a step size to choose, the curvature product in the metric.

        ``direction``: the power-iteration vector to start from (a data-parallel run all-reduces each product).
        """
        latents = state.kernel.latents
        result = estimator.measure(latents, batch, phase.noise_every)
        if phase.power_iterations:
            metric = self.rule.metric(self.kernel, state.kernel, state.tuned)
            start = state.direction if direction is None else direction
            density = estimator.density
            product = hessian_product(density, latents, batch, start, metric, iterations=phase.power_iterations)
            result = result._replace(hessian_product=product)
        return result

    def update(
        self,
        state: AdaptationState,
        gradient: GradientEstimate,
        estimator: GradientEstimator,
        generator=None,
        phase: Phase = SAMPLING,
    ) -> tuple[AdaptationState, Any]:
        """Learn from ``gradient``, choose the hyperparameters, let the kernel step with them, settle after burn-in."""
        temperature = resolve(self.kernel.temperature, state.kernel.step_count, gradient.log_posterior)
        gradient, folded = estimator.fold(state.estimator, gradient, phase.noise_every)
        state = observe(state._replace(estimator=folded), gradient)
        # a diverging step halves the chain's step from here on: the rule sees the curvature 2^order times larger
        backoff = torch.where(gradient.diverging, 0.5 * state.backoff, state.backoff)
        stiffer = backoff ** (-self.rule.order)
        state = state._replace(curvature=state.curvature * stiffer)
        tuned, state, extra = self.rule.tune(self.kernel, state, gradient, temperature, phase.burn_in)
        state = state._replace(curvature=state.curvature / stiffer, backoff=backoff)
        kernel_state, info = self.kernel.update(
            state.kernel, handed(self.kernel, gradient), generator, **tuned, **extra
        )
        return settle(self.kernel, state._replace(kernel=kernel_state, tuned=tuned), phase.burn_in), info

    def chains_estimate(
        self, state: AdaptationState, batch: Any, estimator: GradientEstimator, phase: Phase = SAMPLING
    ) -> GradientEstimate:
        """:meth:`estimate` for every chain at once (the chains' stacked state), outside vmap.

        The noise by :meth:`~pyro_scalable.infer.gradients.GradientEstimator.every_chain`, the curvature by two
        backward passes over every chain (:func:`~pyro_scalable.infer.gradients.batched.batched_hvp`): no gradient
        transform, the same numbers to rounding.
        """
        latents = state.kernel.latents
        result = every_chain(estimator, latents, batch, phase.noise_every)
        if phase.power_iterations:
            metric = vmap(lambda kernel_state, tuned: self.rule.metric(self.kernel, kernel_state, tuned) or {})(
                state.kernel, state.tuned
            )
            metric = {name: chainwise(m, latents[name]) for name, m in metric.items()} or None
            product = hessian_product(
                estimator.density,
                latents,
                batch,
                state.direction,
                metric,
                iterations=phase.power_iterations,
                chains=True,
            )
            result = result._replace(hessian_product=product)
        return result

    def step(self, state: AdaptationState, batch: Any, estimator: GradientEstimator, generator=None, phase=SAMPLING):
        """One warm-up step: :meth:`update` after :meth:`estimate`."""
        return self.update(state, self.estimate(state, batch, estimator, phase), estimator, generator, phase)

    @staticmethod
    def latents(state: AdaptationState) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""
        return state.kernel.checked_latents

    def finish(self, state: AdaptationState) -> TunedState:
        """The end of warm-up: keep the kernel's State, the chosen hyperparameters and the estimator's state.

        The noise's average goes on where sampling's estimator keeps one.
        """
        kept = state.estimator if self.sampler.estimator.measures_noise else state.estimator._replace(noise={})
        return TunedState(state.kernel, state.tuned, kept)


class Tuned:
    """``kernel`` sampling with its hyperparameters (those warm-up chose, per chain): steps a :class:`TunedState`.

    Each step's estimator (of the step's density; ``estimator`` starts a chain's state) measures the gradient, and
    its noise on every :data:`~.base.NOISE_EVERY`-th step where it keeps the noise's moving average; the kernel is
    handed the gradient with the average.
    """

    def __init__(self, kernel: Any, estimator: GradientEstimator):
        self.kernel = kernel
        self.estimator = estimator

    def init(self, latents: Latents) -> TunedState:
        """A chain at ``latents`` with nothing chosen (the kernel's own hyperparameters)."""
        return TunedState(self.kernel.init(latents), {}, self.estimator.init(latents))

    def phase(self, step_index: int) -> Phase:
        """A sampling step: the update, measuring the gradient noise where it is due (:func:`~.base.noise_phase`)."""
        return noise_phase(step_index) if self.estimator.measures_noise else SAMPLING

    def estimate(
        self, state: TunedState, batch: Any, estimator: GradientEstimator, phase: Phase = SAMPLING, direction=None
    ) -> GradientEstimate:
        """The minibatch gradient at the chain's latents, with its noise where ``phase`` measures it."""
        return estimator.measure(state.kernel.latents, batch, phase.noise_every)

    def chains_estimate(
        self, state: TunedState, batch: Any, estimator: GradientEstimator, phase: Phase = SAMPLING
    ) -> GradientEstimate:
        """:meth:`estimate` for every chain at once (the chains' stacked state), outside vmap."""
        return every_chain(estimator, state.kernel.latents, batch, phase.noise_every)

    def update(
        self,
        state: TunedState,
        gradient: GradientEstimate,
        estimator: GradientEstimator,
        generator=None,
        phase: Phase = SAMPLING,
    ):
        """Fold the gradient into the estimator's state; the kernel's update with it and the chosen hyperparameters."""
        gradient, folded = estimator.fold(state.estimator, gradient, phase.noise_every)
        kernel_state, info = self.kernel.update(
            state.kernel, handed(self.kernel, gradient), generator, **state.hyperparameters
        )
        return TunedState(kernel_state, state.hyperparameters, folded), info

    def step(self, state: TunedState, batch: Any, estimator: GradientEstimator, generator=None, phase=SAMPLING):
        """One sampling step: :meth:`update` after :meth:`estimate`."""
        return self.update(state, self.estimate(state, batch, estimator, phase), estimator, generator, phase)

    @staticmethod
    def latents(state: TunedState) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""
        return state.kernel.checked_latents

    @staticmethod
    def finish(state: TunedState) -> TunedState:
        """Warm-up is over already: the state as it is (and :attr:`sampler` is this program)."""
        return state

    sampler = property(lambda self: self)


def every_chain(estimator: GradientEstimator, latents: Latents, batch: Any, noise_every: int) -> GradientEstimate:
    """``estimator.every_chain``, handed ``noise_every`` only where the step measures the noise.

    An estimator written before ``every_chain`` took ``noise_every`` goes on working where it measures no noise.
    """
    if noise_every and estimator.measures_noise:
        return estimator.every_chain(latents, batch, noise_every)
    return estimator.every_chain(latents, batch)


def observe(state: AdaptationState, estimate: GradientEstimate) -> AdaptationState:
    """Count the step, and fold its Hessian-vector product (where there is one) into the curvature's average."""
    count = state.count + 1
    curvature, direction = state.curvature, state.direction
    if estimate.hessian_product:
        # averaged over the measurements, forgetting at the noise's rate in steps (NOISE_WINDOW / CURVATURE_EVERY
        # measurements)
        measurements = curvature_measurements(count).to(state.curvature.dtype)
        share = torch.clamp(1.0 / measurements, min=CURVATURE_EVERY / NOISE_WINDOW)
        curvature_now = torch.sqrt(sum(p.square().sum() for p in estimate.hessian_product.values()))
        finite = torch.isfinite(curvature_now) & (curvature_now > 0) & ~estimate.diverging
        curvature = torch.where(finite, curvature + share * (curvature_now - curvature), curvature)
        turned = normalised(estimate.hessian_product)
        direction = {name: torch.where(finite, turned[name], d) for name, d in direction.items()}
    return state._replace(curvature=curvature, direction=direction, count=count)


def settle(kernel: Any, state: AdaptationState, burn_in: bool) -> AdaptationState:
    """Average the burn-in's positions; at the first calibrated step, move the chain to that average.

    A chain that moves starts again from rest (``kernel.relocate``: momenta, where its kernel has any, zeroed).
    """
    chain = state.kernel
    if burn_in:
        weight = torch.clamp(1.0 / state.count.to(state.curvature.dtype), min=1.0 / _CENTRE_WINDOW)
        centre = {name: c + weight * (chain.latents[name] - c) for name, c in state.centre.items()}
        return state._replace(centre=centre, burning=torch.ones_like(state.burning))
    jump = state.burning
    moved = kernel.relocate(chain, state.centre, jump)
    backoff = torch.where(jump, torch.ones_like(state.backoff), state.backoff)  # burn-in's divergences are forgiven
    return state._replace(kernel=moved, burning=torch.zeros_like(state.burning), backoff=backoff)
