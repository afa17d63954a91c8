"""The Laplace posterior as a Pyro guide: SVI-trained MAP, Predictive, ArviZ, subsets, families, bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch.func import jacrev

from pyro_scalable import FullDataModel, ModelError
from pyro_scalable.infer import AutoLinearizedLaplace, CurvatureError, SampleThenOptimize
from tests.infer.linearized.nets import MLP, brute_force_jacobian, random_latents

D = torch.float64


def _classification(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=D)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([2.0, -1.0], dtype=D)), generator=g)
    return x, y


def logistic(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=min(50, x.shape[0])) as idx:
        return pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])


def _trained(model, *args, steps=600):
    guide = AutoLinearizedLaplace(model)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.995}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide


@pytest.mark.arviz
def test_svi_trained_map_then_predictive_and_arviz():
    x, y = _classification()
    pyro.set_rng_seed(0)
    guide = _trained(logistic, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        posterior = guide.laplace_approximation(x, y, structure="full")  # converged: no MAP warning
    assert posterior.sites == ["w"]
    # the sampled-weights predictive, on every test point thanks to FullDataModel
    samples = Predictive(FullDataModel(logistic), guide=posterior, num_samples=30)(x[:70])
    assert samples["y"].shape == (30, 70) and samples["w"].squeeze(1).shape == (30, 2)
    # the linearised predictive through Pyro: f is linear in w, so it is the model itself here
    linear = Predictive(posterior.linearized_model, guide=posterior, num_samples=30)(x[:70])
    assert linear["y"].shape == (30, 70)
    idata = posterior.to_inference_data(num_samples=40, seed=1)
    assert idata.posterior["w"].shape == (1, 40, 2)
    assert idata.log_likelihood["y"].shape == (1, 40, 200)
    assert "data" in idata.log_likelihood["y"].dims


def test_guide_median_is_its_map_and_linearizes_sample_then_optimize():
    # the README's line SampleThenOptimize(model, linearize_at=guide) raised a bare NotImplementedError: the guide's
    # median() (which it reads) was Pyro's AutoContinuous one, with no location to read
    x, y = _classification()
    pyro.set_rng_seed(0)
    guide = _trained(logistic, x, y)
    median = guide.median(x, y)
    torch.testing.assert_close(median["w"], guide(x, y)["w"])  # the guide is a point mass at its MAP
    engine = SampleThenOptimize(logistic, num_samples=4, num_epochs=1, linearize_at=guide, seed=0, progress_bar=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the samples have not converged")  # one epoch, on purpose
        engine.run(x, y)
    torch.testing.assert_close(engine.net.theta_star, median["w"])


def test_linearized_model_draws_match_the_closed_form_predictive():
    """Monte Carlo through ``Predictive`` against ``predict``: tolerances from the Monte-Carlo error."""
    x, y = torch.randn(60, 3, dtype=D), torch.randn(60, 2, dtype=D)
    model = MLP((3, 4, 2), "normal", batch_size=20)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="kron", map_latents=random_latents(model, x), check_map=False
    )
    x_test = torch.randn(5, 3, dtype=D)
    exact = posterior.predict(x_test).distribution
    num_samples = 1500
    pyro.set_rng_seed(3)
    draws = Predictive(posterior.linearized_model, guide=posterior, num_samples=num_samples)(x_test)["y"]
    mean, variance = exact.mean, exact.variance
    z = (draws.mean(0) - mean) / (variance / num_samples).sqrt()
    assert z.abs().max() < 4.5
    # the variance of a sample variance of Gaussians is 2 σ⁴ / (n - 1)
    z_var = (draws.var(0) - variance) / (2 * variance**2 / (num_samples - 1)).sqrt()
    assert z_var.abs().max() < 4.5


def test_unconverged_map_warns_with_the_gradient_norm():
    x, y = _classification()
    guide = AutoLinearizedLaplace(logistic)
    with pytest.warns(
        UserWarning, match=r"gradient of the log joint there has norm [0-9.e+]+ .* at least [0-9.e+]+ nats"
    ):
        posterior = guide.laplace_approximation(
            x, y, structure="full", map_latents={"w": torch.tensor([-3.0, 3.0], dtype=D)}
        )
    # a Bernoulli log-likelihood is not quadratic: the mean stays at the given latents (no Newton extrapolation)
    assert torch.equal(posterior.mean, posterior.theta_star)


def test_last_layer_subset_holds_the_rest_at_the_map():
    x, y = torch.randn(50, 3, dtype=D), torch.randn(50, 2, dtype=D)
    model = MLP((3, 5, 2), "normal", batch_size=25)
    latents = random_latents(model, x)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="full", sites="last_layer", map_latents=latents, check_map=False
    )
    assert posterior.sites == ["layers.1.weight", "layers.1.bias"]
    _, jacobian = brute_force_jacobian(model, latents, x)
    last = jacobian[..., 5 * 3 + 5 :]
    ggn = torch.einsum("nmd,nme->de", last, last) / 0.3**2
    assert torch.allclose(posterior.fit.curvature.to_dense(), ggn)
    draws = posterior.get_samples(3, seed=0)
    assert torch.equal(draws["layers.0.weight"], latents["layers.0.weight"].expand(3, 5, 3))


def test_heteroscedastic_normal_uses_the_fisher_of_loc_and_log_scale():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 2, generator=g, dtype=D), torch.randn(30, generator=g, dtype=D)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 2, dtype=D), 1.0).to_event(2))
        out = x @ w
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Normal(out[:, 0], out[:, 1].exp()), obs=y)

    w = torch.randn(2, 2, generator=g, dtype=D) * 0.3
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="full", map_latents={"w": w}, check_map=False
    )

    def outputs(flat):
        return x @ flat.reshape(2, 2)  # (loc, log scale)

    jacobian = jacrev(outputs)(w.flatten())  # (n, 2, 4)
    lam = torch.stack([(-2 * outputs(w.flatten())[:, 1]).exp(), torch.full((30,), 2.0, dtype=D)], -1)
    ggn = torch.einsum("nmd,nm,nme->de", jacobian, lam, jacobian)
    assert torch.allclose(posterior.fit.curvature.to_dense(), ggn)
    predictive = posterior.predict(x[:4]).distribution
    assert predictive.mean.shape == (4,)


def test_masked_points_leave_the_curvature():
    x, y = _classification(n=40)
    mask = torch.arange(40) < 25

    def masked(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]), pyro.poutine.mask(mask=mask):
            return pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    w = torch.tensor([0.5, -0.2], dtype=D)
    full = AutoLinearizedLaplace(masked).laplace_approximation(
        x, y, structure="full", map_latents={"w": w}, check_map=False
    )
    kept = AutoLinearizedLaplace(logistic).laplace_approximation(
        x[:25], y[:25], structure="full", map_latents={"w": w}, check_map=False
    )
    assert torch.allclose(full.fit.curvature.to_dense(), kept.fit.curvature.to_dense())
    assert math.isclose(float(full.log_marginal_likelihood()), float(kept.log_marginal_likelihood()))


def test_non_gaussian_and_constrained_priors_use_their_curvature_at_the_map():
    x, y = _classification(n=60)

    def model(x, y=None):
        w = pyro.sample("w", dist.Laplace(torch.zeros(2, dtype=D), 0.5).to_event(1))
        scale = pyro.sample("scale", dist.LogNormal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=scale * (x @ w)), obs=y)

    del model  # a Laplace prior has zero curvature away from 0: that must be a clear error, not a NaN

    def smooth(x, y=None):
        w = pyro.sample("w", dist.StudentT(4.0, torch.zeros(2, dtype=D), 0.5).to_event(1))
        scale = pyro.sample("scale", dist.LogNormal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=scale * (x @ w)), obs=y)

    latents = {"w": torch.tensor([0.4, -0.3], dtype=D), "scale": torch.tensor(1.5, dtype=D)}
    posterior = AutoLinearizedLaplace(smooth).laplace_approximation(
        x, y, structure="full", map_latents=latents, check_map=False
    )

    def log_prior(u):
        w, log_scale = u[:2], u[2]
        return (
            dist.StudentT(4.0, 0.0, 0.5).log_prob(w).sum()
            + dist.LogNormal(0.0, 1.0).log_prob(log_scale.exp())
            + log_scale  # log |d scale / d log scale|
        )

    u = torch.cat([latents["w"], latents["scale"].log().reshape(1)])
    hessian = torch.func.hessian(log_prior)(u)
    assert torch.allclose(posterior.prior_precision, -hessian.diagonal())
    gradient = torch.func.grad(log_prior)(u)
    assert torch.allclose(posterior.prior_mean, u + gradient / -hessian.diagonal())


# ------------------------------------------------------------------ bad input
def test_unknown_likelihood_names_the_site():
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("target", dist.StudentT(3.0, x @ w, 1.0), obs=y)

    x, y = _classification(n=20)
    with pytest.raises(ModelError, match="'target' has a StudentT likelihood"):
        AutoLinearizedLaplace(model).laplace_approximation(x, y, map_latents={"w": torch.zeros(2, dtype=D)})


def test_discrete_latent_is_rejected():
    def model(x, y=None):
        k = pyro.sample("k", dist.Bernoulli(torch.tensor(0.5, dtype=D)))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=k * x[:, 0]), obs=y)

    x, y = _classification(n=20)
    with pytest.raises((ModelError, ValueError), match="'k'"):
        AutoLinearizedLaplace(model).laplace_approximation(x, y, map_latents={"k": torch.tensor(1.0, dtype=D)})


def test_singular_curvature_is_a_clear_error_and_jitter_fixes_it():
    x, y = _classification(n=20)
    x = torch.cat([x, x[:, :1]], 1)  # a duplicated column: the GGN is singular

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    guide = AutoLinearizedLaplace(model)
    latents = {"w": torch.zeros(3, dtype=D)}
    with pytest.raises(CurvatureError, match=r"singular.*jitter=.*'w'"):
        guide.laplace_approximation(x, y, structure="full", prior_precision=0.0, map_latents=latents, check_map=False)
    posterior = guide.laplace_approximation(
        x, y, structure="full", prior_precision=0.0, jitter=1e-4, map_latents=latents, check_map=False
    )
    assert torch.isfinite(posterior.sample(3)).all()
    assert torch.isfinite(posterior.predict(x[:3]).covariance).all()


def test_untrained_guide_and_bad_options_are_clear_errors():
    x, y = _classification(n=20)
    guide = AutoLinearizedLaplace(logistic)
    with pytest.raises(ModelError, match="has not been trained"):
        guide.laplace_approximation(x, y)
    with pytest.raises(ValueError, match="structure must be one of"):
        guide.laplace_approximation(x, y, structure="kfac")
    with pytest.raises(ModelError, match="not latent sites"):
        guide.laplace_approximation(x, y, sites=["v"], map_latents={"w": torch.zeros(2, dtype=D)})


def test_hierarchical_prior_inside_the_laplace_sites_is_rejected():
    def model(x, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), tau).to_event(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    x, y = _classification(n=20)
    latents = {"tau": torch.tensor(1.0, dtype=D), "w": torch.zeros(2, dtype=D)}
    guide = AutoLinearizedLaplace(model)
    # tau does not change the output: it is held at its MAP, and w's prior is then fixed
    posterior = guide.laplace_approximation(x, y, map_latents=latents, check_map=False)
    assert posterior.sites == ["w"]
    with pytest.raises(ModelError, match="hierarchical prior"):
        guide.laplace_approximation(x, y, sites=["tau", "w"], map_latents=latents, check_map=False)


def test_follows_the_device_of_the_data(device):
    x, y = _classification(n=60)
    x, y = x.to(device), y.to(device)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D, device=x.device), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=20) as idx:
            return pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])

    latents = {"w": torch.tensor([0.5, -0.5], dtype=D, device=device)}
    for structure in ["full", "diag", "kron", "low_rank"]:
        posterior = AutoLinearizedLaplace(model).laplace_approximation(
            x, y, structure=structure, map_latents=latents, check_map=False, rank=2
        )
        posterior.optimize_prior_precision("site")
        predictive = posterior.predict(x[:5], link_approx="mc", num_samples=20, seed=0)
        assert predictive.covariance.device.type == device.type
        assert posterior.sample(3).device.type == device.type


@pytest.mark.parametrize("likelihood", ["normal", "categorical"])
def test_chunked_passes_equal_one_pass(likelihood):
    x = torch.randn(50, 3, dtype=D)
    y = torch.randn(50, 2, dtype=D) if likelihood == "normal" else torch.randint(0, 3, (50,))
    model = MLP((3, 5, 2 if likelihood == "normal" else 3), likelihood, batch_size=10)
    latents = random_latents(model, x)
    guide = AutoLinearizedLaplace(model)
    chunked, whole = (
        guide.laplace_approximation(x, y, structure="kron", map_latents=latents, check_map=False, chunk_size=size)
        for size in (7, 100)
    )
    assert torch.allclose(chunked.precision.to_dense(), whole.precision.to_dense())
    assert torch.allclose(chunked.log_marginal_likelihood(), whole.log_marginal_likelihood())
    a, b = chunked.predict(x).distribution, whole.predict(x).distribution
    assert a.batch_shape == b.batch_shape == (50,)
    if likelihood == "normal":
        assert torch.allclose(a.variance, b.variance)
    else:
        assert torch.allclose(a.probs, b.probs)


def test_classification_predictive_probit_and_monte_carlo():
    """Probit is sigmoid(m / sqrt(1 + πv/8)); Monte Carlo matches the exact Gaussian integral within its error."""
    x, y = _classification(n=120)
    posterior = AutoLinearizedLaplace(logistic).laplace_approximation(
        x, y, structure="full", map_latents={"w": torch.tensor([1.5, -0.8], dtype=D)}, check_map=False
    )
    x_test = torch.tensor([[0.5, 0.3], [3.0, -2.0], [-1.0, 4.0]], dtype=D)
    probit = posterior.predict(x_test)
    mean, variance = probit.mean[:, 0], probit.covariance[:, 0, 0]
    assert torch.allclose(probit.distribution.probs, torch.sigmoid(mean / (1 + math.pi * variance / 8).sqrt()))
    num_samples = 20000
    mc = posterior.predict(x_test, link_approx="mc", num_samples=num_samples, seed=0).distribution.probs
    nodes, weights = (torch.tensor(v, dtype=D) for v in np.polynomial.hermite_e.hermegauss(80))
    values = torch.sigmoid(mean[:, None] + variance.sqrt()[:, None] * nodes)
    exact = (values * weights).sum(-1) / weights.sum()
    spread = ((values**2 * weights).sum(-1) / weights.sum() - exact**2).sqrt()
    assert ((mc - exact).abs() / (spread / num_samples**0.5)).max() < 4.5


def test_chunk_size_without_a_subsampled_plate_warns():
    x, y = _classification(n=30)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    with pytest.warns(UserWarning, match="chunk_size=10 is ignored"):
        AutoLinearizedLaplace(model).laplace_approximation(
            x, y, chunk_size=10, map_latents={"w": torch.zeros(2, dtype=D)}, check_map=False
        )
