"""Inference engines for Pyro models, and the driver that runs them."""

from pyro_scalable.infer.ekf import EKF, DiagonalEKF, EKFPosterior
from pyro_scalable.infer.laplace import AutoLinearizedLaplace, CurvatureError, GLMPredictive, LaplacePosterior
from pyro_scalable.infer.multilevel import MultilevelMCMC
from pyro_scalable.infer.predictive import sample_posterior_predictive
from pyro_scalable.infer.sample_then_optimize import SampleThenOptimize
from pyro_scalable.infer.schedules import Cyclical, PolynomialDecay
from pyro_scalable.infer.sgmcmc import (
    BAOAB,
    PSGLD,
    SGHMC,
    SGLD,
    SGNHT,
    CyclicalSGLD,
    StochasticMCMC,
    baoab,
    csgld,
    psgld,
    sghmc,
    sgld,
    sgnht,
)
from pyro_scalable.infer.swag import SWAG, SWAGPosterior

__all__ = [
    "BAOAB",
    "SGHMC",
    "PSGLD",
    "SGLD",
    "SGNHT",
    "AutoLinearizedLaplace",
    "CurvatureError",
    "Cyclical",
    "CyclicalSGLD",
    "DiagonalEKF",
    "EKF",
    "EKFPosterior",
    "GLMPredictive",
    "LaplacePosterior",
    "MultilevelMCMC",
    "PolynomialDecay",
    "SampleThenOptimize",
    "StochasticMCMC",
    "SWAG",
    "SWAGPosterior",
    "baoab",
    "csgld",
    "sghmc",
    "psgld",
    "sample_posterior_predictive",
    "sgld",
    "sgnht",
]
