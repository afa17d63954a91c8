"""BAOAB: exact tier (T = 0 is SGD with momentum, the one-gradient chain is BAOAB, seeded step = formula) and
gold tier (discrete Lyapunov: the θ-marginal is exact on a Gaussian for any stable step)."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_scalable.infer import BAOAB, baoab
from pyro_scalable.infer.schedules import Cyclical

from .test_sghmc import lyapunov, step_matrix
from .test_sgld import quadratic
from .test_sgnht import NoisyMean


@pytest.mark.parametrize("mass", [1.0, 2.5])
def test_zero_temperature_is_sgd_with_momentum(mass):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    fn, x0 = quadratic(a, b), torch.randn(4, generator=g, dtype=torch.float64)
    lr, momentum = 0.01, 0.9
    hyper = baoab.sgd_hyperparameters(lr, momentum, mass=mass)
    state = baoab.init({"x": x0.clone()})
    param = x0.clone().requires_grad_()
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum)
    for _ in range(50):
        state, _ = baoab.step(state, None, fn, **hyper, mass=mass, temperature=0.0)
        opt.zero_grad()
        (-fn({"x": param}, None)).backward()
        opt.step()
        torch.testing.assert_close(state.latents["x"], param.detach(), rtol=1e-12, atol=1e-12)


def test_one_gradient_chain_is_textbook_baoab():
    """Against BAOAB with two gradients per step, on a non-Gaussian target, with a step-size schedule."""
    mass, gamma, temp = 1.5, 2.0, 0.6
    schedule = Cyclical(initial=0.2, cycle_length=4)

    def fn(latents, batch):
        x = latents["x"]
        return -(x**4).sum() / 4 - 0.5 * (x - 1).square().sum()

    def force(x):
        return -(x**3) - (x - 1)

    x = torch.tensor([0.7, -1.2], dtype=torch.float64)
    p = torch.zeros(2, dtype=torch.float64)
    state = baoab.init({"x": x.clone()}, {"x": p.clone()})
    g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    eps0 = float(schedule(torch.tensor(0)))  # as the engine evaluates it, from the int64 step count
    p = p + eps0 / 2 * force(x)  # the chain's p₀: its stored momentum is owed the first closing half-kick
    for t in range(12):
        state, info = baoab.step(
            state, None, fn, step_size=schedule, friction=gamma, mass=mass, temperature=temp, generator=g1
        )
        eps = float(schedule(torch.tensor(t)))
        c = math.exp(-gamma * eps)
        p = p + eps / 2 * force(x)
        x = x + eps / 2 * p / mass
        p = c * p + ((1 - c**2) * temp * mass) ** 0.5 * torch.randn(2, generator=g2, dtype=torch.float64)
        x = x + eps / 2 * p / mass
        p = p + eps / 2 * force(x)
        torch.testing.assert_close(state.latents["x"], x, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(state.momenta["x"] + eps / 2 * force(x), p, rtol=1e-13, atol=1e-13)
        assert float(info.step_size) == pytest.approx(eps)


@pytest.mark.parametrize("gradient_noise", ["ignore", "correct"])
def test_seeded_step_is_the_formula(gradient_noise):
    x, p = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    eps, gamma, mass, temp, n = 0.1, 3.0, 2.0, 0.8, 10
    batch = torch.tensor([0.5, -0.2, 1.1, 0.4], dtype=torch.float64)
    state, info = baoab.step(
        baoab.init({"x": x}, {"x": p}),
        batch,
        NoisyMean(n),
        step_size=eps,
        friction=gamma,
        mass=mass,
        temperature=temp,
        gradient_noise=gradient_noise,
        generator=torch.Generator().manual_seed(3),
    )
    zeta = torch.randn(1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    per_example = -x + n * (batch - x)
    c = math.exp(-gamma * eps)
    injected = (1 - c**2) * temp * mass
    if gradient_noise == "correct":
        injected -= c**2 * eps**2 * (1 - 4 / n) * per_example.var() / 4
    kicked = p + eps * per_example.mean()
    p_new = c * kicked + injected**0.5 * zeta
    torch.testing.assert_close(state.momenta["x"], p_new, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(state.latents["x"], x + eps / 2 * (kicked + p_new) / mass, rtol=1e-14, atol=1e-14)
    assert float(info.friction) == gamma and not bool(info.diverging)


def linear_map(fn, hyper, temperature, seed=1):
    """The engine's (A, B) for the stored z = (θ, p̃): z' = A z + B ξ, read off by stepping basis states."""
    cols = []
    for theta, mom in ((1.0, 0.0), (0.0, 1.0)):
        s = baoab.init(
            {"x": torch.tensor([theta], dtype=torch.float64)}, {"x": torch.tensor([mom], dtype=torch.float64)}
        )
        s = baoab.step(s, None, fn, **hyper, temperature=0.0)[0]
        cols.append(torch.cat([s.latents["x"], s.momenta["x"]]))
    zero = baoab.init({"x": torch.zeros(1, dtype=torch.float64)})
    s = baoab.step(zero, None, fn, **hyper, temperature=temperature, generator=torch.Generator().manual_seed(seed))[0]
    xi = torch.randn(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.stack(cols, dim=1), torch.cat([s.latents["x"], s.momenta["x"]]) / xi


@pytest.mark.parametrize(
    "step_size,friction,mass", [(0.05, 1.0, 1.0), (0.5, 3.0, 2.0), (1.0, 0.5, 0.5), (1.5, 20.0, 1.0)]
)
def test_lyapunov_theta_marginal_is_exact(step_size, friction, mass):
    """Var θ = T σ² for any stable ε; stored p̃ has Var T m, Cov(θ, p̃) = T ε / 2; full p has T m (1 - ε²/(4mσ²))."""
    sigma, temp = 0.8, 0.6
    assert step_size < 2 * sigma * mass**0.5  # stable
    fn = quadratic(torch.tensor([[1 / sigma]], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    a, b = linear_map(fn, {"step_size": step_size, "friction": friction, "mass": mass}, temp)
    eps, lam, c = step_size, 1 / sigma**2, math.exp(-friction * step_size)
    # the update rule by hand: p' = p̃ - ε λ θ, θ' = θ + ε p' / 2m, p̃⁺ = c p' + s ξ, θ⁺ = θ' + ε p̃⁺ / 2m
    s = ((1 - c**2) * temp * mass) ** 0.5
    h = eps / (2 * mass)
    a_rule = torch.tensor([[1 - h * (1 + c) * eps * lam, h * (1 + c)], [-c * eps * lam, c]], dtype=torch.float64)
    torch.testing.assert_close(a, a_rule, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(b, torch.tensor([h * s, s], dtype=torch.float64), rtol=1e-13, atol=1e-13)
    cov = lyapunov(a, torch.outer(b, b))
    expected = torch.tensor([[temp * sigma**2, temp * eps / 2], [temp * eps / 2, temp * mass]], dtype=torch.float64)
    torch.testing.assert_close(cov, expected, rtol=1e-10, atol=1e-12)
    full = torch.tensor([-eps / 2 * lam, 1.0], dtype=torch.float64)  # p = p̃ + (ε/2) ĝ(θ)
    assert float(full @ cov @ full) == pytest.approx(temp * mass * (1 - eps**2 * lam / (4 * mass)), rel=1e-10)


@pytest.mark.parametrize("step_size", [0.05, 0.5])
def test_a_friction_per_coordinate_keeps_the_theta_marginal_of_a_correlated_gaussian(step_size):
    """Warm-up's friction per coordinate: O stays exact coordinate by coordinate, and θ's stationary covariance is
    still exactly T Σ for any stable step (the discrete Lyapunov equation of the update rule)."""
    precision = torch.tensor([[2.0, 1.2], [1.2, 1.0]], dtype=torch.float64)  # correlation -0.85
    covariance, temp = torch.linalg.inv(precision), 0.7
    fn = quadratic(torch.linalg.cholesky(precision).T, torch.zeros(2, dtype=torch.float64))
    mass, friction = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([0.5, 8.0], dtype=torch.float64)
    hyper = {"step_size": step_size, "friction": {"x": friction}, "mass": {"x": mass}}
    a = step_matrix(baoab, fn, hyper, 2)  # z = (θ, p̃)
    zero = baoab.init({"x": torch.zeros(2, dtype=torch.float64)})
    s, info = baoab.step(zero, None, fn, **hyper, temperature=temp, generator=torch.Generator().manual_seed(1))
    xi = torch.randn(2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    decay = torch.exp(-friction * step_size)
    scale = ((1 - decay**2) * temp * mass).sqrt()  # O's noise, coordinate by coordinate
    torch.testing.assert_close(s.momenta["x"], scale * xi, rtol=1e-12, atol=0)
    assert float(info.friction) == 8.0  # sample_stats.friction: the largest coordinate's
    b = torch.cat([torch.diag(step_size / (2 * mass) * scale), torch.diag(scale)])
    stationary = lyapunov(a, b @ b.T)
    torch.testing.assert_close(stationary[2:, 2:], temp * torch.diag(mass), rtol=1e-10, atol=1e-12)  # p̃: exact
    torch.testing.assert_close(stationary[:2, :2], temp * covariance, rtol=1e-10, atol=1e-12)


def test_divergence_restarts_the_half_kick():
    def bad(latents, batch):
        return -latents["x"].square().sum() * torch.tensor(float("nan"))

    state = baoab.init({"x": torch.ones(2, dtype=torch.float64)}, {"x": torch.ones(2, dtype=torch.float64)})
    new, info = baoab.step(state, None, bad, step_size=0.1, friction=1.0, generator=torch.Generator().manual_seed(0))
    assert bool(info.diverging) and bool(torch.isnan(new.previous_step_size))
    assert bool((new.momenta["x"] == 0).all())


def test_shell_validation_and_sgd_mapping():
    with pytest.raises(ValueError, match="friction"):
        BAOAB(lambda: None, step_size=0.1, friction=0.0)
    with pytest.raises(ValueError, match="mass"):
        BAOAB(lambda: None, step_size=0.1, mass={"x": torch.tensor([1.0, -1.0])})
    with pytest.raises(ValueError, match="momentum"):
        baoab.sgd_hyperparameters(lr=0.1, momentum=0.0)
    assert "friction=1.0" in repr(BAOAB(lambda: None, step_size=0.1))
