"""Inference engines for Pyro models, and the driver that runs them."""

from pyro_scalable.infer.laplace import AutoLinearizedLaplace, CurvatureError, GLMPredictive, LaplacePosterior
from pyro_scalable.infer.mcmc import StochasticMCMC
from pyro_scalable.infer.sample_then_optimize import SampleThenOptimize
from pyro_scalable.infer.schedules import Cyclical, PolynomialDecay
from pyro_scalable.infer.sgmcmc import SGHMC, SGLD, sghmc, sgld

__all__ = [
    "SGHMC",
    "SGLD",
    "AutoLinearizedLaplace",
    "CurvatureError",
    "Cyclical",
    "GLMPredictive",
    "LaplacePosterior",
    "PolynomialDecay",
    "SampleThenOptimize",
    "StochasticMCMC",
    "sghmc",
    "sgld",
]
