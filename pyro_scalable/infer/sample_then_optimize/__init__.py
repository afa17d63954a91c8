"""Sample-then-optimise for large linear and linearised models (DESIGN.md §5): the functional core so far."""

from pyro_scalable.infer.sample_then_optimize import core

__all__ = ["core"]
