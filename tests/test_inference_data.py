"""The ArviZ adapter: groups, full-data log-likelihood, ArviZ functions, and ``az.from_pyro`` on the driver."""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable import to_inference_data
from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.inference_data import ARVIZ_MAJOR
from tests.arviz_compat import elpd_loo, group_names, needs_from_pyro

pytestmark = pytest.mark.arviz  # run against both ArviZ majors by scripts/test.sh

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

N, B, D = 60, 10, 2
NUM_CHAINS, NUM_SAMPLES = 2, 50
F64 = torch.float64


def model(x, y):
    """Linear regression with unknown noise; broadcasts over a leading draw dimension, as Predictive needs."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("data", x.shape[0], subsample_size=B) as idx:
        loc = (x[idx] * w.unsqueeze(-2)).sum(-1)
        pyro.sample("obs", dist.Normal(loc, sigma), obs=y[idx])


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -0.5], dtype=F64) + 0.5 * torch.randn(N, generator=g, dtype=F64)
    return x, y


@pytest.fixture(scope="module")
def mcmc(data):
    kernel = SGHMC(model, step_size=0.005, friction=20.0)
    run = StochasticMCMC(
        kernel, num_samples=NUM_SAMPLES, num_warmup=50, num_chains=NUM_CHAINS, seed=0, progress_bar=False
    )
    run.run(*data)
    return run


@pytest.fixture(scope="module")
def idata(mcmc):
    return mcmc.to_inference_data()


def _hand_log_likelihood(w, sigma, x, y):
    return torch.distributions.Normal(x @ w, sigma).log_prob(y)


def test_groups(idata):
    assert group_names(idata) == {"posterior", "sample_stats", "log_likelihood", "observed_data"}


def test_posterior_is_constrained_and_grouped_by_chain(idata, mcmc):
    posterior = idata.posterior
    assert posterior["w"].dims == ("chain", "draw", "w_dim_0")
    assert posterior["sigma"].dims == ("chain", "draw")
    assert posterior["w"].shape == (NUM_CHAINS, NUM_SAMPLES, D)
    samples = mcmc.get_samples(group_by_chain=True)
    np.testing.assert_array_equal(posterior["w"].values, samples["w"].numpy())
    np.testing.assert_allclose(
        np.log(posterior["sigma"].values), mcmc.get_unconstrained_samples(group_by_chain=True)["sigma"].numpy()
    )


def test_sample_stats(idata):
    stats = idata.sample_stats
    assert {"lp", "diverging", "step_size", "temperature", "grad_norm"} <= set(stats.data_vars)
    for name in ("lp", "diverging", "step_size", "temperature", "grad_norm"):
        assert stats[name].dims == ("chain", "draw"), name
    assert stats["diverging"].dtype == bool and not stats["diverging"].values.any()
    np.testing.assert_allclose(stats["step_size"].values, 0.005)
    np.testing.assert_allclose(stats["temperature"].values, 1.0)
    assert np.isfinite(stats["lp"].values).all()
    # the norm of the minibatch gradient at each kept draw: recomputed here from the draws is not possible (the
    # minibatch is gone), but it is a norm of a non-zero gradient, so it must be positive and finite
    assert (stats["grad_norm"].values > 0).all() and np.isfinite(stats["grad_norm"].values).all()


def test_log_likelihood_is_over_the_full_data(idata, data):
    x, y = data
    log_lik = idata.log_likelihood["obs"]
    assert log_lik.dims == ("chain", "draw", "data")
    assert log_lik.shape == (NUM_CHAINS, NUM_SAMPLES, N)
    for chain, draw in [(0, 0), (0, NUM_SAMPLES - 1), (1, 17)]:
        w = torch.from_numpy(idata.posterior["w"].values[chain, draw])
        sigma = torch.tensor(idata.posterior["sigma"].values[chain, draw])
        expected = _hand_log_likelihood(w, sigma, x, y).numpy()
        np.testing.assert_allclose(log_lik.values[chain, draw], expected, rtol=1e-10, atol=1e-12)


def test_log_likelihood_in_chunks_equals_in_one_go(mcmc, idata):
    # 60 points in chunks of 7 and 100 draws in groups of 40: both end with a ragged chunk
    chunked = mcmc.to_inference_data(data_chunk_size=7, draws_chunk_size=40)
    np.testing.assert_allclose(
        chunked.log_likelihood["obs"].values, idata.log_likelihood["obs"].values, rtol=1e-12, atol=1e-12
    )


def test_observed_data_is_the_full_data(idata, data):
    observed = idata.observed_data["obs"]
    assert observed.dims == ("data",)
    np.testing.assert_array_equal(observed.values, data[1].numpy())


def test_without_log_likelihood_and_with_dims(mcmc):
    result = mcmc.to_inference_data(log_likelihood=False, coords={"feature": ["a", "b"]}, dims={"w": ["feature"]})
    assert "log_likelihood" not in group_names(result)
    assert result.posterior["w"].dims == ("chain", "draw", "feature")
    assert list(result.posterior["feature"].values) == ["a", "b"]


# arviz 0.23's trace plot calls a matplotlib helper that matplotlib >= 3.11 deprecates; not our code.
@pytest.mark.filterwarnings("ignore:Passing a dict or None as alias_mapping:DeprecationWarning")
def test_arviz_summary_loo_and_trace_plot(idata):
    summary = az.summary(idata)
    assert set(summary.index) == {"sigma", "w[0]", "w[1]"}
    assert np.isfinite(summary["mean"].values).all()
    loo = az.loo(idata)
    assert loo.n_data_points == N
    assert np.isfinite(elpd_loo(loo))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        # one call on both majors: 0.x's plot_trace draws traces and densities, 1.x's plot_trace_dist does
        getattr(az, "plot_trace_dist", az.plot_trace)(idata, var_names=["w", "sigma"])
        assert len(plt.gcf().axes) >= 4  # a trace and a density for each of w and sigma
    finally:
        plt.close("all")


@needs_from_pyro
def test_from_pyro_sees_the_full_data(mcmc, idata, data):
    result = az.from_pyro(mcmc)
    assert {"posterior", "sample_stats", "log_likelihood", "observed_data"} <= set(result.groups())
    np.testing.assert_array_equal(result.posterior["w"].values, idata.posterior["w"].values)
    assert result.log_likelihood["obs"].shape == (NUM_CHAINS, NUM_SAMPLES, N)
    np.testing.assert_allclose(
        result.log_likelihood["obs"].values, idata.log_likelihood["obs"].values, rtol=1e-10, atol=1e-12
    )
    assert result.observed_data["obs"].shape == (N,)
    np.testing.assert_array_equal(result.observed_data["obs"].values, data[1].numpy())
    np.testing.assert_array_equal(result.sample_stats["diverging"].values, idata.sample_stats["diverging"].values)


def test_get_samples_flattens_chains(mcmc):
    grouped = mcmc.get_samples(group_by_chain=True)
    flat = mcmc.get_samples()
    assert flat["w"].shape == (NUM_CHAINS * NUM_SAMPLES, D)
    torch.testing.assert_close(flat["w"].reshape(NUM_CHAINS, NUM_SAMPLES, D), grouped["w"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- many chains


def unconstrained_scale_model(y):
    """The noise scale has no positivity constraint: chains that wander below zero diverge (log of a negative)."""
    scale = pyro.sample("scale", dist.Normal(y.new_tensor(2.0), 0.5))
    with pyro.plate("data", y.shape[0], subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(y.new_tensor(0.0), scale), obs=y[idx])


def test_divergences_keep_chain_order_past_ten_chains():
    num_chains = 12
    pyro.set_rng_seed(0)
    y = 0.3 * torch.randn(N, dtype=F64)
    kernel = SGHMC(unconstrained_scale_model, step_size=0.01, friction=10.0)
    mcmc = StochasticMCMC(kernel, num_samples=20, num_chains=num_chains, seed=1, progress_bar=False)
    with pytest.warns(UserWarning, match=r"diverged"):
        mcmc.run(y)
    diverging = mcmc.sample_stats["diverging"].numpy()
    keys = list(mcmc.diagnostics()["divergences"])
    assert keys == [f"chain {c:02d}" for c in range(num_chains)]
    assert sorted(keys) == keys
    # the test has teeth: some chains diverge and others do not, so a lexical reordering of "chain 10" before
    # "chain 2" would show
    unpadded_order = sorted(range(num_chains), key=lambda c: f"chain {c}")
    assert not np.array_equal(diverging[unpadded_order], diverging)
    result = to_inference_data(mcmc, log_likelihood=False)
    np.testing.assert_array_equal(result.sample_stats["diverging"].values, diverging)
    if ARVIZ_MAJOR == 0:  # arviz.from_pyro reads diagnostics()["divergences"] in lexical order
        result = az.from_pyro(mcmc, log_likelihood=False)
        np.testing.assert_array_equal(result.sample_stats["diverging"].values, diverging)
    assert np.isfinite(result.posterior["scale"].values).all()


# ---------------------------------------------------------------------------------------------------- event dims


def multivariate_model(z, y):
    """An observed site with an event dimension (MultivariateNormal) next to a scalar one, in the same plate."""
    loc = pyro.sample("loc", dist.Normal(z.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("data", z.shape[0], subsample_size=B) as idx:
        pyro.sample("vec", dist.MultivariateNormal(loc, scale_tril=torch.eye(D, dtype=z.dtype)), obs=z[idx])
        pyro.sample("obs", dist.Normal(loc[..., 0], 1.0), obs=y[idx])


def test_observed_site_with_event_dims_is_named_by_its_plate():
    g = torch.Generator().manual_seed(2)
    z, y = torch.randn(N, D, generator=g, dtype=F64), torch.randn(N, generator=g, dtype=F64)
    mcmc = StochasticMCMC(
        SGHMC(multivariate_model, step_size=0.005, friction=20.0), 10, 10, 2, seed=0, progress_bar=False
    )
    mcmc.run(z, y)
    idata = mcmc.to_inference_data()
    # the plate names the data dimension, not the event dimension (which would clash with "obs"'s N points)
    assert idata.observed_data["vec"].dims == ("data", "vec_dim_1")
    assert idata.observed_data["vec"].shape == (N, D) and idata.observed_data["obs"].shape == (N,)
    np.testing.assert_array_equal(idata.observed_data["vec"].values, z.numpy())
    assert idata.log_likelihood["vec"].dims == ("chain", "draw", "data")
    assert idata.log_likelihood["vec"].shape == (2, 10, N)
    loc = torch.from_numpy(idata.posterior["loc"].values[1, 4])
    expected = torch.distributions.MultivariateNormal(loc, scale_tril=torch.eye(D, dtype=F64)).log_prob(z).numpy()
    np.testing.assert_allclose(idata.log_likelihood["vec"].values[1, 4], expected, rtol=1e-10, atol=1e-12)
