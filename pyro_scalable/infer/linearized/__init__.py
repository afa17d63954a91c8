r"""The linearisation floor shared by Laplace, sample-then-optimise, the EKF and SWAG's linearised predictive.

A Pyro model as a network :math:`f(x, \theta)` of a flat parameter vector (``network``, ``layout``), its
likelihood family and curvature :math:`\Lambda` (``likelihoods``), per-example Jacobian rows by layer
(``jacobians``), the one pass over the data for the GGN (``ggn``), the GLM predictive (``glm``), and the checks of
a linearisation point (``map_check``). Nothing here knows about an engine; the engines stand on it.
"""

from pyro_scalable.infer.linearized.ggn import DataFit, GGNDiagonal, ggn_pass
from pyro_scalable.infer.linearized.glm import GLMPredictive, glm_predictive
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.likelihoods import Likelihood
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sites import choose_sites

__all__ = [
    "DataFit",
    "GGNDiagonal",
    "GLMPredictive",
    "Likelihood",
    "NetworkFunction",
    "ParameterLayout",
    "choose_sites",
    "ggn_pass",
    "glm_predictive",
]
