"""Statistical tier: minibatch SGLD / SGHMC on a conjugate Bayesian linear regression vs its closed-form posterior.

The expected covariance is the *exact* stationary covariance of the discrete sampler on this Gaussian target with
exact gradients (per eigen-direction of the posterior precision H: SGLD's AR(1) variance, SGHMC's 2×2 discrete
Lyapunov solution) — it tends to T·H⁻¹ as ε → 0. What is left is Monte-Carlo error, for which the tolerance is
4 MCSE (ESS across chains), and the minibatch-gradient noise, which adds ε²V per step on top of the injected
noise (2εT for SGLD, 2αεT for SGHMC); its relative effect is bounded by εV/(2T) resp. εV/(2αT) with V the largest
eigenvalue of the N/B-scaled minibatch-gradient covariance at the posterior mean, taken twice as a margin for
evaluating V at one point. Nothing here is tuned to a seed. The mean of a linear-Gaussian target is unbiased.

BAOAB's exact law is its own 2×2 Lyapunov solution (whose θ-marginal is T·H⁻¹ exactly); its kicks bring
c²ε²V against O's (1 - c²)T, the same allowance with 2αε replaced by (1 - c²)/c². SGNHT has no exact law: its
thermostat starts at A and relaxes at a rate of about T/A per unit time, far slower than these runs, so it is
compared with SGHMC's law at friction A; the thermostat's drift towards A + εV̄/(2T) changes the friction by at
most εV/(2AT) relative, so SGNHT gets twice SGHMC's allowance. Its chains start at posterior draws: from the
prior, the energy released falling into the posterior would lift the thermostat far above A for the whole run.
A run costs about a minute of CPU (per-step overhead: 128 chains cost nearly as much as 512), so these two
engines run in the slow tier only; their fast checks are the gold tests in test_baoab.py / test_sgnht.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.ops.stats import effective_sample_size

from pyro_scalable.infer import BAOAB, SGHMC, SGLD, SGNHT, StochasticMCMC

from ...conftest import LinearRegression
from .test_sghmc import lyapunov


def gradient_noise(problem: LinearRegression) -> float:
    """Largest eigenvalue of the covariance of the N/B-scaled minibatch gradient at the posterior mean."""
    n, b = problem.x.shape[0], problem.batch_size
    resid = (problem.y - problem.x @ problem.mean) / problem.noise_scale**2
    per_example = problem.x * resid[:, None]
    cov = torch.cov(per_example.T) * n**2 / b * (1 - (b - 1) / (n - 1))  # sampling without replacement
    return float(torch.linalg.eigvalsh(cov).max())


def stationary_cov(problem: LinearRegression, kind: str, step_size: float, temperature: float, friction: float = 0.0):
    """Exact stationary covariance of the discrete sampler with exact gradients on this Gaussian target."""
    lam, vecs = torch.linalg.eigh(torch.linalg.inv(problem.cov))
    eps = step_size
    variances = []
    for h in lam.tolist():
        if kind == "sgld":
            variances.append(temperature / (h * (1 - eps * h / 2)))
        elif kind == "baoab":
            c, half = math.exp(-friction * eps), eps / 2
            a = torch.tensor([[1 - half * (1 + c) * eps * h, half * (1 + c)], [-c * eps * h, c]], dtype=torch.float64)
            s = ((1 - c**2) * temperature) ** 0.5
            b = torch.tensor([half * s, s], dtype=torch.float64)
            variances.append(float(lyapunov(a, torch.outer(b, b))[0, 0]))
        else:
            decay = 1 - eps * friction
            a = torch.tensor([[1 - eps**2 * h, eps * decay], [-eps * h, decay]], dtype=torch.float64)
            c = (2 * friction * eps * temperature) ** 0.5
            b = torch.tensor([eps * c, c], dtype=torch.float64)
            variances.append(float(lyapunov(a, torch.outer(b, b))[0, 0]))
    return vecs @ torch.diag(torch.tensor(variances, dtype=torch.float64)) @ vecs.T


def assert_matches(draws: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, allowance: float) -> None:
    """Compare (chain, draw, d) draws with N(mean, cov): 4 MCSE, plus a relative allowance for the covariance."""
    d = mean.shape[0]
    for i in range(d):
        series = draws[..., i]
        ess = float(effective_sample_size(series, chain_dim=0, sample_dim=1))
        mcse = float(series.std()) / ess**0.5
        assert abs(float(series.mean()) - float(mean[i])) <= 4 * mcse, f"mean[{i}]"
    centred = draws - draws.mean(dim=(0, 1))
    for i in range(d):
        for j in range(i, d):
            series = centred[..., i] * centred[..., j]
            ess = float(effective_sample_size(series, chain_dim=0, sample_dim=1))
            mcse = float(series.std()) / ess**0.5
            scale = float((cov[i, i] * cov[j, j]).sqrt())
            error = abs(float(series.mean()) - float(cov[i, j]))
            bound = 4 * mcse + allowance * scale
            assert error <= bound, f"cov[{i},{j}]: error {error:.3g} > {bound:.3g}"


def sample(kernel, problem, num_chains, num_warmup, num_samples, seed=0):
    mcmc = StochasticMCMC(
        kernel, num_samples=num_samples, num_warmup=num_warmup, num_chains=num_chains, seed=seed, progress_bar=False
    )
    mcmc.run(problem.x, problem.y)
    assert not bool(mcmc.sample_stats["diverging"].any())
    return mcmc.get_samples(group_by_chain=True)["w"]


SIZES = {  # (num_chains, num_warmup, num_samples): many short chains in CI, longer ones in the slow tier
    "fast": (512, 300, 300),
    "slow": pytest.param((1024, 600, 2000), marks=pytest.mark.slow),
}
PROBLEM = dict(num_data=1000, dim=2, batch_size=500)


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sgld_matches_conjugate_posterior(size, temperature):
    problem = LinearRegression(**PROBLEM)
    step_size = 2e-5
    kernel = SGLD(problem.model, step_size=step_size, temperature=temperature, init_strategy=init_to_sample)
    draws = sample(kernel, problem, *size)
    allowance = 2 * step_size * gradient_noise(problem) / (2 * temperature)
    assert_matches(draws, problem.mean, stationary_cov(problem, "sgld", step_size, temperature), allowance)


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sghmc_matches_conjugate_posterior(size, temperature):
    problem = LinearRegression(**PROBLEM)
    step_size, friction = 1e-3, 50.0
    kernel = SGHMC(
        problem.model, step_size=step_size, friction=friction, temperature=temperature, init_strategy=init_to_sample
    )
    draws = sample(kernel, problem, *size)
    allowance = 2 * step_size * gradient_noise(problem) / (2 * friction * temperature)
    expected = stationary_cov(problem, "sghmc", step_size, temperature, friction)
    assert_matches(draws, problem.mean, expected, allowance)


NEW_ENGINE_SIZES = {"fast": pytest.param(SIZES["fast"], marks=pytest.mark.slow), "slow": SIZES["slow"]}


def init_to_posterior(problem: LinearRegression, temperature: float):
    """A Pyro init strategy drawing ``w`` from the tempered closed-form posterior."""
    root = torch.linalg.cholesky(temperature * problem.cov)

    def strategy(site):
        return problem.mean + root @ torch.randn(problem.mean.shape, dtype=problem.mean.dtype)

    return strategy


@pytest.mark.parametrize("size", NEW_ENGINE_SIZES.values(), ids=NEW_ENGINE_SIZES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_baoab_matches_conjugate_posterior(size, temperature):
    problem = LinearRegression(**PROBLEM)
    step_size, friction = 1e-3, 50.0
    kernel = BAOAB(
        problem.model, step_size=step_size, friction=friction, temperature=temperature, init_strategy=init_to_sample
    )
    draws = sample(kernel, problem, *size)
    c = math.exp(-friction * step_size)
    allowance = 2 * c**2 * step_size**2 * gradient_noise(problem) / ((1 - c**2) * temperature)
    expected = stationary_cov(problem, "baoab", step_size, temperature, friction)
    torch.testing.assert_close(expected, temperature * problem.cov, rtol=1e-9, atol=0)  # BAOAB: exact θ-marginal
    assert_matches(draws, problem.mean, expected, allowance)


@pytest.mark.parametrize("size", NEW_ENGINE_SIZES.values(), ids=NEW_ENGINE_SIZES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sgnht_matches_conjugate_posterior(size, temperature):
    problem = LinearRegression(**PROBLEM)
    step_size, friction = 1e-3, 50.0
    init = init_to_posterior(problem, temperature)
    kernel = SGNHT(problem.model, step_size=step_size, friction=friction, temperature=temperature, init_strategy=init)
    draws = sample(kernel, problem, *size)
    allowance = 2 * 2 * step_size * gradient_noise(problem) / (2 * friction * temperature)
    expected = stationary_cov(problem, "sghmc", step_size, temperature, friction)
    assert_matches(draws, problem.mean, expected, allowance)


def test_small_step_limit_is_the_closed_form_posterior():
    """The exact discrete law the tests compare against is within 1% of T·H⁻¹ at these step sizes."""
    problem = LinearRegression(**PROBLEM)
    for kind, eps, friction in (("sgld", 2e-5, 0.0), ("sghmc", 1e-3, 50.0)):
        for temperature in (1.0, 0.5):
            cov = stationary_cov(problem, kind, eps, temperature, friction)
            torch.testing.assert_close(cov, temperature * problem.cov, rtol=0.01, atol=1e-3 * float(problem.cov.max()))
