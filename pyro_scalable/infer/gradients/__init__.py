"""The minibatch gradient estimate: what a stochastic-gradient kernel is handed, as objects of their own.

A step's gradient is taken of a :class:`~.density.MinibatchDensity` (:mod:`.density`: the written contract, with
``examples``, ``terms`` and ``batched_gradient`` always present), which composes:

* the bridge's log posterior of a Pyro model (:class:`~pyro_scalable.bridge.log_posterior.LogPosterior`, made with
  the minibatches' ``replacement``), or a plain function (:class:`~.density.FunctionDensity`);
* the control variate around a centre (:class:`~.controlled.ControlledDensity`, :mod:`.controlled`);
* warm-up's metric, the density in whitened variables (:class:`~.whitened.WhitenedDensity`, :mod:`.whitened`).

:mod:`.estimate` takes the gradient of one chain (with the diagonal of its noise where asked: per-group gradients,
:mod:`.groups`) or of all chains at once; :mod:`.noise` keeps the noise's moving average a noise-correcting kernel is
handed. :mod:`.estimator` makes the gradient one object with a state of its own, the
:class:`~.estimator.GradientEstimator` (the plain gradient, the noise-estimating one, and their compositions with
the control variate and the metric), which the driver builds for each density its steps take and hands to the chain
stepper with the step (:mod:`pyro_scalable.infer.sgmcmc.run_state`); every density and estimator is immutable.
"""

from pyro_scalable.infer.gradients.controlled import ControlledDensity
from pyro_scalable.infer.gradients.density import Density, FunctionDensity, MinibatchDensity, as_density
from pyro_scalable.infer.gradients.estimate import (
    SHARED_FROM,
    GradientEstimate,
    chains_gradient,
    estimate_gradient,
    evaluate,
    gradient_and_value,
)
from pyro_scalable.infer.gradients.estimator import (
    Estimator,
    EstimatorState,
    GradientEstimator,
    NoiseEstimatingGradient,
    PlainGradient,
    control_variate,
    whitened,
)
from pyro_scalable.infer.gradients.noise import NOISE_WINDOW, average_noise
from pyro_scalable.infer.gradients.whitened import AffineMap, WhitenedDensity

__all__ = [
    "NOISE_WINDOW",
    "SHARED_FROM",
    "AffineMap",
    "ControlledDensity",
    "Density",
    "Estimator",
    "EstimatorState",
    "FunctionDensity",
    "GradientEstimate",
    "GradientEstimator",
    "MinibatchDensity",
    "NoiseEstimatingGradient",
    "PlainGradient",
    "WhitenedDensity",
    "as_density",
    "average_noise",
    "chains_gradient",
    "control_variate",
    "estimate_gradient",
    "evaluate",
    "gradient_and_value",
    "whitened",
]
