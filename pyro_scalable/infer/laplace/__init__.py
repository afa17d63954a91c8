"""Linearised Laplace for Pyro models: GGN curvature, evidence-tuned priors, linearised predictive."""

from pyro_scalable.infer.laplace.curvature import CurvatureError
from pyro_scalable.infer.laplace.guide import AutoLinearizedLaplace
from pyro_scalable.infer.laplace.posterior import LaplacePosterior
from pyro_scalable.infer.linearized.glm import GLMPredictive

__all__ = ["AutoLinearizedLaplace", "CurvatureError", "GLMPredictive", "LaplacePosterior"]
