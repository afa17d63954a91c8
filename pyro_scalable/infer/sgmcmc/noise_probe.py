r"""After a run whose minibatch gradient noise was ignored, measure that noise once, so too-wide draws are not silent.

With a hand-set step size and ``gradient_noise="ignore"`` (the default then, so that T = 0 is exactly SGD), a
step injects the wanted noise (2εT for SGLD) *and* the minibatch gradient's own, ε²V per coordinate, which
nothing subtracts: the stationary variance is inflated by up to a factor 1 + r, where r = ε²V / (wanted) is what
the kernels report as ``noise_ratio`` when they estimate the noise. The run cannot show r (it did not estimate
V); this probe does, after the last draw: the same kernel with ``gradient_noise="estimate"``, from the first
chain's final state, for :data:`PROBE_STEPS` steps on fresh minibatches and its own generator (the run, its
draws and its checkpoint are untouched); the kernels' noise estimate is the running mean of the per-step
estimates over those steps, and :func:`probe_gradient_noise` returns the last step's ``noise_ratio``. The driver
warns (a :class:`~pyro_scalable.infer.health.HealthWarning`) when it exceeds :data:`TOLERATED`: an sd up to ~5%
too wide.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from pyro_scalable.bridge.checks import user_stacklevel
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.infer.gradients import MinibatchDensity
from pyro_scalable.infer.gradients.estimator import NoiseEstimatingGradient
from pyro_scalable.infer.health import HealthWarning
from pyro_scalable.infer.sgmcmc.adaptation import Tuned
from pyro_scalable.infer.sgmcmc.chains import ChainStepper

__all__ = ["PROBE_STEPS", "TOLERATED", "probe_gradient_noise", "warn_ignored_noise", "warn_uncorrected_noise"]

PROBE_STEPS = 20  # the noise average weighs step t by 1/(t+1): after 20 steps, the mean of 20 estimates
TOLERATED = 0.1


def probe_gradient_noise(
    kernel: Any, bridge: ModelBridge, latents: Latents, seed: int, step: int, density: MinibatchDensity | None = None
) -> float | None:
    """The ``noise_ratio`` of ``kernel`` with the noise estimated, from the first chain of ``latents``.

    ``density`` is the run's (a control variate's, where it had one); default: the bridge's log posterior.

    ``None`` where it does not apply: the noise was estimated (or corrected) already, the kernel has no
    ``gradient_noise`` option, warm-up chose the step, no plate is subsampled (the gradient is exact, or a loader's
    plate cannot be split into examples), or T = 0; and where the noise cannot be estimated: a minibatch of one
    point has no spread, and with several subsampled plates the minibatch is no sum of independent examples.
    """
    if kernel.gradient_noise != "ignore" or kernel.adapts or not bridge.plates:
        return None
    if len(bridge.plates) > 1 or any(plate.subsample_size < 2 for plate in bridge.plates.values()):
        return None
    probe = kernel.with_gradient_noise("estimate")
    generator = torch.Generator(device=bridge.device).manual_seed(seed + 1)  # never the run's generator
    first = {name: value[:1].detach() for name, value in latents.items()}
    density = bridge.log_posterior_fn if density is None else density
    estimator = NoiseEstimatingGradient(density)
    stepper = ChainStepper(Tuned(probe, estimator), bridge, first, generator, "sequential")
    sampler = EpochSampler(bridge.plates, 1, generator, bridge.device)
    with torch.no_grad():
        for t in range(step, step + PROBE_STEPS):
            info = stepper.step(Batch(next(sampler), bridge.args, bridge.kwargs), t, estimator)
    if not bool((info.temperature > 0).all()):
        return None
    ratio = float(info.noise_ratio.max())
    return ratio if math.isfinite(ratio) else None


def warn_ignored_noise(ratio: float | None) -> None:
    """Warn when the ignored gradient noise widened the draws by more than :data:`TOLERATED` in variance."""
    if ratio is None or ratio <= TOLERATED:
        return
    wider = math.sqrt(1 + ratio) - 1
    warnings.warn(
        "the chains are not healthy: the step size was given and the minibatch gradient's noise ignored "
        "(gradient_noise='ignore', the default with a hand-set step): measured after the run, that noise is "
        f"{ratio:.0%} of the noise the sampler injects, so the draws are up to {wider:.0%} too wide in some "
        "directions. Pass gradient_noise='correct' (or leave step_size to warm-up) for calibrated draws, or lower "
        "the step size or raise the minibatch size.",
        HealthWarning,
        stacklevel=user_stacklevel(),
    )


def warn_uncorrected_noise(stats: dict, num_samples: int, step_chosen: bool = False) -> None:
    """Warn when in over 1% of the kept steps' coordinates the gradient noise alone exceeded the wanted noise.

    ``step_chosen``: warm-up chose the step size. Its noise bound already keeps the *average* gradient noise under
    the wanted noise, so the excess comes from where the noise is larger than warm-up saw; lowering a step the user
    never set is no remedy there, and the warning says what is: a larger minibatch or a control variate.
    """
    uncorrected = stats.get("uncorrected")
    if uncorrected is None or num_samples == 0:
        return
    share = float(uncorrected.float().mean())
    if share > 0.01:
        remedy = (
            "Raise the plate's subsample_size, or give the kernel control_variate='map'."
            if step_chosen
            else "Lower the step size (or leave it to warm-up), or raise the plate's subsample_size."
        )
        warnings.warn(
            f"in {share:.1%} of the coordinates of the kept steps the minibatch gradient alone brought more "
            "noise than the sampler should inject, so no correction was possible there and the draws are too "
            f"wide (sample_stats.noise_ratio > 1). {remedy}",
            stacklevel=user_stacklevel(),
        )
