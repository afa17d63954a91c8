"""SGNHT: exact tier (seeded step = formula, frozen thermostat = SGHMC, no T = 0) and a statistical tier.

SGNHT is nonlinear in (θ, p, ξ), so there is no Lyapunov equation for it. The statistical test uses one exact
discrete identity instead — a stationary thermostat has E[Δξ] = 0, so E[pᵀp/d] = T exactly for any ε — and for
Var θ and E[ξ] the mean-field discrete law: SGHMC with friction α* (the friction that gives E[pᵀp/d] = T)
and SGNHT's injected noise 2AεT, whose exact stationary covariance is a 2×2 discrete Lyapunov solution per
eigen-direction. Its bias from Tσ² and A (about εA/2 here) is the documented allowance, doubled for the
thermostat's fluctuations around α*.
"""

from __future__ import annotations

import pytest
import torch
from pyro.ops.stats import effective_sample_size
from torch.func import vmap

from pyro_scalable.infer import SGNHT, sghmc, sgnht
from pyro_scalable.infer.gradients import Density

from .test_sghmc import lyapunov
from .test_sgld import quadratic


class NoisyMean(Density):
    """log p(x) = -½x² + (N/B) Σ_batch -½(y_i - x)²: a minibatch estimate with per-example terms."""

    def __init__(self, population_size: int):
        self.population_size = population_size

    def __call__(self, latents, batch):
        x = latents["x"]
        return -0.5 * x.square().sum() - 0.5 * self.population_size / batch.shape[0] * (batch - x).square().sum()

    def examples(self, batch):
        return batch[:, None], 0, self.population_size


