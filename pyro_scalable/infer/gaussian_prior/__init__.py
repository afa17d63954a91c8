r"""A Gaussian posterior as the joint prior of a Pyro model's latent sites: ``posterior.as_prior(model)``.

A Gaussian over the flat unconstrained vector :math:`u = (u_1, \dots, u_S)` of the sites :math:`1..S` (in the order
the model samples them) is written as the chain of its conditionals,

.. math::

    \mathcal N(u;\ \mu, \Sigma) = \prod_s p(u_s \mid u_{<s}),

and site :math:`s` of the model gets :math:`p(u_s\mid u_{<s})`, pushed through the site's bijection to its support
(the log-density subtracts :math:`\log|\det J|`, so an engine that works in unconstrained space sees the Gaussian
itself). Drawing the sites in turn draws the joint; the sum of the sites' log-densities is the joint's. Every engine
that reads the model's log-density (SG-MCMC, SWAG, Pyro's NUTS) therefore reads the posterior as the prior, with
its correlations. The conditionals never form a ``d x d`` matrix for the structured forms:

* **diagonal** :math:`\Sigma = \mathrm{diag}(v)`: independent Normals (Pyro's own, so the Laplace and
  sample-then-optimise engines read them as their usual diagonal prior — the EWC update).
* **dense** :math:`\Sigma = LL^\top`: with :math:`z_{<s} = L_{<s,<s}^{-1}(u_{<s}-\mu_{<s})`,
  :math:`u_s \mid u_{<s} \sim \mathcal N(\mu_s + L_{s,<s} z_{<s},\ L_{ss}L_{ss}^\top)`.
* **low-rank covariance** :math:`\Sigma = D + UU^\top` (SWAG; rank :math:`k`): with
  :math:`C_s = I + \sum_{t<s} U_t^\top D_t^{-1} U_t` and :math:`r_s = \sum_{t<s} U_t^\top D_t^{-1}\delta_t`
  (:math:`\delta = u - \mu`), Woodbury gives
  :math:`u_s \mid u_{<s} \sim \mathcal N(\mu_s + U_s C_s^{-1} r_s,\ D_s + U_s C_s^{-1} U_s^\top)`, again rank k.
* **low-rank precision** :math:`\Lambda = P + VV^\top` (the Laplace ``low_rank`` structure): integrating out the
  later sites leaves the precision :math:`P + V M_s V^\top` on :math:`u_{\le s}`, with
  :math:`M_s = (I + \sum_{t>s} V_t^\top P_t^{-1} V_t)^{-1}`, so
  :math:`u_s \mid u_{<s}` has precision :math:`\Lambda_s = P_s + V_s M_s V_s^\top` and mean
  :math:`\mu_s - \Lambda_s^{-1} V_s M_s \sum_{t<s} V_t^\top \delta_t`.

* **K-FAC blocks** (the Laplace ``kron`` structure): one block per layer in its factors' eigenbases, a layer's
  weight marginally and its bias given the weight (:mod:`pyro_scalable.infer.gaussian_prior.kron`).

A site inside a (non-subsampled) plate keeps the plate as its batch shape; its joint log-density is spread evenly
over the plate's elements, so the model's total is exact (a plate claims independence the prior no longer has:
do not subsample such a plate, and do not enumerate it).
"""

from pyro_scalable.infer.gaussian_prior.joint import JointGaussian, SiteSpec
from pyro_scalable.infer.gaussian_prior.model import (
    GaussianPriorModel,
    SiteGaussian,
    prior_mode,
    prior_variances,
    site_specs,
)

__all__ = [
    "GaussianPriorModel",
    "JointGaussian",
    "SiteGaussian",
    "SiteSpec",
    "prior_mode",
    "prior_variances",
    "site_specs",
]
