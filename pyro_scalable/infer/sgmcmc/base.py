r"""What every stochastic-gradient MCMC engine shares: the gradient and its noise, the Info record, the phases.

Contract (BlackJAX-style): an engine module has ``init(latents) -> State`` and
``update(state, gradient, *, <hyperparameters>, generator) -> (State, Info)``; the gradient is estimated outside
the kernel (:mod:`pyro_scalable.infer.gradients`, with the moving average of its noise folded in by the program that
steps the chain, :mod:`.adaptation`) and handed to ``update``, and ``step = update ∘ estimate``
(:func:`functional_step`).
Every State field is a tensor, so ``torch.func.vmap`` runs many chains as one computation, and a State holds only
what its update rule reads: warm-up wraps a kernel with its own state and hands the hyperparameters it chose to
``update`` as arguments. A data-parallel run all-reduces the gradient estimate between the two halves.

Every State also carries ``checked_latents``: the last point at which the log density and its gradient were
found finite. That point, not the untested proposal, is the draw the driver records, so ``Info.log_posterior``
and ``Info.grad_norm`` belong to it (on a diverging step they show the non-finite values met). A step whose log
density or gradient is not finite sets ``Info.diverging`` and sends the chain back to ``checked_latents``
(momentum reset): it goes on from there with fresh noise and a fresh minibatch, and no engine ever hands the
driver a point with a non-finite density, let alone a NaN draw.

**The gradient** is a :class:`~pyro_scalable.infer.gradients.GradientEstimate` of the run's minibatch density
(:mod:`pyro_scalable.infer.gradients`: the per-example noise estimate, the control variate, the metric's variables).
Where a kernel corrects for (or reports) the noise, the program stepping it hands the update the noise's moving
average (:func:`~pyro_scalable.infer.gradients.average_noise`), measured on every :data:`NOISE_EVERY`-th step of
sampling and burn-in (:func:`noise_phase`: the per-example gradients cost several plain ones, and an average over 50
steps changes little in four); the variance a kernel injects is the wanted one less the noise's share in its update
(:func:`noise_in_update`, :func:`injected_variance`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.infer.gradients import GradientEstimate, as_density, estimate_gradient
from pyro_scalable.infer.schedules import constant

__all__ = [
    "CURVATURE_EVERY",
    "DrawnNoise",
    "draws_noise",
    "Phase",
    "SAMPLING",
    "Transform",
    "builder",
    "SGMCMCInfo",
    "check_gradient_noise",
    "estimate",
    "extended_info",
    "for_mode",
    "gaussian_like",
    "injected_noise",
    "injected_variance",
    "functional_step",
    "noise_share",
    "noise_phase",
    "scalar_like",
    "shared_info",
]

Latents = dict[str, Tensor]
NOISE_FRACTION = 0.5  # ρ: the largest share of the wanted noise that the gradient noise may supply (.tuning)
CURVATURE_EVERY = 4  # warm-up measures the curvature on every 4th step after the first (.adaptation)
NOISE_EVERY = 4  # burn-in and sampling measure the gradient noise on every 4th step (noise_phase)


class SGMCMCInfo(NamedTuple):
    """What one step did, for people and for ArviZ ``sample_stats`` (all 0-d tensors per chain)."""

    log_posterior: Tensor  # minibatch estimate at the latents before the step ("lp" in ArviZ)
    grad_norm: Tensor
    step_size: Tensor  # after schedules (or as chosen in warm-up)
    temperature: Tensor  # after schedules
    diverging: Tensor  # bool: the step was rejected because the log density or gradient was not finite
    noise_ratio: Tensor  # max over coordinates of gradient-noise variance / wanted noise variance (NaN: not estimated)
    uncorrected: Tensor  # share of coordinates where that ratio passed 1: no correction possible (NaN: not estimated)


def shared_info(
    gradient: GradientEstimate, step_size: Tensor, temperature: Tensor, noise_ratio: Tensor, uncorrected: Tensor
) -> tuple[Tensor, ...]:
    """The fields of :class:`SGMCMCInfo` for a step taken with ``gradient`` (an engine's Info adds its own after)."""
    return (
        gradient.log_posterior,
        gradient.grad_norm,
        step_size,
        temperature,
        gradient.diverging,
        noise_ratio,
        uncorrected,
    )


def extended_info(name: str, *extra: str) -> type:
    """An Info record with :class:`SGMCMCInfo`'s fields followed by an engine's ``extra`` 0-d statistics."""
    fields = [(field, Tensor) for field in (*SGMCMCInfo._fields, *extra)]
    record = NamedTuple(name, fields)
    record.__doc__ = f"A step's statistics: those of :class:`~.base.SGMCMCInfo`, then {', '.join(extra)}."
    return record


class Phase(NamedTuple):
    """What a step does besides moving the chains: warm-up's share of it (Python values, the same for all chains)."""

    power_iterations: int = 0  # Hessian-vector products the estimate spends on the curvature
    burn_in: bool = False  # the first half of warm-up: bring the chains to the typical set, uncalibrated
    noise_every: int = 1  # the gradient noise is measured here and stands for this many steps; 0: not measured


SAMPLING = Phase()


def noise_phase(step_index: int) -> Phase:
    """A step that measures the gradient noise on every :data:`NOISE_EVERY`-th step, and not in between.

    Example:
        >>> [noise_phase(t).noise_every for t in range(6)]
        [4, 0, 0, 0, 4, 0]

    """
    return Phase(noise_every=NOISE_EVERY if step_index % NOISE_EVERY == 0 else 0)


def estimate(state: Any, batch: Any, log_posterior_fn: Any, *, gradient_noise: str = "ignore"):
    """The minibatch gradient at ``state.latents``, as an update takes it under ``gradient_noise``.

    With ``"estimate"`` it carries its noise (``noise_variance``), with ``"correct"`` also as the correction to
    subtract (``noise_correction``); with ``"ignore"`` neither.
    """
    density = as_density(log_posterior_fn)  # a MinibatchDensity, or a plain function of (latents, batch)
    return for_mode(estimate_gradient(density, state.latents, batch, noise=gradient_noise != "ignore"), gradient_noise)


def for_mode(gradient: GradientEstimate, gradient_noise: str) -> GradientEstimate:
    """``gradient`` as an update takes it under ``gradient_noise``.

    ``"ignore"``: no noise; ``"estimate"``: the noise, to report; ``"correct"``: the same also as the correction the
    update subtracts from the noise it injects (``noise_correction``).
    """
    if gradient_noise == "ignore":
        return gradient._replace(noise_variance={}, noise_correction={})
    return gradient._replace(noise_correction=gradient.noise_variance if gradient_noise == "correct" else {})


def noise_share(gradient: GradientEstimate, scale: Tensor | Callable[[str], Tensor]) -> Latents:
    """The variance the gradient's noise brings into an update: ``scale`` times ``gradient.noise_variance``.

    ``scale`` maps the gradient's noise to its variance in the update (SGLD's ε², per site where it differs).
    ``{}`` where the estimate carries no noise (the kernel ignores it, or it was not estimated).
    """
    if not gradient.noise_variance:
        return {}
    if callable(scale):
        return {name: scale(name) * v for name, v in gradient.noise_variance.items()}
    return {name: scale * v for name, v in gradient.noise_variance.items()}


def injected_noise(
    wanted: Tensor | Latents, gradient: GradientEstimate, scale: Tensor | Callable[[str], Tensor], latents: Latents
) -> tuple[Latents, Tensor, Tensor]:
    """What a kernel injects, given the noise it wants per step and how the gradient's noise enters its update.

    The estimate hands the noise (``noise_variance``: reported as ``noise_ratio``) and, where the kernel corrects
    for it, the same in ``noise_correction``: the injected variance is then ``wanted`` less the gradient noise's
    share ``scale * V`` (:func:`injected_variance`). The kernel needs to know nothing of the mode.
    """
    return injected_variance(wanted, noise_share(gradient, scale), bool(gradient.noise_correction), latents)


def injected_variance(
    wanted: Tensor | Latents, gradient_variance: Latents, correct: bool, latents: Latents
) -> tuple[Latents, Tensor, Tensor]:
    """Per-coordinate variance to inject, and the ``noise_ratio`` and ``uncorrected`` statistics of a step.

    ``wanted`` is the noise variance the sampler needs per step (a scalar or per site); ``gradient_variance`` is
    what the minibatch gradient already brings into the same update ({} when not estimated). With ``correct`` the
    injected variance is ``wanted - gradient_variance``, floored at 0 where the gradient noise alone is too large.
    Without a noise estimate it is ``wanted`` as given per site (a scalar broadcasts over the site's coordinates).
    """

    def wanted_for(name: str) -> Tensor:
        return wanted[name] if isinstance(wanted, dict) else wanted

    first = next(iter(latents.values()))
    if not gradient_variance:
        nan = constant(math.nan, first)  # a scalar per site is enough where nothing is corrected
        return {name: wanted_for(name) for name in latents}, nan, nan
    ratios = []
    injected = {}
    for name, x in latents.items():
        want, noise = wanted_for(name), gradient_variance[name]  # the noise has the site's shape; want may be 0-d
        positive = want > 0
        ratios.append(torch.where(positive, noise / torch.where(positive, want, 1.0), 0.0).reshape(-1))
        injected[name] = torch.clamp(want - noise, min=0.0) if correct else want + torch.zeros_like(x)
    flat = torch.cat(ratios)
    return injected, flat.max(), (flat > 1).to(first.dtype).mean()


class DrawnNoise(NamedTuple):
    """A step's standard normal noise, drawn before it (:mod:`.compiled_blocks`), handed where the generator goes."""

    noise: Latents  # one tensor per latent, in the latents' order and shapes (under vmap, one chain's)


def draws_noise(temperature: Any) -> bool:
    """Whether an update at ``temperature`` draws noise (:func:`gaussian_like`: not at a constant T = 0).

    Example:
        >>> draws_noise(1.0), draws_noise(0.0), draws_noise(lambda step: 0.0)
        (True, False, True)

    """
    return callable(temperature) or float(temperature) != 0.0


def gaussian_like(latents: Latents, generator: Any, temperature: Any = 1.0) -> Latents:
    """Independent standard normal noise shaped like each latent (zeros, drawing nothing, at a constant T = 0).

    ``generator``: a ``torch.Generator``, ``None`` (torch's own), or :class:`DrawnNoise` (its noise, as it is).
    """
    if not draws_noise(temperature):
        return {name: torch.zeros_like(x) for name, x in latents.items()}
    if isinstance(generator, DrawnNoise):
        return {name: generator.noise[name] for name in latents}
    return {
        name: torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device) for name, x in latents.items()
    }


