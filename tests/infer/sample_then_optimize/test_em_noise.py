"""MacKay's update of a Normal likelihood's noise scale (``em_noise=True``), against the exact evidence maximiser.

For Bayesian linear regression the evidence in (α, β) is known in closed form; the joint MacKay iteration with the
exact γ converges to its maximiser (checked here against a grid of the exact log evidence), and the engine, with γ̂
from K draws, lands where that iteration does for a γ within its Monte-Carlo error. The fitted scale replaces the
model's everywhere: a latent noise site held fixed in the draws and the mean, and the predictive's variance.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer import SampleThenOptimize
from tests.conftest import LinearRegression

F64 = torch.float64
Z = 4.5


def _joint_update(x, y, alpha, beta, gamma_shift=0.0):
    """One exact MacKay update of (alpha, beta); ``gamma_shift`` perturbs gamma (its Monte-Carlo error)."""
    m = beta * x.T @ x
    h = m + alpha * torch.eye(x.shape[1], dtype=F64)
    mean = torch.linalg.solve(h, beta * x.T @ y)
    gamma = float(torch.trace(torch.linalg.solve(h, m))) + gamma_shift
    residual = float(((y - x @ mean) ** 2).sum())
    return gamma / float(mean @ mean), (x.shape[0] - gamma) / residual, gamma, h


def _fixed_point(x, y, gamma_shift=0.0):
    alpha, beta = 1.0, 1.0
    for _ in range(5000):
        new_alpha, new_beta, *_ = _joint_update(x, y, alpha, beta, gamma_shift)
        done = abs(new_alpha / alpha - 1) < 1e-13 and abs(new_beta / beta - 1) < 1e-13
        alpha, beta = new_alpha, new_beta
        if done:
            break
    return alpha, beta


def _log_evidence(x, y, alpha, beta):
    n, d = x.shape
    h = beta * x.T @ x + alpha * torch.eye(d, dtype=F64)
    mean = torch.linalg.solve(h, beta * x.T @ y)
    fit = beta * float(((y - x @ mean) ** 2).sum()) + alpha * float(mean @ mean)
    return 0.5 * (d * math.log(alpha) + n * math.log(beta) - fit - float(torch.logdet(h)) - n * math.log(2 * math.pi))


def test_the_exact_joint_iteration_maximises_the_evidence():
    problem = LinearRegression(num_data=60, dim=5, noise_scale=0.7, prior_scale=0.5, seed=4)
    alpha, beta = _fixed_point(problem.x, problem.y)
    best = _log_evidence(problem.x, problem.y, alpha, beta)
    for da in (0.97, 1.03):
        for db in (0.97, 1.03):
            assert _log_evidence(problem.x, problem.y, alpha * da, beta * db) < best


def test_em_noise_reaches_the_joint_evidence_maximiser_within_monte_carlo_error():
    problem = LinearRegression(num_data=300, dim=8, batch_size=100, noise_scale=0.6, prior_scale=0.4, seed=3)
    x, y = problem.x, problem.y
    k = 64
    engine = SampleThenOptimize(
        problem.model, num_samples=k, em_steps=15, em_noise=True, em_epochs=10, seed=0, progress_bar=False
    )
    engine.run(x, y)
    history = engine.em_history
    assert history["noise_scale"].shape == (16,) and float(history["noise_scale"][0]) == pytest.approx(0.6)
    alpha_star, beta_star = _fixed_point(x, y)
    # gamma-hat's Monte-Carlo sd at the fixed point: sqrt(2 tr((H^-1 M)^2) / K) for Gaussian draws
    _, _, _, h = _joint_update(x, y, alpha_star, beta_star)
    ratios = torch.linalg.eigvalsh(torch.linalg.solve(h, beta_star * x.T @ x))
    gamma_se = math.sqrt(2 * float((ratios**2).sum()) / k)
    low, high = _fixed_point(x, y, -Z * gamma_se), _fixed_point(x, y, Z * gamma_se)
    alpha, sigma = float(history["prior_precision"][-1, 0]), float(engine.noise_scale)
    assert min(low[0], high[0]) <= alpha <= max(low[0], high[0]), (alpha, low, high)
    sigmas = sorted(b**-0.5 for b in (low[1], high[1]))
    assert sigmas[0] <= sigma <= sigmas[1], (sigma, sigmas, beta_star**-0.5)
    # the run's draws are the posterior at the fitted (alpha, sigma): its mean is the exact one there
    exact = torch.linalg.solve(x.T @ x / sigma**2 + alpha * torch.eye(8, dtype=F64), x.T @ y / sigma**2)
    assert torch.allclose(engine.get_mean()["w"], exact, rtol=1e-6, atol=1e-8)


def _latent_noise_model(x, y=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(2.0)))
    with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, sigma), obs=None if y is None else y[idx])


def test_a_latent_noise_site_carries_the_fitted_scale_in_draws_and_predictions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -1.0, 0.5], dtype=F64) + 0.3 * torch.randn(400, generator=g, dtype=F64)
    start = {"w": torch.zeros(3, dtype=F64), "sigma": torch.tensor(1.5, dtype=F64)}  # far from 0.3
    engine = SampleThenOptimize(
        _latent_noise_model,
        num_samples=16,
        em_steps=8,
        em_noise=True,
        linearize_at=start,
        seed=0,
        progress_bar=False,
    )
    engine.run(x, y)
    sigma = float(engine.noise_scale)
    assert abs(sigma - 0.3) < 0.05, sigma
    draws = engine.get_samples()
    assert torch.allclose(draws["sigma"], torch.full((16,), sigma, dtype=F64))
    assert float(engine.get_mean()["sigma"]) == pytest.approx(sigma)
    predictive = engine.predict(x[:5])
    variance = predictive.distribution.variance
    assert torch.all(variance >= sigma**2 - 1e-9) and torch.all(variance < sigma**2 + 0.05), variance


def test_em_noise_is_refused_where_it_does_not_apply():
    x = torch.randn(100, 2, dtype=F64)
    labels = (x[:, 0] > 0).to(F64)

    def logistic(x, y=None):
        w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])

    with pytest.raises(ModelError, match="em_noise=True needs observed site 'y' to be a Normal"):
        SampleThenOptimize(logistic, num_samples=2, em_steps=1, em_noise=True, progress_bar=False).run(x, labels)
    with pytest.raises(ValueError, match="em_steps >= 1"):
        SampleThenOptimize(logistic, em_noise=True)


# ------------------------------------------------------------------------------------------ damping the M-step
def _iterate(fixed_point: float, slope: float, steps: int, damped: bool) -> list[float]:
    """x_{t+1} = F(x_t) in log alpha with F(x) = x* + slope (x - x*), the update damped or not."""
    from pyro_scalable.infer.linearized.sampling.em import damp_oscillation

    history = [torch.tensor([1.0], dtype=F64)]
    for _ in range(steps):
        x = math.log(float(history[-1]))
        proposal = torch.tensor([math.exp(fixed_point + slope * (x - fixed_point))], dtype=F64)
        history.append(damp_oscillation(history, proposal) if damped else proposal)
    return [math.log(float(a)) for a in history]


@pytest.mark.parametrize("slope", [-1.0, -0.7, -0.3])
def test_damping_stops_an_oscillating_iteration(slope):
    plain, damped = _iterate(1.5, slope, 6, False), _iterate(1.5, slope, 6, True)
    assert abs(damped[-1] - 1.5) < 0.05 * 1.5  # within 5% of log alpha* after 6 steps
    assert abs(damped[-1] - 1.5) < abs(plain[-1] - 1.5) or slope > -0.5


@pytest.mark.parametrize("slope", [0.0, 0.3, 0.8])
def test_damping_leaves_a_monotone_iteration_alone(slope):
    assert _iterate(1.5, slope, 6, True) == pytest.approx(_iterate(1.5, slope, 6, False), rel=1e-12)
