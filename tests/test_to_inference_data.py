"""``pyro_scalable.to_inference_data`` on every kind of Pyro result, on ArviZ 0.x and 1.x.

Pyro's own objects (NUTS, an SVI guide, Predictive's draws) and ours (SG-MCMC, Laplace), each checked against
what it must equal: the draws it was given, the closed-form log-likelihood, ``arviz.from_pyro`` (0.x), and the
laws of the predictive and prior draws within Monte-Carlo error.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_scalable import to_inference_data
from pyro_scalable.infer import SGHMC, AutoLinearizedLaplace, StochasticMCMC
from pyro_scalable.inference_data import ARVIZ_MAJOR
from tests.arviz_compat import group_names, loo_estimate, needs_from_pyro

pytestmark = pytest.mark.arviz  # run against both ArviZ majors by scripts/test.sh

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

N, D, B = 80, 2, 20
PRIOR_SD = 1.0


def model(x, y=None, batch_size=None):
    """Linear regression with a latent noise scale (float32, a subsampled plate if asked).

    The mean broadcasts over a leading draw dimension only because ``arviz.from_pyro`` (compared with below) needs
    that; ``to_inference_data`` does not.
    """
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), PRIOR_SD).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        loc = (x[idx] * w.unsqueeze(-2)).sum(-1)
        pyro.sample("obs", dist.Normal(loc, sigma), obs=None if y is None else y[idx])


def hand_log_likelihood(w, sigma, x, y):
    """``(S, N)`` pointwise log-likelihood of draws ``w (S, D)``, ``sigma (S,)``."""
    return torch.distributions.Normal(w @ x.T, sigma[:, None]).log_prob(y).numpy()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    y = x @ torch.tensor([1.0, -0.5]) + 0.5 * torch.randn(N, generator=g)
    return x, y


@pytest.fixture(scope="module")
def nuts(data):
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=60, warmup_steps=60, num_chains=1, disable_progbar=True)
    mcmc.run(*data)
    return mcmc


@pytest.fixture(scope="module")
def guide(data):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(300):
        svi.step(*data, batch_size=B)  # minibatch SVI: the converter still sees all N points
    return guide


def _posterior(idata, name):
    return idata["posterior"][name].values


# ---------------------------------------------------------------------------------------------------- Pyro NUTS


def test_nuts_run(nuts, data):
    idata = to_inference_data(nuts)
    assert {"posterior", "sample_stats", "log_likelihood", "observed_data"} == group_names(idata)
    samples = nuts.get_samples(group_by_chain=True)
    np.testing.assert_allclose(_posterior(idata, "w"), samples["w"].numpy(), rtol=1e-6)
    np.testing.assert_allclose(_posterior(idata, "sigma"), samples["sigma"].numpy(), rtol=1e-6)
    log_lik = idata["log_likelihood"]["obs"]
    assert log_lik.dims == ("chain", "draw", "data") and log_lik.shape == (1, 60, N)
    expected = hand_log_likelihood(samples["w"][0], samples["sigma"][0], *data)
    np.testing.assert_allclose(log_lik.values[0], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(idata["observed_data"]["obs"].values, data[1].numpy())
    assert idata["sample_stats"]["diverging"].dims == ("chain", "draw")
    assert np.isfinite(loo_estimate(idata))


@needs_from_pyro
def test_nuts_run_equals_arviz_from_pyro(nuts):
    ours, theirs = to_inference_data(nuts), az.from_pyro(nuts)
    for group, name in [
        ("posterior", "w"),
        ("posterior", "sigma"),
        ("log_likelihood", "obs"),
        ("observed_data", "obs"),
    ]:
        np.testing.assert_allclose(ours[group][name].values, theirs[group][name].values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours["sample_stats"]["diverging"].values, theirs["sample_stats"]["diverging"].values)


# ---------------------------------------------------------------------------------------------------- SVI guides


def test_svi_guide_with_full_data_log_likelihood(guide, data):
    before = torch.get_rng_state()
    idata = to_inference_data(guide, args=data, num_samples=400, seed=1)
    assert torch.equal(torch.get_rng_state(), before), "a seeded conversion must leave the global RNG alone"
    assert _posterior(idata, "w").shape == (1, 400, D) and _posterior(idata, "sigma").shape == (1, 400)
    assert idata["log_likelihood"]["obs"].shape == (1, 400, N)  # all N points, although SVI saw minibatches
    w, sigma = torch.from_numpy(_posterior(idata, "w")[0]), torch.from_numpy(_posterior(idata, "sigma")[0])
    np.testing.assert_allclose(idata["log_likelihood"]["obs"].values[0], hand_log_likelihood(w, sigma, *data), 1e-4)
    assert np.isfinite(loo_estimate(idata))
    # the draws follow the guide's law: AutoNormal's w is Normal(loc, scale), within 4 Monte-Carlo errors
    loc, scale = guide.locs.w.detach(), guide.scales.w.detach()
    np.testing.assert_array_less((w.mean(0) - loc).abs().numpy(), (4 * scale / math.sqrt(400)).numpy())
    # and a seed reproduces them
    again = to_inference_data(guide, args=data, num_samples=400, seed=1, log_likelihood=False)
    np.testing.assert_array_equal(_posterior(again, "w"), _posterior(idata, "w"))


def test_predictive_draws_from_a_guide(guide, data):
    x, y = data
    draws = Predictive(model, guide=guide, num_samples=300)(x)  # y=None: obs are predictions
    assert draws["w"].shape == (300, 1, D)  # Predictive's broadcast shape, undone by the converter
    idata = to_inference_data(draws, model, args=data)
    assert _posterior(idata, "w").shape == (1, 300, D)
    assert group_names(idata) == {"posterior", "posterior_predictive", "log_likelihood", "observed_data"}
    predictive = idata["posterior_predictive"]["obs"]
    assert predictive.dims == ("chain", "draw", "data") and predictive.shape == (1, 300, N)
    # with y given, Predictive returns y itself at every draw: not predictions, so left out with a warning
    with pytest.warns(UserWarning, match="equals the observed data"):
        idata = to_inference_data(Predictive(model, guide=guide, num_samples=10)(x, y), model, args=data)
    assert "posterior_predictive" not in group_names(idata)


# ---------------------------------------------------------------------------------------------------- our engines


@pytest.fixture(scope="module")
def sghmc(data):
    kernel = SGHMC(model, step_size=0.002, friction=20.0)
    mcmc = StochasticMCMC(kernel, num_samples=100, num_warmup=100, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(*data, batch_size=B)
    return mcmc


def test_posterior_predictive_and_prior_follow_their_laws(sghmc, data):
    x, _ = data
    idata = to_inference_data(sghmc, posterior_predictive=True, prior=500, seed=0)
    assert {"posterior_predictive", "prior", "prior_predictive"} <= group_names(idata)
    predictive = idata["posterior_predictive"]["obs"]
    assert predictive.dims == ("chain", "draw", "data") and predictive.shape == (2, 100, N)
    # each predictive draw is y ~ Normal(x @ w, sigma) at its own posterior draw: standardised residuals are N(0, 1)
    w, sigma = _posterior(idata, "w"), _posterior(idata, "sigma")
    z = (predictive.values - w @ x.numpy().T) / sigma[..., None]
    n = z.size
    assert abs(z.mean()) < 4 / math.sqrt(n), z.mean()
    assert abs(z.var() - 1) < 4 * math.sqrt(2 / n), z.var()
    # the prior: w ~ Normal(0, PRIOR_SD), sigma ~ HalfNormal(1) (mean sqrt(2/pi)), then y from the likelihood
    prior_w, prior_sigma = idata["prior"]["w"].values, idata["prior"]["sigma"].values
    assert prior_w.shape == (1, 500, D) and idata["prior_predictive"]["obs"].shape == (1, 500, N)
    assert np.all(np.abs(prior_w.mean((0, 1))) < 4 * PRIOR_SD / math.sqrt(500))
    half_normal_sd = math.sqrt(1 - 2 / math.pi)
    assert abs(prior_sigma.mean() - math.sqrt(2 / math.pi)) < 4 * half_normal_sd / math.sqrt(500)


def test_our_run_equals_its_own_method(sghmc):
    ours = to_inference_data(sghmc)
    np.testing.assert_array_equal(ours["posterior"]["w"].values, sghmc.to_inference_data()["posterior"]["w"].values)
    np.testing.assert_array_equal(ours["sample_stats"]["lp"].values, sghmc.sample_stats["lp"].numpy())


def test_laplace_posterior(data):
    guide = AutoLinearizedLaplace(lambda x, y: model(x, y))
    posterior = guide.laplace_approximation(*data, map_latents={"w": torch.tensor([1.0, -0.5]), "sigma": 0.5})
    idata = to_inference_data(posterior, num_samples=200, seed=3)
    np.testing.assert_allclose(_posterior(idata, "w")[0], posterior.get_samples(200, seed=3)["w"].numpy(), rtol=1e-5)
    assert idata["log_likelihood"]["obs"].shape == (1, 200, N)
    same = posterior.to_inference_data(num_samples=200, seed=3)
    np.testing.assert_array_equal(same["posterior"]["w"].values, _posterior(idata, "w"))


# ---------------------------------------------------------------------------------------------------- dims, data


def hierarchical(g, y, num_groups=4):
    """A latent per group inside a plain plate: its dimension is named after the plate."""
    mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(mu, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(a[g], 1.0), obs=y)


def test_latent_dims_are_named_after_their_plates():
    g = torch.arange(12) % 4
    y = torch.randn(12)
    draws = {"mu": torch.randn(50), "a": torch.randn(50, 4)}
    idata = to_inference_data(draws, hierarchical, args=(g, y))
    assert idata["posterior"]["a"].dims == ("chain", "draw", "groups")
    assert idata["posterior"]["mu"].dims == ("chain", "draw")
    assert idata["log_likelihood"]["obs"].dims == ("chain", "draw", "data")


def test_a_dataloader_run_is_given_its_full_data_here(data):
    x, y = data
    loader = [(x[i : i + B], y[i : i + B]) for i in range(0, N, B)]

    def loader_model(x, y):
        w = pyro.sample("w", dist.Normal(x.new_zeros(D), PRIOR_SD).to_event(1))
        with pyro.plate("data", N, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    mcmc = StochasticMCMC(
        SGHMC(loader_model, step_size=0.002, friction=20.0), num_samples=20, num_warmup=20, seed=0, progress_bar=False
    )
    mcmc.run(batches=loader)
    with pytest.warns(UserWarning, match="no full data"):
        assert "log_likelihood" not in group_names(to_inference_data(mcmc))
    idata = to_inference_data(mcmc, args=(x, y))
    assert idata["log_likelihood"]["obs"].shape == (1, 20, N)


def test_parallel_chains_of_one_draw_convert_without_warnings(data):
    # many chains of one draw each (a deep ensemble at T = 0): ArviZ's "more chains than draws" guess is silenced
    draws = {"w": torch.randn(1, 8, D), "sigma": torch.rand(1, 8) + 0.1}
    flat = {k: v.reshape((-1,) + v.shape[2:]) for k, v in draws.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idata = to_inference_data(flat, model, args=data)
    assert _posterior(idata, "w").shape == (1, 8, D)
    assert ARVIZ_MAJOR in (0, 1)


def _masked(y, mask):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        with pyro.poutine.mask(mask=mask[idx]):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])


def _masked_by_the_distribution(y, mask):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0).mask(mask), obs=y)


def _masked_grid(y, mask):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("rows", y.shape[0], dim=-2), pyro.plate("columns", y.shape[1], dim=-1):
        with pyro.poutine.mask(mask=mask):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def _loo_points(idata) -> int:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto", category=UserWarning)
        loo = az.loo(idata, pointwise=True)
    return int(np.asarray(loo.pareto_k).size)  # one Pareto k per point loo uses, in ArviZ 0.x and 1.x


@pytest.mark.parametrize("masked_model", [_masked, _masked_by_the_distribution])
def test_loo_counts_only_the_points_the_model_observes(masked_model):
    # half the points masked out: the likelihood has 20 terms, and az.loo must see those 20 and no masked one
    y = torch.randn(40, generator=torch.Generator().manual_seed(0))
    mask = torch.arange(40) % 2 == 0
    draws = {"mu": 0.2 * torch.randn(100, generator=torch.Generator().manual_seed(1))}
    idata = to_inference_data(draws, masked_model, args=(y, mask))
    log_likelihood = idata["log_likelihood"]["obs"]
    assert _loo_points(idata) == int(mask.sum()) == 20
    assert log_likelihood.dims == ("chain", "draw", "data")
    assert np.array_equal(log_likelihood["data"].values, np.flatnonzero(mask.numpy()))  # positions in the data
    # each kept point's values are its own Normal log density, and the observed data keeps every value given
    mu = draws["mu"].double()[:, None]
    expected = dist.Normal(mu, 1.0).log_prob(y.double()[mask])
    np.testing.assert_allclose(log_likelihood.values[0], expected.numpy(), rtol=1e-5)
    assert idata["observed_data"]["obs"].shape == (40,)


def test_a_mask_scattered_over_two_plates_leaves_one_dim_of_observed_points():
    y = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.eye(4, 5, dtype=torch.bool) | (torch.arange(5) == 4)  # no whole row or column masked
    idata = to_inference_data({"mu": torch.randn(50)}, _masked_grid, args=(y, mask))
    assert idata["log_likelihood"]["obs"].dims == ("chain", "draw", "obs_observed")
    assert _loo_points(idata) == int(mask.sum())
