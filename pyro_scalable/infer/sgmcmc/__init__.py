"""Stochastic-gradient MCMC engines: one module per algorithm (``init``, ``step``, a thin Pyro-facing class)."""

from pyro_scalable.infer.sgmcmc import sghmc, sgld
from pyro_scalable.infer.sgmcmc.base import SGMCMCInfo
from pyro_scalable.infer.sgmcmc.sghmc import SGHMC, SGHMCState
from pyro_scalable.infer.sgmcmc.sgld import SGLD, SGLDState

__all__ = ["SGHMC", "SGHMCState", "SGLD", "SGLDState", "SGMCMCInfo", "sghmc", "sgld"]
