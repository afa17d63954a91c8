"""The external accuracy suite's fast tier: the engines at their defaults on cheap posteriordb ports.

The full suite is ``python -m benchmarks posteriordb`` (every engine on every port, both priors; its table is on the
benchmarks page). Here, on kidiq's regressions (N = 434, the data plate's minibatch 43), the verdicts the suite
reports: each engine's draws against posteriordb's reference summaries (long Stan NUTS runs) with the suite's
criteria — every mean within 0.2 reference sd, every sd within 0.8-1.25 of the reference's, r_hat at most 1.01 for
chains — or, where an engine's Gaussian cannot be right (SWAG on unscaled predictors), the warning that says so.
"""

from __future__ import annotations

import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_scalable.infer import SGHMC, SWAG, AutoLinearizedLaplace, SampleThenOptimize, StochasticMCMC
from pyro_scalable.infer.health import rank_r_hat
from pyro_scalable.infer.swag.check import ApproximationWarning
from tests.posteriordb import POSTERIORS, errors

MEAN, SD = 0.2, (0.8, 1.25)  # the suite's PASS (tests.posteriordb.errors checks the ports at 0.25)


def _passes(posterior, samples) -> None:
    """Every Stan parameter the draws cover (a linearised engine holds the noise scale at its MAP) passes."""
    reference = posterior.reference()
    for name, draws in posterior.stan_draws(samples).items():
        flat = draws.detach().double().reshape(-1)
        error = abs(float(flat.mean()) - reference[name]["mean"]) / reference[name]["sd"]
        ratio = float(flat.std()) / reference[name]["sd"]
        assert error <= MEAN and SD[0] <= ratio <= SD[1], (name, error, ratio)


def test_default_sghmc_passes_on_kidiq():
    posterior = POSTERIORS["kidiq-kidscore_momiq"]
    mcmc = StochasticMCMC(
        SGHMC(posterior.model), num_samples=3000, num_warmup=1000, num_chains=4, seed=0, progress_bar=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a HealthWarning would be a WARNED cell: this one passes quietly
        mcmc.run(*posterior.args())
    samples = mcmc.get_samples(group_by_chain=True)
    _passes(posterior, samples)
    for value in samples.values():
        assert float(rank_r_hat(value.reshape(4, 3000, -1)).max()) <= 1.01


def test_laplace_from_a_short_svi_run_passes_on_kidiq():
    """300 Adam steps leave the guide's point far from the MAP; the guide finishes it and the fit passes."""
    posterior = POSTERIORS["kidiq-kidscore_interaction"]
    args = posterior.args()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoLinearizedLaplace(posterior.model)
    svi = SVI(posterior.model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(300):
        svi.step(*args)
    laplace = guide.laplace_approximation(*args, structure="full")
    assert laplace.map_search is not None and laplace.map_search.converged
    draws = laplace.get_samples(4000, seed=0)
    _passes(posterior, {"beta": draws["beta"]})  # sigma is held at its MAP


def test_sample_then_optimize_passes_on_kidiq():
    posterior = POSTERIORS["kidiq-kidscore_momhsiq"]
    result = SampleThenOptimize(posterior.model, num_samples=512, seed=0, progress_bar=False).run(*posterior.args())
    _passes(posterior, {"beta": result.get_samples()["beta"]})


def test_swag_on_unscaled_predictors_warns_instead_of_being_silently_narrow():
    posterior = POSTERIORS["kidiq-kidscore_momiq"]
    with pytest.warns(ApproximationWarning, match="standardise the predictors"):
        swag = SWAG(posterior.model, seed=0, progress_bar=False).run(*posterior.args())
    result = errors(posterior, {k: v for k, v in swag.get_samples(4000, seed=0).items()})
    assert result["sd_ratio"] < SD[0]  # the warning is right: its sds are far too small
    assert torch.isfinite(swag.mean).all()
