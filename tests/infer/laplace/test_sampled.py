"""``structure="sampled"``: the Laplace guide backed by sample-then-optimise draws of the full-GGN posterior."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import Predictive

from pyro_scalable import FullDataModel
from pyro_scalable.infer import AutoLinearizedLaplace, CurvatureError
from tests.infer.linearized.nets import MLP, random_latents

Z = 4.5
K = 800


@pytest.fixture(scope="module")
def posteriors():
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 3, generator=g, dtype=torch.float64)
    model = MLP(sizes=(3, 4, 3), likelihood="categorical", batch_size=60)
    y = torch.randint(0, 3, (120,), generator=g)
    latents = random_latents(model, x)
    guide = AutoLinearizedLaplace(model)
    common = dict(map_latents=latents, check_map=False)
    full = guide.laplace_approximation(x, y, structure="full", **common)
    sampled = guide.laplace_approximation(x, y, structure="sampled", num_samples=K, **common)
    return model, x, y, full, sampled


def test_sampled_marginal_variances_match_full_within_monte_carlo_error(posteriors):
    *_, full, sampled = posteriors
    exact = full.precision.inverse_diagonal()
    estimate = sampled.precision.inverse_diagonal()
    # the sample variance of K Gaussian draws has standard error sqrt(2/K) var; the optimisation adds a small bias
    assert (((estimate - exact) / exact) / (2 / K) ** 0.5).abs().max() < Z


def test_sampled_predictive_covariance_matches_full(posteriors):
    _, x, _, full, sampled = posteriors
    exact = full.predict(x[:20]).covariance
    estimate = sampled.predict(x[:20]).covariance
    variance = exact.diagonal(dim1=-2, dim2=-1)
    error = (estimate.diagonal(dim1=-2, dim2=-1) - variance) / variance
    assert (error / (2 / K) ** 0.5).abs().max() < Z
    assert sampled.predict(x[:20]).distribution.probs.shape == (20, 3)


@pytest.mark.arviz
def test_sampled_draws_guide_and_arviz(posteriors):
    model, x, _, _, sampled = posteriors
    draws = sampled.get_samples(10, seed=0)
    assert draws["layers.0.weight"].shape == (10, 4, 3)
    distinct = sampled.get_samples(K, seed=1)["layers.0.weight"].flatten(1)
    assert torch.unique(distinct, dim=0).shape[0] == K  # without replacement while the samples last
    predictive = Predictive(FullDataModel(model), guide=sampled, num_samples=5)(x)
    assert predictive["y"].shape == (5, 120)
    assert sampled.to_inference_data(num_samples=20).posterior["layers.1.bias"].shape == (1, 20, 3)


def test_sampled_has_no_evidence_and_tunes_the_prior_by_em(posteriors):
    *_, sampled = posteriors
    with pytest.raises(CurvatureError, match="optimize_prior_precision"):
        sampled.log_marginal_likelihood()
    before = sampled.prior_precision.clone()
    sampled.optimize_prior_precision("site", em_steps=2)
    curvature = sampled.fit.curvature
    assert curvature.em_history["prior_precision"].shape == (3, 4)
    assert not torch.equal(sampled.prior_precision, before)
    torch.testing.assert_close(sampled.prior_precision, curvature.run.solution.precision)
    with pytest.raises(CurvatureError, match="drawn for one prior precision"):
        sampled.prior_precision = 3.0
        sampled.precision  # noqa: B018
