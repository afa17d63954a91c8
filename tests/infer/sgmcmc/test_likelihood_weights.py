"""SG-MCMC under ``poutine.scale`` and ``poutine.mask`` on the likelihood: the draws of the weighted posterior.

SG-MCMC reads the log joint from Pyro's trace, which multiplies each point's log-likelihood by its weight; the
minibatch noise estimate splits that same weighted log joint per point. The linear-Gaussian model's closed form is
the reference (``tests/glm_models.py``), with tolerances from the Monte-Carlo error (``tests/model_zoo.accuracy``).
"""

from __future__ import annotations

import pytest

from pyro_scalable.infer import SGHMC, StochasticMCMC
from tests.glm_models import glm, linear_gaussian_posterior
from tests.model_zoo import accuracy


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["scaled", "weighted", "mask"])
def test_default_sghmc_samples_the_weighted_posterior(variant):
    model, args = glm("linear-gaussian", variant)
    mean, covariance = linear_gaussian_posterior(variant)
    entry = {"sites": {"w": {"mean": mean.tolist(), "sd": covariance.diagonal().sqrt().tolist()}}}
    mcmc = StochasticMCMC(SGHMC(model), num_samples=3000, num_warmup=1000, num_chains=4, seed=0, progress_bar=False)
    mcmc.run(*args)
    result = accuracy(mcmc.get_samples(group_by_chain=True), entry)
    assert result["passed"], result
