"""Any ``torch.nn.Module`` as a Pyro model for every engine: chosen parameters random, the others fixed.

``BayesianNetwork(net, likelihood="categorical", random="last_layer")`` is a Pyro model ``model(x, y)``; the guide
is ``docs/nn.md``.
"""

from pyro_scalable.nn.model import BayesianNetwork
from pyro_scalable.nn.selection import LastLayers, select_parameters

__all__ = ["BayesianNetwork", "LastLayers", "select_parameters"]
