r"""What every stochastic-gradient MCMC engine shares: the gradient and its noise, the Info record, the phases.

Contract (BlackJAX-style): an engine module has ``init(latents) -> State`` and
``update(state, gradient, *, <hyperparameters>, generator) -> (State, Info)``; the gradient is estimated outside
the kernel (:func:`estimate_gradient`, with the moving average of its noise folded in by the program that steps the
chain, :mod:`.adaptation`) and handed to ``update``, and ``step = update ∘ estimate`` (:func:`functional_step`).
Every State field is a tensor, so ``torch.func.vmap`` runs many chains as one computation, and a State holds only
what its update rule reads: warm-up wraps a kernel with its own state and hands the hyperparameters it chose to
``update`` as arguments. A data-parallel run all-reduces the :class:`GradientEstimate` between the two halves.

Every State also carries ``checked_latents``: the last point at which the log density and its gradient were
found finite. That point, not the untested proposal, is the draw the driver records, so ``Info.log_posterior``
and ``Info.grad_norm`` belong to it (on a diverging step they show the non-finite values met). A step whose log
density or gradient is not finite sets ``Info.diverging`` and sends the chain back to ``checked_latents``
(momentum reset): it goes on from there with fresh noise and a fresh minibatch, and no engine ever hands the
driver a point with a non-finite density, let alone a NaN draw.

**Gradient noise.** With a subsampled plate of size :math:`N` and a minibatch :math:`\mathcal{B}` of :math:`B`
points drawn without replacement, the minibatch gradient is the mean of the per-example gradients
:math:`g_i = \nabla \log p(\theta) + N \nabla \log p(y_i \mid \theta)`, so its covariance is
:math:`V = (1 - B/N)\,\mathrm{Cov}_i(g_i) / B`. :func:`estimate_gradient` with ``noise=True`` evaluates the
:math:`g_i` with one ``torch.func.vmap`` over single-example batches and returns the diagonal of the unbiased
estimate :math:`\hat V = (1 - B/N)\, s^2 / B` (sample variance :math:`s^2` over the minibatch) next to their
mean, which is the usual minibatch gradient. A log posterior may split a large minibatch into :math:`G` groups of
:math:`m` examples instead (the bridge does above 32 examples): the groups' mean gradients :math:`h_g` give
:math:`s^2 \approx m\,\mathrm{var}_G(h_g)`, unbiased over random partitions, at the cost of one batched
gradient (:mod:`pyro_scalable.bridge.log_posterior`, :mod:`.group_gradients`). Terms that are the same in every
group (the prior's) add to the mean and not to the spread: where the log posterior offers its ``terms`` apart and
the latents have :data:`SHARED_FROM` coordinates or more, they are evaluated once and only the data's per group (a
90,701-weight MLP's noise step: 7.5 ms, against 12.0 ms with the prior in every group). Where a kernel corrects for
(or reports) the noise, the program stepping it keeps a moving average of :math:`\hat V` over about 50 steps
(:func:`average_noise`) and hands that to the update: steadier than one minibatch's estimate, whose clipping at 0
would bias the correction. A run's sampling steps (and burn-in's) measure it on every fourth step
(:func:`noise_phase`; each measurement weighs as the four steps it stands for) and take the plain gradient in
between: the per-example gradients cost several plain ones, and an average over 50 steps changes little in four.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.func import grad_and_value

from pyro_scalable.bridge.traced import under_transform
from pyro_scalable.infer.schedules import constant
from pyro_scalable.infer.sgmcmc.group_gradients import own_storage, per_group, spread

__all__ = [
    "CURVATURE_EVERY",
    "GradientEstimate",
    "LogPosteriorFn",
    "Phase",
    "SAMPLING",
    "SGMCMCInfo",
    "average_noise",
    "check_gradient_noise",
    "estimate",
    "estimate_gradient",
    "evaluate",
    "extended_info",
    "flag",
    "gaussian_like",
    "injected_variance",
    "functional_step",
    "noise_in_update",
    "noise_phase",
    "noise_start",
    "scalar_like",
    "shared_info",
]

Latents = dict[str, Tensor]
NOISE_FRACTION = 0.5  # ρ: the largest share of the wanted noise that the gradient noise may supply (.tuning)
NOISE_WINDOW = 50  # steps: the moving average of the gradient noise forgets older steps at this rate
CURVATURE_EVERY = 4  # warm-up measures the curvature on every 4th step after the first (.adaptation)
NOISE_EVERY = 4  # burn-in and sampling measure the gradient noise on every 4th step (noise_phase)
SHARED_FROM = 10_000  # latent coordinates from which the noise estimate takes the prior's terms once


class LogPosteriorFn(Protocol):
    """``log_posterior_fn(latents, batch)``: an unbiased minibatch estimate of the full-data log joint.

    For per-example gradients it may also offer ``examples(batch) -> (examples, in_dims, population_size[,
    group_size])``: the minibatch split into batches of ``group_size`` examples (default 1) along a leading
    dimension (``in_dims`` as for ``torch.func.vmap``), each an estimate of the log joint on its own, and the
    number of data points N they are drawn from (``inf`` for draws with replacement); or ``None`` where the batch
    is the full data and the gradient exact. With it, ``terms`` may be a pair ``(shared, grouped)`` of functions of
    ``(latents, batch)`` that sum to the log posterior, ``shared`` reading none of the minibatch's examples (the
    prior's terms): the noise estimate then evaluates ``shared`` once and only ``grouped`` per group.
    """

    def __call__(self, latents: Latents, batch: Any) -> Tensor: ...


class GradientEstimate(NamedTuple):
    """The minibatch gradient of the log posterior at one point, and what is known about its noise."""

    grads: Latents
    log_posterior: Tensor  # the minibatch estimate of the log joint
    grad_norm: Tensor
    diverging: Tensor  # bool: the value or the gradient is not finite
    noise_variance: Latents  # diag of the estimated Cov(grads) per site; {} when not estimated
    num_examples: Tensor  # B, the number of per-example gradients behind noise_variance (0 when not estimated)
    hessian_product: Latents  # warm-up's Hessian-vector product ({} outside warm-up)


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


def estimate(state: Any, batch: Any, log_posterior_fn: LogPosteriorFn, *, gradient_noise: str = "ignore"):
    """The minibatch gradient at ``state.latents`` (and its noise unless ``gradient_noise="ignore"``).

    The half of a step that a data-parallel run all-reduces; it draws nothing.
    """
    return estimate_gradient(log_posterior_fn, state.latents, batch, noise=gradient_noise != "ignore")


def evaluate(log_posterior_fn: LogPosteriorFn, latents: Latents, batch: Any) -> tuple[Latents, Tensor, Tensor, Tensor]:
    """Gradient, value, gradient norm and a divergence flag of the log posterior at ``latents``."""
    grads, value = _gradient_and_value(log_posterior_fn, latents, batch)
    grad_sq = functools.reduce(torch.add, (g.square().sum() for g in grads.values()))
    # one check for both: the sum is finite where both are (grad_sq >= 0; it overflows only past ~1e38, a divergence)
    total = value + grad_sq
    if total.device.type == "cpu" and not under_transform(total) and not torch.is_inference_mode_enabled():
        diverging = flag(not math.isfinite(total.item()), total.device)  # a plain CPU step: one read, no flag made
    else:
        diverging = ~torch.isfinite(total)
    return grads, value, grad_sq.sqrt(), diverging


def estimate_gradient(
    log_posterior_fn: LogPosteriorFn, latents: Latents, batch: Any, *, noise: bool = False
) -> GradientEstimate:
    """The minibatch gradient at ``latents``; with ``noise=True`` also the diagonal of its covariance.

    The noise estimate needs ``log_posterior_fn.examples`` (the Pyro bridge offers it for a model with one
    subsampled plate) and at least two examples per minibatch.
    """
    if not noise:
        grads, value, grad_norm, diverging = evaluate(log_posterior_fn, latents, batch)
        return GradientEstimate(grads, value, grad_norm, diverging, {}, _no_examples(value.device), {})
    split = getattr(log_posterior_fn, "examples", None)
    if split is None:
        raise TypeError(
            "estimating the gradient noise needs per-example terms: log_posterior_fn must offer "
            "examples(batch) (the Pyro bridge does, for a model with a subsampled plate)."
        )
    parts = split(batch)
    if parts is None:  # the full data: an exact gradient, no noise
        grads, value, grad_norm, diverging = evaluate(log_posterior_fn, latents, batch)
        zero = torch.zeros((), dtype=value.dtype, device=value.device)
        variance = {name: torch.zeros_like(g) for name, g in grads.items()}
        return GradientEstimate(grads, value, grad_norm, diverging, variance, zero, {})
    examples, in_dims, population_size, *group = parts
    group = group[0] if group else 1
    # the prior's terms apart cost a gradient of their own, which pays from about SHARED_FROM coordinates (a
    # network's weights: 12.0 ms against 7.5 at 90,701); below, the overhead is the larger (1.2 ms against 1.1 on 4
    # vectorised chains of a 10-weight regression)
    many = sum(x.numel() for x in latents.values()) >= SHARED_FROM
    terms = getattr(log_posterior_fn, "terms", None) if many else None
    grouped = log_posterior_fn if terms is None else terms[1]
    per_grads, per_values = per_group(grouped, latents, examples, in_dims)
    own = own_storage(per_grads)
    size = per_values.shape[0] * group
    means = {name: g.mean(0) for name, g in per_grads.items()}
    value = per_values.mean()
    shrink = group * (1.0 - size / population_size) / size  # m var_G(h_g) estimates s^2 (bridge.log_posterior)
    variance = {name: spread(g, means[name], own=name in own) * shrink for name, g in per_grads.items()}
    if terms is None:
        grads = means
    else:  # the terms every group shares (the prior's), once: the same mean, and no spread
        shared_grads, shared_value = _gradient_and_value(terms[0], latents, batch)
        grads = {name: shared_grads[name] + g for name, g in means.items()}
        value = shared_value + value
    grad_sq = sum(g.square().sum() for g in grads.values())
    finite_noise = torch.stack([torch.isfinite(v).all() for v in variance.values()]).all()
    diverging = ~(torch.isfinite(value) & torch.isfinite(grad_sq) & finite_noise)
    count = torch.full((), float(size), dtype=value.dtype, device=value.device)
    return GradientEstimate(grads, value, grad_sq.sqrt(), diverging, variance, count, {})


def _gradient_and_value(log_posterior_fn: Callable, latents: Latents, batch: Any) -> tuple[Latents, Tensor]:
    if any(under_transform(x) for x in latents.values()):
        return grad_and_value(log_posterior_fn)(latents, batch)
    # Outside vmap, plain autograd gives the same numbers and saves torch.func's per-call overhead
    # (about half a millisecond on a CPU, as much as a small model's whole backward pass).
    leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
    with torch.enable_grad():
        value = log_posterior_fn(leaves, batch)
        values = torch.autograd.grad(value, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(leaves, values, strict=True)), value.detach()


@functools.lru_cache(maxsize=16)
def flag(value: bool, device: torch.device) -> Tensor:
    """A shared 0-d bool tensor (``evaluate``'s divergence flag on a plain CPU step): read it, never write to it."""
    return torch.full((), value, dtype=torch.bool, device=device)


def _no_examples(device: torch.device) -> Tensor:
    """``num_examples`` of a plain gradient: a shared 0-d zero of the default dtype (read, never written)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return torch.zeros((), device=device)
    return _zero(torch.get_default_dtype(), device)


@functools.lru_cache(maxsize=16)
def _zero(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros((), dtype=dtype, device=device)


def noise_start(latents: Latents, gradient_noise: str) -> Latents:
    """A noise average at the start: zeros where the noise is estimated, ``{}`` where it is not."""
    return {} if gradient_noise == "ignore" else {name: torch.zeros_like(x) for name, x in latents.items()}


def average_noise(average: Latents, gradient: GradientEstimate, step_count: Tensor, every: int = 1) -> Latents:
    """Fold a step's noise estimate into the moving average (weight ``1/(t+1)``, at least ``1/50``).

    A measurement taken on every ``every``-th step weighs as that many steps (``every/(t+every)``, at least
    ``every/50``). An empty ``average`` starts from zeros; a diverging step, or one that measured nothing, leaves it
    as it was.
    """
    if not gradient.noise_variance:
        return average
    first = next(iter(gradient.grads.values()))
    weight = torch.clamp(every / (step_count + every).to(first.dtype), min=every / NOISE_WINDOW)
    start = average or {name: torch.zeros_like(v) for name, v in gradient.noise_variance.items()}
    return {
        name: torch.where(gradient.diverging, v, v + weight * (gradient.noise_variance[name] - v))
        for name, v in start.items()
    }


def noise_in_update(
    gradient: GradientEstimate, gradient_noise: str, scale: Tensor | Callable[[str], Tensor]
) -> Latents:
    """The variance the gradient's noise brings into an update: ``scale`` times ``gradient.noise_variance``.

    ``scale`` maps the gradient's noise to its variance in the update (SGLD's ε², per site where it differs).
    ``{}`` with ``gradient_noise="ignore"`` or where the estimate carries no noise.
    """
    if gradient_noise == "ignore" or not gradient.noise_variance:
        return {}
    if callable(scale):
        return {name: scale(name) * v for name, v in gradient.noise_variance.items()}
    return {name: scale * v for name, v in gradient.noise_variance.items()}


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


def gaussian_like(latents: Latents, generator: torch.Generator | None, temperature: Any = 1.0) -> Latents:
    """Independent standard normal noise shaped like each latent (zeros, drawing nothing, at a constant T = 0)."""
    if not callable(temperature) and float(temperature) == 0.0:
        return {name: torch.zeros_like(x) for name, x in latents.items()}
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


def functional_step(update_rule: Callable) -> Callable:
    """A kernel module's ``step``: ``update_rule`` after :func:`estimate`, for one chain outside the driver.

    The update takes this step's own noise estimate (the driver hands it a moving average instead).
    """

    def step(state: Any, batch: Any, log_posterior_fn: LogPosteriorFn, *, gradient_noise: str = "ignore", **kwargs):
        gradient = estimate(state, batch, log_posterior_fn, gradient_noise=gradient_noise)
        noise = {} if gradient_noise == "ignore" else {"gradient_noise": gradient_noise}  # an update may not take it
        return update_rule(state, gradient, **noise, **kwargs)

    step.__doc__ = (
        "Advance one chain by one step on ``batch``: the module's ``update`` (same keywords) after "
        ":func:`~pyro_scalable.infer.sgmcmc.base.estimate`."
    )
    return step
