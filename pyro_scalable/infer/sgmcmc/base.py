r"""What every stochastic-gradient MCMC engine shares: the contract, the gradient and its noise, the Info record.

Contract (BlackJAX-style): an engine module has ``init(latents) -> State``, :func:`estimate` (this module's, the
same for every engine) and ``update(state, gradient, *, <hyperparameters>, generator) -> (State, Info)``, and
``step = update ∘ estimate``. Every State field is a tensor, so ``torch.func.vmap(step, randomness="different")``
runs many chains as one computation, and a State holds only what its update rule reads: warm-up
(:mod:`.adaptation`) wraps a kernel with its own state and hands the hyperparameters it chose to ``update`` as
arguments. The driver may call the two halves itself, so that a data-parallel run can all-reduce the
:class:`GradientEstimate` between them.

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
gradient (:mod:`pyro_scalable.bridge.log_posterior`). An engine that corrects for (or reports) the noise keeps a moving
average of :math:`\hat V` over about 50 steps in its State (:func:`average_noise`): steadier than one
minibatch's estimate, whose clipping at 0 would bias the correction. A run's sampling steps (and burn-in's)
measure it on every fourth step (:func:`noise_phase`; each measurement weighs as the four steps it stands for)
and take the plain gradient in between: the per-example gradients cost several plain ones, and an average over
50 steps changes little in four (``docs/benchmarks.md``, "The gradient noise on every fourth step").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from pyro_scalable.bridge.traced import under_transform
from pyro_scalable.infer.schedules import constant

__all__ = [
    "CURVATURE_EVERY",
    "GradientEstimate",
    "Kernel",
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
    "gaussian_like",
    "injected_variance",
    "noise_in_step",
    "noise_phase",
    "noise_start",
    "scalar_like",
]

Latents = dict[str, Tensor]
NOISE_FRACTION = 0.5  # ρ: the largest share of the wanted noise that the gradient noise may supply (.tuning)
NOISE_WINDOW = 50  # steps: the moving average of the gradient noise forgets older steps at this rate
CURVATURE_EVERY = 4  # warm-up measures the curvature on every 4th step after the first (.adaptation)
NOISE_EVERY = 4  # burn-in and sampling measure the gradient noise on every 4th step (noise_phase)


class LogPosteriorFn(Protocol):
    """``log_posterior_fn(latents, batch)``: an unbiased minibatch estimate of the full-data log joint.

    For per-example gradients it may also offer ``examples(batch) -> (examples, in_dims, population_size[,
    group_size])``: the minibatch split into batches of ``group_size`` examples (default 1) along a leading
    dimension (``in_dims`` as for ``torch.func.vmap``), each an estimate of the log joint on its own, and the
    number of data points N they are drawn from (``inf`` for draws with replacement); or ``None`` where the batch
    is the full data and the gradient exact.
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
    if any(under_transform(x) for x in latents.values()):
        grads, value = grad_and_value(log_posterior_fn)(latents, batch)
    else:
        # Outside vmap, plain autograd gives the same numbers and saves torch.func's per-call overhead
        # (about half a millisecond on a CPU, as much as a small model's whole backward pass).
        leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
        with torch.enable_grad():
            value = log_posterior_fn(leaves, batch)
            values = torch.autograd.grad(value, list(leaves.values()), allow_unused=True, materialize_grads=True)
        grads = dict(zip(leaves, values, strict=True))
        value = value.detach()
    grad_sq = sum(g.square().sum() for g in grads.values())
    # one check for both: the sum is finite where both are (grad_sq >= 0; it overflows only past ~1e38, a divergence)
    diverging = ~torch.isfinite(value + grad_sq)
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
        return GradientEstimate(grads, value, grad_norm, diverging, {}, torch.zeros((), device=value.device), {})
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
    per_grads, per_values = vmap(grad_and_value(log_posterior_fn), in_dims=(None, in_dims))(latents, examples)
    size = per_values.shape[0] * group
    grads = {name: g.mean(0) for name, g in per_grads.items()}
    value = per_values.mean()
    shrink = group * (1.0 - size / population_size) / size  # m var_G(h_g) estimates s^2 (bridge.log_posterior)
    variance = {name: _spread(g, grads[name]) * shrink for name, g in per_grads.items()}
    grad_sq = sum(g.square().sum() for g in grads.values())
    finite_noise = torch.stack([torch.isfinite(v).all() for v in variance.values()]).all()
    diverging = ~(torch.isfinite(value) & torch.isfinite(grad_sq) & finite_noise)
    count = torch.full((), float(size), dtype=value.dtype, device=value.device)
    return GradientEstimate(grads, value, grad_sq.sqrt(), diverging, variance, count, {})


def _spread(per_grads: Tensor, mean: Tensor) -> Tensor:
    """``per_grads.var(0, correction=1)`` as a centred sum of squares.

    torch's ``var`` over a leading dimension is an order of magnitude slower (6.7 ms against 0.4 ms, 50 x 30,000).
    """
    centred = per_grads - mean
    return centred.mul_(centred).sum(0) / (per_grads.shape[0] - 1)


def noise_start(latents: Latents, gradient_noise: str) -> Latents:
    """A State's ``noise_average`` at the start: zeros where the noise is estimated, ``{}`` where it is not."""
    return {} if gradient_noise == "ignore" else {name: torch.zeros_like(x) for name, x in latents.items()}


