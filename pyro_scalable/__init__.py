"""pyro_scalable: scalable Bayesian inference for Pyro models.

SG-MCMC, linearised Laplace, sample-then-optimise, SWAG and a diagonal extended Kalman filter; ``pyro_scalable.nn``
makes any ``torch.nn.Module`` a Pyro model for them.
"""

from pyro_scalable import infer, nn
from pyro_scalable.bridge import FullDataModel, ModelError, model_tracing

# The ArviZ adapter, on top of the results: importing it registers the converter a result's to_inference_data()
# calls (pyro_scalable.infer.record.convert). ArviZ itself is imported on the first conversion.
from pyro_scalable.inference_data import to_inference_data

__version__ = "0.1.0"

__all__ = ["FullDataModel", "ModelError", "__version__", "infer", "model_tracing", "nn", "to_inference_data"]
