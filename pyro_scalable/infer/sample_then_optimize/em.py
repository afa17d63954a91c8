"""EM for the prior precision (and a Normal's noise) from the draws, on the floor.

This is :mod:`pyro_scalable.infer.linearized.sampling.em`, where the maths is documented, under the engine's
name: the solver lives on the linearisation floor, which the Laplace ``"sampled"`` structure shares with
``SampleThenOptimize``.
"""

from pyro_scalable.infer.linearized.sampling.em import (
    damp_oscillation,
    effective_dimension,
    linearized_sum_squares,
    mackay_noise_update,
    mackay_update,
)

__all__ = [
    "damp_oscillation",
    "effective_dimension",
    "linearized_sum_squares",
    "mackay_noise_update",
    "mackay_update",
]