def scalar_like(value: float | Tensor, like: Tensor) -> Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype and device (a tensor, e.g. one chosen in warm-up, as it is)."""
    return value if isinstance(value, Tensor) else constant(value, like)


GRADIENT_NOISE_CHOICES = ("correct", "estimate", "ignore")


def check_gradient_noise(gradient_noise: str | None, step_size: Any) -> str:
    """The ``gradient_noise`` mode: as given, or ``"correct"`` when the step size is left to warm-up."""
    if gradient_noise is None:
        return "correct" if step_size is None else "ignore"
    if gradient_noise not in GRADIENT_NOISE_CHOICES:
        raise ValueError(f"gradient_noise must be one of {GRADIENT_NOISE_CHOICES} or None, got {gradient_noise!r}.")
    return gradient_noise


class Transform(NamedTuple):
    """A kernel with its hyperparameters bound, as posteriors' and BlackJAX's are: two pure functions of one chain.

    ``init(latents) -> State``; ``update(state, gradient, generator=None, **tuned) -> (State, Info)``, where
    ``tuned`` are hyperparameters warm-up chose (per-chain tensors), in place of the bound ones.
    """

    init: Callable
    update: Callable


def builder(init_rule: Callable, update_rule: Callable, init_keywords: tuple = ()) -> Callable[..., Transform]:
    """A kernel module's ``build(**hyperparameters) -> Transform`` from its ``init`` and ``update``.

    ``init_keywords``: the hyperparameters ``init`` takes too (SGNHT's thermostat starts at the friction).

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> from pyro_scalable.infer.gradients import PlainGradient
        >>> from pyro_scalable.infer.sgmcmc import sgld
        >>> sgd = sgld.build(step_size=0.1, temperature=0.0)  # T = 0: gradient ascent
        >>> estimator = PlainGradient(lambda latents, batch: -latents["w"].square().sum())
        >>> state = sgd.init({"w": torch.tensor([1.0])})
        >>> gradient, _ = estimator.estimate(estimator.init(state.latents), state.latents, Batch({}, (), {}))
        >>> state, info = sgd.update(state, gradient)
        >>> state.latents["w"]  # 1 + 0.1 * (-2)
        tensor([0.8000])

    """

    def build(**hyperparameters: Any) -> Transform:
        def update(state: Any, gradient: GradientEstimate, generator=None, **tuned: Any):
            return update_rule(state, gradient, **{**hyperparameters, **tuned}, generator=generator)

        bound = {name: hyperparameters[name] for name in init_keywords if name in hyperparameters}
        return Transform(functools.partial(init_rule, **bound) if bound else init_rule, update)

    build.__doc__ = (
        "The module's kernel with ``hyperparameters`` (its ``update``'s keywords) bound: a "
        ":class:`~pyro_scalable.infer.sgmcmc.base.Transform` ``(init, update)``."
    )
    return build


def functional_step(update_rule: Callable) -> Callable:
    """A kernel module's ``step``: ``update_rule`` after :func:`estimate`, for one chain outside the driver.

    The update takes this step's own noise estimate (the driver hands it a moving average instead).
    """

    def step(state: Any, batch: Any, log_posterior_fn: Any, *, gradient_noise: str = "ignore", **kwargs):
        return update_rule(state, estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise), **kwargs)

    step.__doc__ = (
        "Advance one chain by one step on ``batch``: the module's ``update`` (same keywords) after "
        ":func:`~pyro_scalable.infer.sgmcmc.base.estimate`."
    )
    return step