def average_noise(average: Latents, gradient: GradientEstimate, step_count: Tensor, every: int = 1) -> Latents:
    """Fold a step's noise estimate into the moving average (weight ``1/(t+1)``, at least ``1/50``).

    A measurement taken on every ``every``-th step weighs as that many steps (``every/(t+every)``, at least
    ``every/50``). An empty ``average`` (a State started without one) starts from zeros; a diverging step, or one
    that measured nothing, leaves it as it was.
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


def noise_in_step(
    state: Any,
    gradient: GradientEstimate,
    gradient_noise: str,
    scale: Tensor | Callable[[str], Tensor],
    noise_every: int = 1,
) -> tuple[Latents, Latents]:
    """The State's next ``noise_average``, and the variance the gradient noise brings into this step's update.

    ``scale`` maps the noise of the gradient to its variance in the update (SGLD's ε², per site where it differs);
    ``noise_every``: the measurement's weight in steps (:func:`average_noise`). Nothing is estimated with
    ``gradient_noise="ignore"``: the average stays as it is and the variance is ``{}``.
    """
    if gradient_noise == "ignore":
        return state.noise_average, {}
    average = average_noise(state.noise_average, gradient, state.step_count, noise_every)
    if callable(scale):
        return average, {name: scale(name) * v for name, v in average.items()}
    return average, {name: scale * v for name, v in average.items()}


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
    ratios = {}
    injected = {}
    for name, x in latents.items():
        want = wanted_for(name) + torch.zeros_like(x)
        ratio = torch.where(want > 0, gradient_variance[name] / torch.where(want > 0, want, 1.0), 0.0)
        ratios[name] = ratio
        injected[name] = torch.clamp(want - gradient_variance[name], min=0.0) if correct else want
    flat = torch.cat([r.reshape(-1) for r in ratios.values()])
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


class Kernel:
    """What every engine's Pyro-facing class shares: the calls the chain stepper makes, with the bound hyperparameters.

    A subclass sets ``init_rule`` and ``update_rule`` (its module's ``init`` and ``update``) and
    ``hyperparameters()`` (the keyword arguments ``update_rule`` takes from the class); where warm-up chooses
    something, ``adapts`` is true and ``warmup_rule`` names the rule (:mod:`.tuning`). The hyperparameters warm-up
    chose are passed to :meth:`update` as keyword arguments (per-chain tensors) and take the place of the bound ones.
    """

    adapts = False
    gradient_noise = "ignore"
    control_variate = None  # see :mod:`.control_variates`

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments of the module's ``update`` that this class binds."""
        raise NotImplementedError

    def init(self, latents: Latents) -> Any:
        """Start a chain at unconstrained ``latents`` (with a noise average where the kernel estimates the noise)."""
        if self.gradient_noise == "ignore":
            return type(self).init_rule(latents)
        return type(self).init_rule(latents, gradient_noise=self.gradient_noise)

    def phase(self, step_index: int) -> Phase:
        """What step ``step_index`` does besides the update: where the noise is estimated, :func:`noise_phase`."""
        return SAMPLING if self.gradient_noise == "ignore" else noise_phase(step_index)

    def estimate(
        self, state: Any, batch: Any, log_posterior_fn: LogPosteriorFn, phase: Phase = SAMPLING, direction=None
    ) -> GradientEstimate:
        """The gradient (and its noise, where this kernel uses it and ``phase`` measures it) the next update needs."""
        noise = self.gradient_noise if phase.noise_every else "ignore"
        return estimate(state, batch, log_posterior_fn, gradient_noise=noise)

    def plain_gradient_at(self, state: Any, phase: Phase = SAMPLING) -> Latents | None:
        """Where :meth:`estimate` is the plain minibatch gradient (no noise estimate), the latents it is taken at.

        The chain stepper then takes it for all chains in one backward pass; ``None`` where it is more than that (a
        subclass with an :meth:`estimate` of its own keeps it: its estimate runs for every chain).
        """
        unmeasured = self.gradient_noise == "ignore" or not phase.noise_every
        plain = unmeasured and type(self).estimate is Kernel.estimate
        return state.latents if plain else None

    def update(
        self, state: Any, gradient: GradientEstimate, generator=None, phase: Phase = SAMPLING, **tuned: Any
    ) -> tuple[Any, Any]:
        """One update with this kernel's hyperparameters (``tuned``: those chosen in warm-up), given the gradient.

        Where ``phase`` measures the noise other than on every step, the update rule is told its weight
        (``noise_every``).
        """
        every = {} if phase.noise_every == 1 else {"noise_every": phase.noise_every}
        arguments = {**self.hyperparameters(), **tuned, **every}
        return type(self).update_rule(state, gradient, **arguments, generator=generator)

    def step(
        self,
        state: Any,
        batch: Any,
        log_posterior_fn: LogPosteriorFn,
        generator=None,
        phase: Phase = SAMPLING,
        **tuned: Any,
    ):
        """One step with this kernel's hyperparameters: :meth:`update` after :meth:`estimate`."""
        return self.update(state, self.estimate(state, batch, log_posterior_fn, phase), generator, phase, **tuned)

    def setup(self, *args: Any, **kwargs: Any) -> None:
        """Refuse ``pyro.infer.MCMC``, which calls this first: these kernels need a minibatch driver."""
        name = type(self).__name__
        raise TypeError(
            f"{name} is a stochastic-gradient kernel, which pyro.infer.MCMC cannot run (no accept step, minibatches); "
            f"use pyro_scalable.infer.StochasticMCMC({name}(...), num_samples=..., num_warmup=...).run(*args)."
        )

    @staticmethod
    def latents(state: Any) -> Latents:
        """The chain's draw: its last point with a finite log density and gradient."""
        return state.checked_latents

    finish = staticmethod(lambda state: state)  # the end of warm-up, for a kernel that has none: nothing to unwrap

    sampler = property(lambda self: self)
