"""The functional core of sample-then-optimise: the SGD step of every row, on the floor.

This is :mod:`pyro_scalable.infer.linearized.sampling.core`, where the maths is documented, under the engine's
name: the solver lives on the linearisation floor, which the Laplace ``"sampled"`` structure shares with
``SampleThenOptimize``.
"""

from pyro_scalable.infer.linearized.sampling.core import (
    SampleInfo,
    SampleState,
    init,
    joined_rows,
    regularizer_targets,
    step,
    with_anchor,
)

__all__ = ["SampleInfo", "SampleState", "init", "joined_rows", "regularizer_targets", "step", "with_anchor"]
