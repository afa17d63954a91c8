"""Stochastic-gradient MCMC: the engines, their update rules, warm-up and the driver that runs them.

One module per algorithm (``init``, ``step``, a thin Pyro-facing class), the update rules (:mod:`.integrators`),
warm-up (:mod:`.adaptation`, :mod:`.tuning`) and the driver (:mod:`.mcmc`).
"""

from pyro_scalable.infer.sgmcmc import baoab, csgld, psgld, sghmc, sgld, sgnht
from pyro_scalable.infer.sgmcmc.baoab import BAOAB, BAOABState
from pyro_scalable.infer.sgmcmc.base import SGMCMCInfo
from pyro_scalable.infer.sgmcmc.csgld import CyclicalSGLD
from pyro_scalable.infer.sgmcmc.mcmc import StochasticMCMC
from pyro_scalable.infer.sgmcmc.psgld import PSGLD, PSGLDState
from pyro_scalable.infer.sgmcmc.sghmc import SGHMC, SGHMCState
from pyro_scalable.infer.sgmcmc.sgld import SGLD, SGLDState
from pyro_scalable.infer.sgmcmc.sgnht import SGNHT, SGNHTState

__all__ = [
    "BAOAB",
    "BAOABState",
    "CyclicalSGLD",
    "PSGLD",
    "PSGLDState",
    "SGHMC",
    "SGHMCState",
    "SGLD",
    "SGLDState",
    "SGMCMCInfo",
    "SGNHT",
    "SGNHTState",
    "StochasticMCMC",
    "baoab",
    "csgld",
    "psgld",
    "sghmc",
    "sgld",
    "sgnht",
]
