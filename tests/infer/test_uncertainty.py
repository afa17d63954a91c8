"""Gold tier: the uncertainty split against closed forms, and the parts summing to the total exactly."""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import SGLD, StochasticMCMC
from pyro_scalable.infer.linearized.glm import GLMPredictive
from pyro_scalable.infer.uncertainty import (
    decompose_moments,
    decompose_probabilities,
    draws_uncertainty,
    linearized_uncertainty,
)
from tests.infer.laplace.test_linear_gaussian import Problem

D = torch.float64


def _entropy(p):
    return -sum(q * math.log(q) for q in p if q > 0)


def test_two_draw_mixture_of_categoricals_matches_closed_form():
    first, second = [0.7, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.5]
    mean = [(a + b) / 2 for a, b in zip(first, second)]
    aleatoric = (_entropy(first) + _entropy(second)) / 2
    u = decompose_probabilities(torch.tensor([[first], [second]], dtype=D))
    assert u.measure == "entropy" and u.total.shape == (1,)
    assert u.aleatoric.item() == pytest.approx(aleatoric, abs=1e-14)
    assert u.total.item() == pytest.approx(_entropy(mean), abs=1e-14)
    assert u.epistemic.item() == pytest.approx(_entropy(mean) - aleatoric, abs=1e-14)
    assert torch.equal(u.total, u.aleatoric + u.epistemic)


def test_agreeing_draws_have_no_epistemic_part_and_certain_draws_no_aleatoric():
    same = torch.tensor([[0.2, 0.8]] * 5, dtype=D).unsqueeze(1)
    assert decompose_probabilities(same).epistemic.item() == pytest.approx(0.0, abs=1e-15)
    certain = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=D).unsqueeze(1)
    u = decompose_probabilities(certain)
    assert u.aleatoric.item() == 0.0 and u.epistemic.item() == pytest.approx(math.log(2), abs=1e-15)


def test_a_saturated_float32_softmax_gives_finite_parts():
    # a subnormal probability rounds the draws' mean to 0 in float32: the split stays finite (it was inf)
    probs = torch.tensor([[[1e-45, 1.0]]] + [[[0.0, 1.0]]] * 9)
    u = decompose_probabilities(probs)
    assert torch.isfinite(u.total).all() and torch.isfinite(u.epistemic).all()
    assert u.total.item() == pytest.approx(0.0, abs=1e-40)
    mixed = torch.tensor([[0.3, 0.7], [0.6, 0.4], [0.5, 0.5]], dtype=D).unsqueeze(1)
    mean = mixed.mean(0)
    expected = (mixed * (mixed.log() - mean.log())).sum(-1).mean(0)
    assert decompose_probabilities(mixed).epistemic.item() == pytest.approx(expected.item(), rel=1e-12)


def test_law_of_total_variance_of_draws():
    means = torch.tensor([[1.0, -2.0], [3.0, 0.0], [2.0, 5.0]], dtype=D)
    variances = torch.tensor([[0.5, 1.0], [1.5, 1.0], [1.0, 4.0]], dtype=D)
    u = decompose_moments(means, variances)
    mixture_second_moment = (variances + means**2).mean(0)
    assert torch.allclose(u.total, mixture_second_moment - means.mean(0) ** 2, atol=1e-13)
    assert torch.allclose(u.aleatoric, variances.mean(0)) and torch.equal(u.total, u.aleatoric + u.epistemic)


def _classifier(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=min(10, x.shape[0])) as idx:
        pyro.deterministic("probs", torch.softmax(x[idx, None] * w, -1))  # a recorded value, not the observed site
        pyro.sample("y", dist.Categorical(logits=x[idx, None] * w), obs=None if y is None else y[idx])


def _regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    with pyro.plate("data", x.shape[0], subsample_size=min(10, x.shape[0])) as idx:
        pyro.sample("y", dist.Normal(w * x[idx], 0.3), obs=None if y is None else y[idx])


def test_draws_of_a_pyro_classifier_match_the_mixture_of_their_categoricals():
    x = torch.linspace(-2, 2, 25, dtype=D)
    w = torch.tensor([[1.0, 0.0, -1.0], [-0.5, 2.0, 0.5]], dtype=D)
    u = draws_uncertainty(_classifier, {"w": w}, x)
    probs = torch.softmax(x[None, :, None] * w[:, None, :], -1)
    expected = decompose_probabilities(probs)
    assert u.total.shape == (25,)
    for got, want in zip(u[:3], expected[:3]):
        assert torch.allclose(got, want, atol=1e-14)
    closed = [_entropy(((probs[0, i] + probs[1, i]) / 2).tolist()) for i in range(25)]
    assert torch.allclose(u.total, torch.tensor(closed, dtype=D), atol=1e-13)


def test_draws_of_a_gaussian_regression_split_into_noise_and_variance_of_the_mean():
    x = torch.linspace(-1, 2, 7, dtype=D)
    w = torch.tensor([0.5, 1.0, 2.5, -1.0], dtype=D)
    u = draws_uncertainty(_regression, {"w": w}, x)
    assert u.measure == "variance"
    assert torch.allclose(u.aleatoric, torch.full((7,), 0.09, dtype=D), atol=1e-15)
    assert torch.allclose(u.epistemic, w.var(correction=0) * x**2, atol=1e-13)
    assert torch.equal(u.total, u.aleatoric + u.epistemic)


