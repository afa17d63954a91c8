"""The EKF: the Kalman filter's exact posterior on linear-Gaussian models, its iterations, its surface and its errors.

Gold: on a linear-Gaussian model the dense filter is the Kalman filter, so one pass in minibatches, in any order,
gives the conjugate posterior (mean and covariance) to rounding, whatever the features' correlations; two episodes
through ``as_prior`` are one filter over both data sets. The diagonal filter is the Kalman filter where the posterior
precision is diagonal (orthogonal features: each data point measures one coefficient).
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive

from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer import EKF, DiagonalEKF, EKFPosterior
from pyro_scalable.inference_data import ARVIZ_MAJOR

D = torch.float64
P, SIGMA, PRIOR = 3, 0.5, torch.tensor([1.5, 0.7, 2.0], dtype=D)


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), PRIOR.to(x.dtype)).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=min(25, x.shape[0])) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, SIGMA), obs=None if y is None else y[idx])


def data(n=200, seed=0, dtype=D, correlated=False):
    g = torch.Generator().manual_seed(seed)
    if correlated:  # features correlated 0.9: so is the posterior
        x = torch.randn(n, P, generator=g, dtype=D) @ torch.linalg.cholesky(0.1 * torch.eye(P, dtype=D) + 0.9).T
    else:
        which = torch.randint(P, (n,), generator=g)
        x = torch.nn.functional.one_hot(which, P).to(D) * (0.5 + torch.rand(n, 1, generator=g, dtype=D))
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + SIGMA * torch.randn(n, generator=g, dtype=D)
    return x.to(dtype), y.to(dtype)


def conjugate(*episodes):
    precision = torch.diag(PRIOR.pow(-2))
    rhs = torch.zeros(P, dtype=D)
    for x, y in episodes:
        precision += x.to(D).T @ x.to(D) / SIGMA**2
        rhs += x.to(D).T @ y.to(D) / SIGMA**2
    covariance = torch.linalg.inv(precision)
    return covariance @ rhs, covariance


@pytest.mark.parametrize("engine", [EKF, DiagonalEKF])
@pytest.mark.parametrize("shuffle", [True, False])
def test_one_pass_is_the_exact_posterior_when_its_precision_is_diagonal(engine, shuffle):
    x, y = data()
    posterior = engine(model, shuffle=shuffle, seed=1, progress_bar=False).run(x, y)
    mean, covariance = conjugate((x, y))
    assert isinstance(posterior, EKFPosterior) and posterior.stats["steps"] == 8
    assert posterior.covariance == ("dense" if engine is EKF else "diagonal")
    assert torch.allclose(posterior.mean[0], mean, rtol=1e-10, atol=1e-12)
    assert torch.allclose(posterior.variance[0], covariance.diagonal(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("batch", [1, 2, 25, 100])
def test_the_dense_filter_is_the_kalman_filter_on_correlated_features(batch):
    """Whatever the minibatch, one pass is the conjugate posterior; the second evaluation of each finds no step."""
    x, y = data(correlated=True)

    def batched(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), PRIOR).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=batch) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, SIGMA), obs=None if y is None else y[idx])

    posterior = EKF(batched, seed=0, progress_bar=False).run(x, y)
    mean, covariance = conjugate((x, y))
    assert torch.allclose(posterior.mean[0], mean, rtol=1e-10, atol=1e-12)
    assert torch.allclose(posterior.covariance_matrix(), covariance, rtol=1e-9, atol=1e-14)
    assert posterior.stats["evaluations"] <= 2 * posterior.stats["steps"]  # linear: one extra evaluation at most


def test_two_dense_episodes_through_as_prior_are_one_filter_over_both():
    first, second = data(seed=0, correlated=True), data(seed=1, correlated=True)
    one = EKF(model, seed=0, progress_bar=False).run(*first)
    two = EKF(one.as_prior(), seed=0, progress_bar=False).run(*second)
    both = EKF(model, seed=0, progress_bar=False).run(*(torch.cat(pair) for pair in zip(first, second)))
    mean, covariance = conjugate(first, second)
    for posterior in (two, both):
        assert torch.allclose(posterior.mean[0], mean, rtol=1e-10, atol=1e-12)
        assert torch.allclose(posterior.covariance_matrix(), covariance, rtol=1e-10, atol=1e-14)


def test_two_diagonal_episodes_through_as_prior_are_the_posterior_on_both():
    first, second = data(seed=0), data(seed=1)
    one = DiagonalEKF(model, seed=0, progress_bar=False).run(*first)
    two = DiagonalEKF(one.as_prior(), seed=0, progress_bar=False).run(*second)
    mean, covariance = conjugate(first, second)
    assert torch.allclose(two.mean[0], mean, rtol=1e-10, atol=1e-12)
    assert torch.allclose(two.variance[0], covariance.diagonal(), rtol=1e-10, atol=1e-14)


def test_the_empirical_fisher_is_not_the_kalman_filter():
    """curvature='ef' (posteriors' choice) uses squared scores: its variances are not the exact ones."""
    x, y = data()
    _, covariance = conjugate((x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the check after the pass: it is off
        posterior = DiagonalEKF(model, curvature="ef", iterations=1, seed=1, progress_bar=False).run(x, y)
    assert posterior.stats["curvature"] == "ef"
    assert not torch.allclose(posterior.variance[0], covariance.diagonal(), rtol=1e-2)


@pytest.mark.parametrize("covariance", ["dense", "diagonal"])
def test_transition_noise_widens_the_posterior(covariance):
    x, y = data()
    still = EKF(model, covariance=covariance, seed=1, progress_bar=False).run(x, y)
    drifting = EKF(model, covariance=covariance, transition_sd=0.1, seed=1, progress_bar=False).run(x, y)
    assert (drifting.variance[0] > still.variance[0]).all()
    assert "mean_error" in still.stats and "mean_error" not in drifting.stats  # no check of a forgetting filter


def test_the_dense_posterior_surface_reads_its_covariance():
    """Draws, covariance_factors (0 and the Cholesky factor), the linearised predictive and the prior are exact."""
    x, y = data(correlated=True)
    posterior = EKF(model, seed=0, progress_bar=False).run(x, y)
    mean, covariance = conjugate((x, y))
    diagonal, factor = posterior.covariance_factors()
    assert torch.equal(diagonal, torch.zeros(P, dtype=D)) and torch.allclose(factor @ factor.T, covariance)
    draws = posterior.get_samples(20_000, seed=0)["w"]
    assert torch.allclose(draws.T.cov(), covariance, rtol=0.05, atol=0.05 * float(covariance.diagonal().min()))
    x_new = torch.randn(5, P, dtype=D)
    prediction = posterior.predict(x_new)
    assert torch.allclose(prediction.mean[:, 0], x_new @ mean, rtol=1e-10)
    assert torch.allclose(prediction.covariance[:, 0, 0], (x_new @ covariance * x_new).sum(-1), rtol=1e-10)
    assert posterior.as_prior().joint.kind == "dense"
    assert torch.allclose(posterior.as_prior().joint.covariance_matrix(), covariance, rtol=1e-10)
    idata = posterior.to_inference_data(num_samples=10, seed=0)
    assert (idata["posterior"] if ARVIZ_MAJOR >= 1 else idata.posterior)["w"].shape == (1, 10, P)


def test_a_float32_classifier_gets_the_result_surface():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()

    def classifier(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 2), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=min(50, x.shape[0])) as idx:
            pyro.sample("y", dist.Categorical(logits=x[idx] @ w + b), obs=None if y is None else y[idx])

    for engine in (EKF, DiagonalEKF):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # separable data: the check's figures are not the point
            posterior = engine(classifier, seed=0, progress_bar=False).run(x, y)
        samples = posterior.get_samples(20, seed=0)
        assert samples["w"].shape == (20, 2, 2) and samples["w"].dtype == torch.float32
        prediction = posterior.predict(x[:7])
        assert prediction.distribution.probs.shape == (7, 2)
        assert (prediction.distribution.probs.argmax(-1) == y[:7]).float().mean() > 0.8
        assert Predictive(FullDataModel(classifier), guide=posterior, num_samples=3)(x[:5])["y"].shape[-1] == 5
        idata = posterior.to_inference_data(num_samples=10, seed=0)
        log_likelihood = idata["log_likelihood"] if ARVIZ_MAJOR >= 1 else idata.log_likelihood
        assert log_likelihood["y"].shape == (1, 10, 300)


def test_errors_name_the_site_or_the_argument():
    x, y = data()

    def with_noise(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=x.dtype)))
        with pyro.plate("data", x.shape[0], subsample_size=25) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, sigma), obs=None if y is None else y[idx])

    with pytest.raises(ModelError, match=r"\['sigma'\].*constants in the model"):
        EKF(with_noise, progress_bar=False).run(x, y)
    with pytest.raises(ValueError, match="transition_sd"):
        EKF(model, transition_sd=-1.0)
    with pytest.raises(ValueError, match="curvature"):
        EKF(model, curvature="hessian")
    with pytest.raises(ValueError, match="covariance"):
        EKF(model, covariance="low_rank")
    with pytest.raises(ValueError, match="iterations"):
        EKF(model, iterations=0)
    with pytest.raises(ValueError, match="tolerance"):
        EKF(model, tolerance=-0.1)
    with pytest.raises(TypeError, match="covariance='diagonal'"):
        DiagonalEKF(model, covariance="dense")
