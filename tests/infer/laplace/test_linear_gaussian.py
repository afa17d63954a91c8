"""Gold tier: on a linear-Gaussian Pyro model the Laplace posterior and its evidence are exact, at any prior."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy.optimize import minimize

from pyro_scalable.infer import AutoLinearizedLaplace

D = torch.float64


class Problem:
    """y = X w + b + noise; w ~ N(0, s_w²), b ~ N(0, s_b²)."""

    def __init__(self, n=120, p=3, noise=0.5, prior_w=1.3, prior_b=2.0, seed=0, latent_noise=False):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, p, generator=g, dtype=D)
        self.y = self.x @ torch.randn(p, generator=g, dtype=D) + 0.7 + noise * torch.randn(n, generator=g, dtype=D)
        self.n, self.p, self.noise, self.prior_w, self.prior_b = n, p, noise, prior_w, prior_b
        self.latent_noise = latent_noise
        self.design = torch.cat([self.x, torch.ones(n, 1, dtype=D)], 1)

    def model(self, x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(self.p, dtype=D), self.prior_w).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), self.prior_b))
        noise = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D))) if self.latent_noise else self.noise
        with pyro.plate("data", x.shape[0], subsample_size=min(40, x.shape[0])) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w + b, noise), obs=None if y is None else y[idx])

    def prior_precision(self, alpha=None):
        if alpha is not None:
            return torch.full((self.p + 1,), float(alpha), dtype=D)
        return torch.tensor([self.prior_w**-2] * self.p + [self.prior_b**-2], dtype=D)

    def posterior(self, prior_precision, noise=None):
        noise = self.noise if noise is None else noise
        precision = self.design.T @ self.design / noise**2 + torch.diag(prior_precision)
        mean = torch.linalg.solve(precision, self.design.T @ self.y / noise**2)
        return mean, precision

    def evidence(self, prior_precision, noise=None):
        noise = self.noise if noise is None else noise
        covariance = self.design @ torch.diag(1 / prior_precision) @ self.design.T + noise**2 * torch.eye(
            self.n, dtype=D
        )
        return dist.MultivariateNormal(torch.zeros(self.n, dtype=D), covariance).log_prob(self.y)

    def evidence_by_completing_the_square(self, prior_precision, noise=None):
        """The same evidence in O(d³): -n/2 log 2πσ² - |y|²/2σ² + μᵀHμ/2 + (log det P - log det H)/2."""
        noise = self.noise if noise is None else noise
        mean, precision = self.posterior(prior_precision, noise)
        return (
            -0.5 * self.n * math.log(2 * math.pi * noise**2)
            - 0.5 * (self.y**2).sum() / noise**2
            + 0.5 * mean @ precision @ mean
            + 0.5 * (prior_precision.log().sum() - torch.logdet(precision))
        )

    def laplace(self, structure, **kwargs):
        mean, _ = self.posterior(self.prior_precision())
        latents = {"w": mean[: self.p], "b": mean[self.p]}
        if self.latent_noise:
            latents["sigma"] = torch.tensor(self.noise, dtype=D)
        guide = AutoLinearizedLaplace(self.model)
        return guide.laplace_approximation(self.x, self.y, structure=structure, map_latents=latents, **kwargs)


@pytest.mark.parametrize("structure", ["full", "kron", "low_rank"])
def test_posterior_and_evidence_are_the_closed_form(structure):
    problem = Problem()
    prior = problem.prior_precision()
    assert math.isclose(
        float(problem.evidence(prior)), float(problem.evidence_by_completing_the_square(prior)), rel_tol=1e-12
    )
    posterior = problem.laplace(structure, rank=4)
    mean, precision = problem.posterior(problem.prior_precision())
    assert torch.allclose(posterior.precision.to_dense(), precision)
    assert torch.allclose(posterior.mean, mean)
    exact = problem.evidence(problem.prior_precision())
    assert math.isclose(float(posterior.log_marginal_likelihood()), float(exact), rel_tol=1e-12)


def test_evidence_and_mean_stay_exact_away_from_the_fitted_prior():
    problem = Problem()
    posterior = problem.laplace("full")
    for alpha, noise in [(0.05, None), (7.0, None), (0.3, 0.8), (2.0, 0.2)]:
        value = posterior.log_marginal_likelihood(alpha, noise)
        exact = problem.evidence(problem.prior_precision(alpha), noise)
        assert math.isclose(float(value), float(exact), rel_tol=1e-10), (alpha, noise)
    posterior.prior_precision = 7.0
    mean, precision = problem.posterior(problem.prior_precision(7.0))
    assert torch.allclose(posterior.mean, mean)
    assert torch.allclose(posterior.precision.to_dense(), precision)


def _exact_maximiser(problem, method, noise):
    width = {"scalar": 1, "site": 2, "diagonal": problem.p + 1}[method]

    def objective(log_values):
        precision = torch.tensor(log_values[:width]).exp()
        if method == "scalar":
            precision = problem.prior_precision(precision[0])
        elif method == "site":
            precision = torch.cat([precision[:1].expand(problem.p), precision[1:]])
        sigma = float(torch.tensor(log_values[-1]).exp()) if noise else None
        return -float(problem.evidence_by_completing_the_square(precision.to(D), sigma))

    start = [0.0] * width + ([0.0] if noise else [])
    result = minimize(
        objective, start, method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000}
    )
    return result.x, -result.fun


@pytest.mark.parametrize("method", ["scalar", "site", "diagonal"])
@pytest.mark.parametrize("noise", [False, True])
def test_optimize_prior_precision_finds_the_exact_evidence_maximiser(method, noise):
    problem = Problem()
    posterior = problem.laplace("full")
    posterior.optimize_prior_precision(method, observation_noise=noise)
    log_values, best = _exact_maximiser(problem, method, noise)
    assert math.isclose(float(posterior.log_marginal_likelihood()), best, abs_tol=1e-6)
    found = posterior.prior_precision.log()
    found = {"scalar": found[:1], "site": found[[0, problem.p]], "diagonal": found}[method]
    expected = torch.tensor(log_values[: found.numel()], dtype=D)
    assert torch.allclose(found, expected, atol=1e-3)
    if noise:
        assert math.isclose(float(posterior.observation_noise.log()), log_values[-1], abs_tol=1e-3)
        # and the posterior is the exact one at the optimised hyperparameters, the predictive with the fitted noise
        mean, precision = problem.posterior(posterior.prior_precision, posterior.observation_noise)
        assert torch.allclose(posterior.mean, mean)
        x_test = problem.x[:4]
        design = torch.cat([x_test, torch.ones(4, 1, dtype=D)], 1)
        variance = (design @ torch.linalg.inv(precision) * design).sum(-1) + posterior.observation_noise**2
        assert torch.allclose(posterior.predict(x_test).distribution.variance, variance)


def test_a_latent_noise_scale_is_held_at_its_map_and_can_be_fitted():
    problem = Problem(latent_noise=True)
    posterior = problem.laplace("full")
    assert posterior.sites == ["w", "b"]
    assert math.isclose(float(posterior.observation_noise), problem.noise)
    exact = problem.evidence(problem.prior_precision())
    assert math.isclose(float(posterior.log_marginal_likelihood()), float(exact), rel_tol=1e-12)
    posterior.optimize_prior_precision("scalar")
    draws = posterior.get_samples(5, seed=0)
    assert torch.allclose(draws["sigma"], posterior.observation_noise.expand(5))


def test_diag_evidence_uses_the_diagonal_log_determinant():
    problem = Problem()
    posterior = problem.laplace("diag")
    _, precision = problem.posterior(problem.prior_precision())
    assert torch.allclose(posterior.precision.to_dense(), torch.diag(precision.diagonal()))
    expected = problem.evidence(problem.prior_precision()) + 0.5 * (
        torch.logdet(precision) - precision.diagonal().log().sum()
    )
    assert math.isclose(float(posterior.log_marginal_likelihood()), float(expected), rel_tol=1e-10)


@pytest.mark.parametrize("structure", ["diag", "kron", "low_rank"])
def test_approximate_structures_use_the_evidence_at_the_map(structure):
    """Away from the fitted prior, the b-term needs the exact GGN; approximate structures leave it out."""
    problem = Problem()
    mean, _ = problem.posterior(problem.prior_precision())
    latents = {"w": mean[: problem.p] + 0.3, "b": mean[problem.p]}  # not the MAP: b is far from 0
    posterior = AutoLinearizedLaplace(problem.model).laplace_approximation(
        problem.x, problem.y, structure=structure, map_latents=latents, check_map=False, rank=2
    )
    assert torch.equal(posterior.mean, posterior.theta_star)
    # bounded as the noise shrinks (the b-term would grow like 1 / sigma^2 with a diagonal curvature)
    values = [float(posterior.log_marginal_likelihood(None, sigma)) for sigma in (0.5, 0.05, 0.005)]
    assert values[0] > values[1] > values[2]
    posterior.optimize_prior_precision("scalar")
    assert 0.05 < float(posterior.observation_noise) < 5


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_effective_parameters_is_mackays_gamma(structure):
    """γ = d − tr(P H⁻¹) in the structure's H (for "full" the exact one: at most the number of observations)."""
    problem = Problem(n=12, p=3)
    posterior = problem.laplace(structure)
    _, precision = problem.posterior(problem.prior_precision())
    if structure == "diag":
        precision = torch.diag(precision.diagonal())
    gamma = problem.p + 1 - float((torch.diag(problem.prior_precision()) @ torch.linalg.inv(precision)).trace())
    assert posterior.effective_parameters() == pytest.approx(gamma, rel=1e-10)


def test_a_noise_fitted_on_too_few_points_left_says_so():
    """Quiet with 116 of 120 points left to measure σ; with 12 weights for 12 points a warning naming σ, at the MAP and
    after the evidence (whose line search meets an H too ill-conditioned to factorise there, and steps back)."""
    healthy = Problem(n=120, latent_noise=True).laplace("full")
    healthy.optimize_prior_precision("scalar")  # warnings are errors here
    assert 120 - healthy.effective_parameters() > 100
    few = Problem(n=12, p=11, prior_w=10.0, latent_noise=True)  # the MAP interpolates
    with pytest.warns(UserWarning, match=r"MAP's noise scale is 'sigma' = .* leave N − γ = [0-9.]+ of the N = 12 "):
        posterior = few.laplace("full")
    assert 12 - posterior.effective_parameters() < 1.2
    with pytest.warns(UserWarning, match=r"the evidence fitted the noise scale 'sigma'"):
        posterior.optimize_prior_precision("scalar")