def test_mcmc_result_surface_splits_its_own_draws():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=g, dtype=D)
    y = torch.randint(0, 3, (40,), generator=g)
    mcmc = StochasticMCMC(SGLD(_classifier, step_size=1e-3), num_samples=6, num_warmup=5, seed=0, progress_bar=False)
    mcmc.run(x, y)
    x_new = torch.linspace(-3, 3, 5, dtype=D)
    u = mcmc.uncertainty(x_new)
    expected = draws_uncertainty(_classifier, mcmc.get_samples(), x_new)
    assert torch.equal(u.total, expected.total) and torch.equal(u.epistemic, expected.epistemic)
    assert mcmc.uncertainty().total.shape == (40,)  # no arguments: the run's data


def test_linearized_laplace_on_a_linear_gaussian_model_is_exact():
    problem = Problem()
    posterior = problem.laplace("full")
    x_new = torch.randn(6, problem.p, generator=torch.Generator().manual_seed(3), dtype=D)
    _, precision = problem.posterior(problem.prior_precision())
    design = torch.cat([x_new, torch.ones(6, 1, dtype=D)], 1)
    variance_of_mean = ((design @ torch.linalg.inv(precision)) * design).sum(-1)
    u = posterior.uncertainty(x_new)
    assert torch.allclose(u.epistemic, variance_of_mean, rtol=1e-8)
    assert torch.allclose(u.aleatoric, torch.full((6,), problem.noise**2, dtype=D), rtol=1e-8)
    assert torch.equal(u.total, u.aleatoric + u.epistemic)
    weights = posterior.uncertainty(x_new, linearized=False, num_samples=4000, seed=0)
    assert torch.allclose(weights.aleatoric, u.aleatoric, rtol=1e-8)
    # the variance over 4000 Gaussian draws has relative standard error sqrt(2 / 3999) ~ 0.022
    assert torch.allclose(weights.epistemic, variance_of_mean, rtol=5 * math.sqrt(2 / 3999))


def test_linearized_categorical_without_covariance_has_no_epistemic_part():
    mean = torch.tensor([[0.3, -1.0, 2.0], [0.0, 0.0, 0.0]], dtype=D)
    probs = torch.softmax(mean, -1)
    prediction = GLMPredictive(mean, torch.zeros(2, 3, 3, dtype=D), dist.Categorical(probs=probs))
    u = linearized_uncertainty(prediction, num_samples=10, seed=0)
    assert torch.allclose(u.epistemic, torch.zeros(2, dtype=D), atol=1e-12)
    assert torch.allclose(u.aleatoric, -(probs * probs.log()).sum(-1), atol=1e-14)


def test_linearized_bernoulli_matches_quadrature_within_monte_carlo_error():
    m, v, s = 0.5, 4.0, 20000
    prediction = GLMPredictive(
        torch.tensor([[m]], dtype=D), torch.tensor([[[v]]], dtype=D), dist.Bernoulli(probs=torch.tensor([0.6], dtype=D))
    )
    u = linearized_uncertainty(prediction, num_samples=s, seed=1)
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    p = 1 / (1 + np.exp(-(m + math.sqrt(v) * nodes)))
    weights = weights / weights.sum()
    aleatoric = float(weights @ -(p * np.log(p) + (1 - p) * np.log1p(-p)))
    mean = float(weights @ p)
    total = -(mean * math.log(mean) + (1 - mean) * math.log(1 - mean))
    # per-draw entropies are bounded by log 2: the expected entropy's standard error is at most log 2 / 2 sqrt(S)
    error = 5 * math.log(2) / (2 * math.sqrt(s))
    assert u.aleatoric.item() == pytest.approx(aleatoric, abs=error)
    # the mean probability's standard error is at most 1 / 2 sqrt(S), and |dH/dp| = |log((1 - p) / p)| < 1 near 0.56
    assert u.total.item() == pytest.approx(total, abs=5 / (2 * math.sqrt(s)))


@pytest.mark.parametrize("engine", ["swag", "sample_then_optimize"])
@pytest.mark.parametrize("linearized", [False, True])
def test_every_gaussian_engine_splits_off_the_known_noise(engine, linearized):
    from pyro_scalable.infer import SWAG, SampleThenOptimize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, generator=g, dtype=D)
    y = 1.5 * x + 0.3 * torch.randn(200, generator=g, dtype=D)
    if engine == "swag":
        posterior = SWAG(_regression, num_epochs=5, rank=3, seed=0, progress_bar=False).run(x, y)
        u = posterior.uncertainty(x[:5], num_samples=50, seed=0, linearized=linearized)
    else:
        posterior = SampleThenOptimize(_regression, num_samples=8, seed=0, progress_bar=False).run(x, y)
        u = posterior.uncertainty(x[:5], linearized=linearized)
    assert torch.allclose(u.aleatoric, torch.full((5,), 0.09, dtype=D), rtol=1e-6)
    assert bool((u.epistemic > 0).all()) and torch.equal(u.total, u.aleatoric + u.epistemic)
