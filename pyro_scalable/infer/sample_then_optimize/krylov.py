"""The conjugate-gradient refinement and the error in posterior sds, on the floor.

This is :mod:`pyro_scalable.infer.linearized.sampling.krylov`, where the maths is documented, under the engine's
name: the solver lives on the linearisation floor, which the Laplace ``"sampled"`` structure shares with
``SampleThenOptimize``.
"""

from pyro_scalable.infer.linearized.sampling.krylov import (
    RefineResult,
    conjugate_gradient,
    row_diagnostics,
    warn_unconverged,
)

__all__ = ["RefineResult", "conjugate_gradient", "row_diagnostics", "warn_unconverged"]
