"""pyro_scalable: scalable Bayesian inference for Pyro models.

SG-MCMC, linearised Laplace, sample-then-optimise, SWAG and a diagonal extended Kalman filter.
"""

from pyro_scalable import infer
from pyro_scalable.bridge import FullDataModel, ModelError, model_tracing

__version__ = "0.1.0"

__all__ = ["FullDataModel", "ModelError", "__version__", "infer", "model_tracing", "to_inference_data"]


def __getattr__(name: str):
    # ArviZ takes seconds to import: the converter is loaded on first use, not with the package.
    if name == "to_inference_data":
        from pyro_scalable.inference_data import to_inference_data

        return to_inference_data
    raise AttributeError(f"module 'pyro_scalable' has no attribute {name!r}")
