"""The diagonal EKF: the Kalman filter's exact posterior where the posterior precision is diagonal, and its surface.

Gold: a linear-Gaussian model whose features are orthogonal (each data point measures one coefficient), so the
posterior precision is diagonal and the GGN of every minibatch is exact: one pass in minibatches, in any order,
gives the conjugate posterior to rounding; two episodes through ``as_prior`` give the posterior on both.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive

from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer import DiagonalEKF, EKFPosterior
from pyro_scalable.inference_data import ARVIZ_MAJOR

D = torch.float64
P, SIGMA, PRIOR = 3, 0.5, torch.tensor([1.5, 0.7, 2.0], dtype=D)


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=x.dtype), PRIOR.to(x.dtype)).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=min(25, x.shape[0])) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, SIGMA), obs=None if y is None else y[idx])


def data(n=200, seed=0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(P, (n,), generator=g)
    x = torch.nn.functional.one_hot(which, P).to(D) * (0.5 + torch.rand(n, 1, generator=g, dtype=D))
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + SIGMA * torch.randn(n, generator=g, dtype=D)
    return x.to(dtype), y.to(dtype)


def conjugate(*episodes):
    precision = PRIOR.pow(-2).clone()
    rhs = torch.zeros(P, dtype=D)
    for x, y in episodes:
        precision += (x.to(D) ** 2).sum(0) / SIGMA**2  # orthogonal features: X^T X is diagonal
        rhs += x.to(D).T @ y.to(D) / SIGMA**2
    return rhs / precision, precision.reciprocal()


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_pass_is_the_exact_posterior_when_its_precision_is_diagonal(shuffle):
    x, y = data()
    posterior = DiagonalEKF(model, curvature="ggn", shuffle=shuffle, seed=1, progress_bar=False).run(x, y)
    mean, variance = conjugate((x, y))
    assert isinstance(posterior, EKFPosterior) and posterior.stats["steps"] == 8
    assert torch.allclose(posterior.mean[0], mean, rtol=1e-10, atol=1e-12)
    assert torch.allclose(posterior.variance[0], variance, rtol=1e-10, atol=1e-14)


def test_two_episodes_through_as_prior_are_the_posterior_on_both():
    first, second = data(seed=0), data(seed=1)
    one = DiagonalEKF(model, curvature="ggn", seed=0, progress_bar=False).run(*first)
    two = DiagonalEKF(one.as_prior(), curvature="ggn", seed=0, progress_bar=False).run(*second)
    mean, variance = conjugate(first, second)
    assert torch.allclose(two.mean[0], mean, rtol=1e-10, atol=1e-12)
    assert torch.allclose(two.variance[0], variance, rtol=1e-10, atol=1e-14)


def test_the_empirical_fisher_is_not_the_kalman_filter():
    """curvature='ef' (the default, posteriors' choice) uses squared scores: its variances are not the exact ones."""
    x, y = data()
    _, variance = conjugate((x, y))
    posterior = DiagonalEKF(model, seed=1, progress_bar=False).run(x, y)  # the default
    assert posterior.stats["curvature"] == "ef"
    assert not torch.allclose(posterior.variance[0], variance, rtol=1e-2)


def test_transition_noise_widens_the_posterior():
    x, y = data()
    still = DiagonalEKF(model, seed=1, progress_bar=False).run(x, y)
    drifting = DiagonalEKF(model, transition_sd=0.1, seed=1, progress_bar=False).run(x, y)
    assert (drifting.variance[0] > still.variance[0]).all()


def test_a_float32_classifier_gets_the_result_surface():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()

    def classifier(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 2), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=min(50, x.shape[0])) as idx:
            pyro.sample("y", dist.Categorical(logits=x[idx] @ w + b), obs=None if y is None else y[idx])

    posterior = DiagonalEKF(classifier, seed=0, progress_bar=False).run(x, y)
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
        DiagonalEKF(with_noise, progress_bar=False).run(x, y)
    with pytest.raises(ValueError, match="transition_sd"):
        DiagonalEKF(model, transition_sd=-1.0)
    with pytest.raises(ValueError, match="curvature"):
        DiagonalEKF(model, curvature="hessian")
