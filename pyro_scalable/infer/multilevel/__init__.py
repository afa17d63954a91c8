"""Multilevel MCMC: block moves of a group plate's latents on their own rows, and the globals on their conditional."""

from pyro_scalable.infer.multilevel.engine import MultilevelMCMC

__all__ = ["MultilevelMCMC"]
