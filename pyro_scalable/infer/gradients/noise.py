r"""The gradient noise's moving average: what a noise-correcting kernel is handed in place of one step's estimate.

One minibatch's estimate of the noise is noisy itself, and a kernel that subtracts it from the noise it injects
would clip it at zero where it is too large, biasing the correction; the program stepping a chain keeps a moving
average of :math:`\hat V` over about :data:`NOISE_WINDOW` steps (:func:`average_noise`) and hands that on. A run's
sampling steps (and burn-in's) measure it on every fourth step (:func:`~pyro_scalable.infer.sgmcmc.base.noise_phase`;
each measurement weighs as the four steps it stands for) and take the plain gradient in between.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Latents
from pyro_scalable.infer.gradients.estimate import GradientEstimate

__all__ = ["NOISE_WINDOW", "average_noise"]

NOISE_WINDOW = 50  # steps: the moving average of the gradient noise forgets older steps at this rate


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
