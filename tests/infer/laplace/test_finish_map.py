"""A trained guide's point that is not a MAP is finished by the full-data mode search before the Laplace fit.

Gold: a conjugate linear regression (known noise) on predictors of scales 1 and 100, whose posterior is exactly
N(m, Σ): after 20 SVI steps the guide's point is far from m (SVI stops short where one direction is a hundred times
narrower than another); the full Laplace posterior from it must be N(m, Σ) (its mean within 0.001 sd, its
covariance to float64 precision), with no warning, and ``map_search`` records the search. With
``finish_map=False`` (or ``map_latents`` given) the fit is where the point is, and the MAP check warns.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_scalable.infer import AutoLinearizedLaplace

F64 = torch.float64
NOISE, PRIOR = 0.5, 10.0


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), PRIOR).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, NOISE), obs=None if y is None else y[idx])


@pytest.fixture(scope="module")
def problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(500, 2, dtype=F64, generator=generator) * torch.tensor([1.0, 100.0], dtype=F64)
    y = x @ torch.tensor([2.0, 0.03], dtype=F64) + NOISE * torch.randn(500, dtype=F64, generator=generator)
    precision = x.T @ x / NOISE**2 + torch.eye(2, dtype=F64) / PRIOR**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (x.T @ y) / NOISE**2
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoLinearizedLaplace(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(20):
        svi.step(x, y)
    return x, y, guide, mean, covariance


def test_a_point_short_of_the_mode_is_finished_and_the_posterior_is_exact(problem):
    x, y, guide, mean, covariance = problem
    start = guide.median(x, y)["w"].detach()
    assert float(((start - mean) / covariance.diagonal().sqrt()).abs().max()) > 10  # SVI stopped far short
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        posterior = guide.laplace_approximation(x, y, structure="full")
    assert posterior.map_search is not None and posterior.map_search.converged
    # the search stops within 0.01·√d sds of the mode; on this quadratic its last (Newton) step lands on it
    assert float(((posterior.theta_star - mean) / covariance.diagonal().sqrt()).abs().max()) < 1e-3
    torch.testing.assert_close(torch.linalg.inv(posterior.precision.to_dense()), covariance, rtol=1e-8, atol=0)
    assert float(((posterior.mean - mean) / covariance.diagonal().sqrt()).abs().max()) < 1e-6  # recentred


def test_without_finishing_the_fit_is_at_the_point_and_warns(problem):
    x, y, guide, mean, _ = problem
    with pytest.warns(UserWarning, match="not a MAP"):
        posterior = guide.laplace_approximation(x, y, structure="full", finish_map=False)
    assert posterior.map_search is None
    torch.testing.assert_close(posterior.theta_star, guide.median(x, y)["w"].detach())
    with pytest.warns(UserWarning, match="not a MAP"):
        given = guide.laplace_approximation(x, y, structure="full", map_latents=guide.median(x, y))
    assert given.map_search is None


def test_a_map_is_fitted_where_it_is(problem):
    x, y, guide, mean, covariance = problem
    posterior = guide.laplace_approximation(x, y, structure="full", map_latents={"w": mean})
    assert posterior.map_search is None
    torch.testing.assert_close(posterior.theta_star, mean, rtol=0, atol=0)
