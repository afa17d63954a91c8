"""``pyro_scalable.ksd.kernel_stein_discrepancy`` on every kind of result, and ``to_inference_data(ksd=True)``.

Every source hands the KSD its draws as the converter reads them, so a run, Pyro's MCMC and a Gaussian posterior
must score exactly as the same draws given as a dict with the model; the converter must store what the function
returns, beside ``sample_stats``, on both ArviZ majors, through a netCDF file, and out of ``az.summary``'s way.
The maths is tested in ``tests/infer/test_stein.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS

from pyro_scalable import to_inference_data
from pyro_scalable.infer import SGHMC, AutoLinearizedLaplace, StochasticMCMC
from pyro_scalable.inference_data import ARVIZ_MAJOR
from pyro_scalable.ksd import kernel_stein_discrepancy
from tests.arviz_compat import group_names

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

N, D, B = 80, 2, 20


def model(x, y=None, batch_size=None):
    """Linear regression with a latent noise scale (a constrained site: the score carries its log-Jacobian)."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, sigma), obs=None if y is None else y[idx])


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    return x, x @ torch.tensor([1.0, -0.5]) + 0.5 * torch.randn(N, generator=g)


@pytest.fixture(scope="module")
def sghmc(data):
    kernel = SGHMC(model, step_size=0.002, friction=20.0)
    mcmc = StochasticMCMC(kernel, num_samples=100, num_warmup=100, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(*data, batch_size=B)
    return mcmc


def _same(a, b):
    torch.testing.assert_close(a.ksd, b.ksd, rtol=1e-6, atol=0)
    torch.testing.assert_close(a.floor, b.floor, rtol=1e-6, atol=0)
    torch.testing.assert_close(a.scale, b.scale, rtol=1e-6, atol=0)


def test_a_run_scores_as_its_draws_do(sghmc, data):
    result = kernel_stein_discrepancy(sghmc)
    assert result.per_chain.shape == (2,) and result.scale.shape == (D + 1,)
    _same(result, kernel_stein_discrepancy(sghmc.get_samples(), model, args=data))
    thinned = kernel_stein_discrepancy(sghmc, thin=3)
    draws = {k: v[:, ::3].reshape((-1,) + v.shape[2:]) for k, v in sghmc.get_samples(group_by_chain=True).items()}
    _same(thinned, kernel_stein_discrepancy(draws, model, args=data))


def test_nuts_and_a_gaussian_posterior_score_as_their_draws_do(data):
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=50, warmup_steps=50, disable_progbar=True)
    mcmc.run(*data)
    _same(kernel_stein_discrepancy(mcmc), kernel_stein_discrepancy(mcmc.get_samples(), model, args=data))
    guide = AutoLinearizedLaplace(lambda x, y: model(x, y))
    posterior = guide.laplace_approximation(*data, map_latents={"w": torch.tensor([1.0, -0.5]), "sigma": 0.5})
    # the linearised Laplace fits the noise scale as a point: its draws of sigma have no sd to scale the kernel by
    with pytest.raises(ValueError, match=r"\['sigma'\] do not vary"):
        kernel_stein_discrepancy(posterior, num_samples=200, seed=3)
    ours = kernel_stein_discrepancy(posterior, num_samples=200, seed=3, scale=1.0)
    _same(ours, kernel_stein_discrepancy(posterior.get_samples(200, seed=3), model, args=data, scale=1.0))


def test_nuts_draws_beat_the_same_draws_shifted(data):
    """The posterior's own draws score low; the same draws moved 1 sd in w score far higher on the same kernel."""
    pyro.set_rng_seed(1)
    mcmc = MCMC(NUTS(model), num_samples=400, warmup_steps=200, disable_progbar=True)
    mcmc.run(*data)
    draws = mcmc.get_samples()
    good = kernel_stein_discrepancy(draws, model, args=data)
    moved = {"w": draws["w"] + draws["w"].std(0), "sigma": draws["sigma"]}
    bad = kernel_stein_discrepancy(moved, model, args=data, scale=good.scale)
    assert good.ksd < 2 * good.floor < bad.ksd / 2


@pytest.mark.arviz
def test_the_converter_stores_it_beside_sample_stats(sghmc, tmp_path):
    idata = to_inference_data(sghmc, ksd=True, log_likelihood=False)
    expected = kernel_stein_discrepancy(sghmc)
    stats = idata["sample_stats"]
    assert stats["ksd"].dims == ("chain",)
    np.testing.assert_allclose(stats["ksd"].values, expected.per_chain.numpy(), rtol=1e-12)
    assert stats.attrs["ksd_pooled"] == pytest.approx(float(expected.ksd), rel=1e-12)
    assert stats.attrs["ksd_floor"] == pytest.approx(float(expected.floor), rel=1e-12)
    assert "IMQ" in stats.attrs["ksd_kernel"]
    assert stats["lp"].dims == ("chain", "draw")  # the engine's statistics are as they were
    summary = az.summary(idata)  # reads the posterior: no KSD row, no warning
    assert not any("ksd" in str(name) for name in summary.index)
    path = tmp_path / "run.nc"
    idata.to_netcdf(str(path))
    if ARVIZ_MAJOR >= 1:
        import xarray as xr

        again = xr.open_datatree(path)
    else:
        again = az.from_netcdf(str(path))
    np.testing.assert_allclose(again["sample_stats"]["ksd"].values, expected.per_chain.numpy(), rtol=1e-12)
    assert again["sample_stats"].attrs["ksd_pooled"] == pytest.approx(float(expected.ksd), rel=1e-12)
    np.testing.assert_allclose(again["sample_stats"].attrs["ksd_scale"], expected.scale.numpy(), rtol=1e-12)


@pytest.mark.arviz
def test_draws_without_statistics_get_a_sample_stats_group_for_it(sghmc, data):
    draws = sghmc.get_samples()
    idata = to_inference_data(draws, model, args=data, ksd={"scale": 1.0}, log_likelihood=False)
    assert "sample_stats" in group_names(idata)
    expected = kernel_stein_discrepancy(draws, model, args=data, scale=1.0)
    np.testing.assert_allclose(idata["sample_stats"]["ksd"].values, expected.per_chain.numpy(), rtol=1e-12)
    assert "ksd" not in group_names(to_inference_data(draws, model, args=data, log_likelihood=False))


@pytest.mark.arviz
def test_bad_ksd_options_are_refused_before_any_work(sghmc):
    with pytest.raises(ValueError, match="kernel options scale, c, beta and block_size"):
        to_inference_data(sghmc, ksd={"bandwidth": 1.0})
    with pytest.raises(TypeError, match="ksd must be True/False"):
        to_inference_data(sghmc, ksd="yes")
