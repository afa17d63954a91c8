r"""Sample-then-optimise on the linearised model: posterior draws and the mean as minimisers of convex quadratics.

For a network linearised at :math:`\theta_*` (:class:`~pyro_scalable.infer.linearized.network.NetworkFunction`)
with the prior :math:`\mathcal N(m, A^{-1})`, each draw :math:`\zeta_j \sim \mathcal N(0, H^{-1})`, :math:`H = M +
A`, is the minimiser of a quadratic whose data term needs only Jacobian-vector products (:mod:`.core`); its
regulariser centres take one pass over the data (:mod:`.centres`), conjugate gradients finish the minibatch epochs
(:mod:`.krylov`), and MacKay's updates tune the prior from the draws (:mod:`.em`). :func:`sample_linearized`
(:mod:`.solve`) runs it all on a :class:`~.problem.Problem` under :class:`~.plan.SolveSettings`; the
``SampleThenOptimize`` engine and the Laplace ``"sampled"`` structure both stand on it, and neither on the other.
"""

from pyro_scalable.infer.linearized.sampling.plan import OneProcess, SolveSettings, check_settings
from pyro_scalable.infer.linearized.sampling.solve import (
    Solution,
    homoscedastic_normal,
    is_linear,
    is_linear_gaussian,
    sample_linearized,
)

__all__ = [
    "OneProcess",
    "Solution",
    "SolveSettings",
    "check_settings",
    "homoscedastic_normal",
    "is_linear",
    "is_linear_gaussian",
    "sample_linearized",
]
