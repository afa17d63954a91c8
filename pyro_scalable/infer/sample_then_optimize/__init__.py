"""Sample-then-optimise for large linear and linearised models, with EM for the prior precision."""

from pyro_scalable.infer.linearized.sampling import core, em
from pyro_scalable.infer.sample_then_optimize.engine import SampleThenOptimize

__all__ = ["SampleThenOptimize", "core", "em"]
