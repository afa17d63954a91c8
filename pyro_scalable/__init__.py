"""pyro_scalable: scalable Bayesian inference for Pyro models (SG-MCMC, linearised Laplace, sample-then-optimise)."""

from pyro_scalable import infer
from pyro_scalable.bridge import FullDataModel, ModelError

__version__ = "0.1.0"

__all__ = ["FullDataModel", "ModelError", "__version__", "infer"]
