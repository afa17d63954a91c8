"""The Pyro bridge: the only code that knows Pyro internals."""

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Batch, FullDataModel, ModelBridge
from pyro_scalable.bridge.plates import full_data, plate_indices
from pyro_scalable.bridge.traced import model_tracing

__all__ = ["Batch", "FullDataModel", "ModelBridge", "ModelError", "full_data", "model_tracing", "plate_indices"]
