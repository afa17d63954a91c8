"""SWAG and MultiSWAG: a Gaussian posterior from the snapshots of constant-step SGD (:mod:`.moments`)."""

from pyro_scalable.infer.swag.engine import SWAG
from pyro_scalable.infer.swag.posterior import SWAGPosterior

__all__ = ["SWAG", "SWAGPosterior"]