@pytest.mark.parametrize("gradient_noise", ["ignore", "correct"])
def test_seeded_step_is_the_formula(gradient_noise):
    x, p = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    eps, alpha, xi, temp, n = 0.05, 2.0, 1.7, 0.8, 10
    batch = torch.tensor([0.5, -0.2, 1.1, 0.4], dtype=torch.float64)
    fn = NoisyMean(n)
    state, info = sgnht.step(
        sgnht.init({"x": x}, {"x": p}, friction=alpha, thermostat=xi),
        batch,
        fn,
        step_size=eps,
        friction=alpha,
        temperature=temp,
        gradient_noise=gradient_noise,
        generator=torch.Generator().manual_seed(3),
    )
    zeta = torch.randn(1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    per_example = -x + n * (batch - x)
    g = per_example.mean()
    injected = 2 * alpha * eps * temp
    if gradient_noise == "correct":
        injected -= eps**2 * (1 - 4 / n) * per_example.var() / 4
    p_new = p + eps * g - eps * xi * p + injected**0.5 * zeta
    torch.testing.assert_close(state.momenta["x"], p_new, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(state.latents["x"], x + eps * p_new, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(state.thermostat, xi + eps * (p_new.square().sum() - temp), rtol=1e-14, atol=1e-14)
    assert float(info.thermostat) == float(state.thermostat) and float(info.friction) == alpha


def test_frozen_thermostat_is_sghmc_with_that_friction():
    a, b = torch.tensor([[1.0, 0.3], [0.0, 2.0]], dtype=torch.float64), torch.tensor([0.5, -1.0], dtype=torch.float64)
    fn, alpha, eps, temp = quadratic(a, b), 1.5, 0.1, 0.7
    start = {"x": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    nose, hmc = sgnht.init(start, friction=alpha), sghmc.init(start)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):
        nose = sgnht.step(nose, None, fn, step_size=eps, friction=alpha, temperature=temp, generator=g1)[0]
        nose = nose._replace(thermostat=torch.full_like(nose.thermostat, alpha))  # freeze ξ at A
        hmc = sghmc.step(hmc, None, fn, step_size=eps, friction=alpha, temperature=temp, generator=g2)[0]
        torch.testing.assert_close(nose.latents["x"], hmc.latents["x"], rtol=1e-15, atol=1e-15)
        torch.testing.assert_close(nose.momenta["x"], hmc.momenta["x"], rtol=1e-15, atol=1e-15)


def test_zero_temperature_is_refused():
    with pytest.raises(ValueError, match="no temperature-0 limit"):
        SGNHT(lambda: None, step_size=0.1, temperature=0.0)
    with pytest.raises(ValueError, match="no temperature-0 limit"):
        sgnht.step(
            sgnht.init({"x": torch.zeros(1)}),
            None,
            quadratic(torch.eye(1), torch.zeros(1)),
            step_size=0.1,
            temperature=0.0,
        )


def test_step_size_times_friction_is_checked():
    with pytest.raises(ValueError, match="step_size \\* friction"):
        SGNHT(lambda: None, step_size=0.5, friction=2.0)


def mean_field(eps: float, friction: float, temp: float, curvatures: list[float]) -> tuple[float, list[float]]:
    """ξ frozen at α*, where E[pᵀp/d] = T: α* and each direction's exact Var θ / (Tσ²) (Lyapunov)."""

    def cov(alpha, lam):
        decay = 1 - eps * alpha
        a = torch.tensor([[1 - eps**2 * lam, eps * decay], [-eps * lam, decay]], dtype=torch.float64)
        c = (2 * friction * eps * temp) ** 0.5
        b = torch.tensor([eps * c, c], dtype=torch.float64)
        return lyapunov(a, torch.outer(b, b))

    lo, hi = 0.1 * friction, 10 * friction  # the kinetic energy falls as the friction grows
    for _ in range(60):
        mid = (lo + hi) / 2
        kinetic = sum(float(cov(mid, lam)[1, 1]) for lam in curvatures) / len(curvatures)
        lo, hi = (mid, hi) if kinetic > temp else (lo, mid)
    return mid, [float(cov(mid, lam)[0, 0]) * lam / temp for lam in curvatures]


def mcse_bound(series: torch.Tensor) -> float:
    """4 Monte-Carlo standard errors of the mean of a (chain, draw) series (ESS across chains)."""
    ess = float(effective_sample_size(series, chain_dim=0, sample_dim=1))
    return 4 * float(series.std()) / ess**0.5


def test_stationary_law_on_a_gaussian():
    """Many vmapped chains on N(0, diag σ²): E[pᵀp/d] = T exactly, Var θ ≈ Tσ² and E[ξ] ≈ A (mean-field)."""
    sigma = torch.tensor([1.0, 0.5], dtype=torch.float64)
    eps, friction, temp = 0.05, 1.0, 0.7
    num_chains, num_warmup, num_samples = 1000, 150, 450

    def fn(latents, batch):
        return -0.5 * (latents["x"] / sigma).square().sum()

    g = torch.Generator().manual_seed(0)
    start = {"x": temp**0.5 * sigma * torch.randn(num_chains, 2, generator=g, dtype=torch.float64)}
    momenta = {"x": temp**0.5 * torch.randn(num_chains, 2, generator=g, dtype=torch.float64)}
    state = vmap(lambda x, p: sgnht.init(x, p, friction=friction))(start, momenta)
    one = vmap(
        lambda s: sgnht.step(s, None, fn, step_size=eps, friction=friction, temperature=temp, generator=g),
        randomness="different",
    )
    thetas = torch.empty(num_chains, num_samples, 2, dtype=torch.float64)
    kinetic = torch.empty(num_chains, num_samples, dtype=torch.float64)
    thermostat = torch.empty(num_chains, num_samples, dtype=torch.float64)
    for t in range(num_warmup + num_samples):
        state, info = one(state)
        if t >= num_warmup:
            thetas[:, t - num_warmup] = state.latents["x"]
            kinetic[:, t - num_warmup] = state.momenta["x"].square().mean(-1)
            thermostat[:, t - num_warmup] = info.thermostat

    assert abs(float(kinetic.mean()) - temp) <= mcse_bound(kinetic)  # exact: no allowance
    alpha_star, variance_ratio = mean_field(eps, friction, temp, (1 / sigma**2).tolist())
    assert abs(float(thermostat.mean()) - friction) <= mcse_bound(thermostat) + 2 * abs(alpha_star - friction)
    for j in range(2):
        square = thetas[..., j].square() / (temp * sigma[j] ** 2)
        allowance = 2 * abs(variance_ratio[j] - 1)
        assert abs(float(square.mean()) - 1) <= mcse_bound(square) + allowance, f"Var θ[{j}]"
        assert abs(float(thetas[..., j].mean())) <= mcse_bound(thetas[..., j])
