"""SGHMC: exact tier (T = 0 is SGD with momentum, seeded step = formula) and gold tier (discrete Lyapunov)."""

from __future__ import annotations

import pytest
import torch

from pyro_scalable.infer import SGHMC, StochasticMCMC, sghmc

from ...conftest import LinearRegression
from .test_sgld import quadratic


@pytest.mark.parametrize("mass", [1.0, 2.5])
def test_zero_temperature_is_sgd_with_momentum(mass):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    fn, x0 = quadratic(a, b), torch.randn(4, generator=g, dtype=torch.float64)
    lr, momentum = 0.01, 0.9
    hyper = sghmc.sgd_hyperparameters(lr, momentum, mass=mass)
    state = sghmc.init({"x": x0.clone()})
    param = x0.clone().requires_grad_()
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum)
    for _ in range(50):
        state, _ = sghmc.step(state, None, fn, **hyper, mass=mass, temperature=0.0)
        opt.zero_grad()
        (-fn({"x": param}, None)).backward()
        opt.step()
        torch.testing.assert_close(state.latents["x"], param.detach(), rtol=1e-12, atol=1e-12)


def test_seeded_step_is_the_formula():
    a, b = torch.eye(2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    x, m = torch.tensor([0.3, 0.2], dtype=torch.float64), torch.tensor([0.1, -0.4], dtype=torch.float64)
    eps, alpha, mass, temp = 0.1, 2.0, 1.5, 0.8
    state, _ = sghmc.step(
        sghmc.init({"x": x}, {"x": m}),
        None,
        quadratic(a, b),
        step_size=eps,
        friction=alpha,
        mass=mass,
        temperature=temp,
        generator=torch.Generator().manual_seed(3),
    )
    xi = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    m_new = m + eps * (b - x) - eps * alpha / mass * m + (2 * alpha * eps * temp) ** 0.5 * xi
    torch.testing.assert_close(state.momenta["x"], m_new, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(state.latents["x"], x + eps / mass * m_new, rtol=1e-15, atol=1e-15)


def lyapunov(a: torch.Tensor, bbt: torch.Tensor) -> torch.Tensor:
    """Solve Σ = A Σ Aᵀ + B Bᵀ through vec(Σ) = (I - A ⊗ A)⁻¹ vec(B Bᵀ)."""
    n = a.shape[0]
    vec = torch.linalg.solve(torch.eye(n * n, dtype=a.dtype) - torch.kron(a, a), bbt.reshape(-1))
    return vec.reshape(n, n)


def linear_map(fn, hyper, temperature, seed=1):
    """The engine's (A, B) for z = (θ, m): z' = A z + B ξ, read off by stepping basis states and the zero state."""
    cols = []
    for theta, mom in ((1.0, 0.0), (0.0, 1.0)):
        s = sghmc.init(
            {"x": torch.tensor([theta], dtype=torch.float64)}, {"x": torch.tensor([mom], dtype=torch.float64)}
        )
        s = sghmc.step(s, None, fn, **hyper, temperature=0.0)[0]
        cols.append(torch.cat([s.latents["x"], s.momenta["x"]]))
    zero = sghmc.init({"x": torch.zeros(1, dtype=torch.float64)})
    s = sghmc.step(zero, None, fn, **hyper, temperature=temperature, generator=torch.Generator().manual_seed(seed))[0]
    xi = torch.randn(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.stack(cols, dim=1), torch.cat([s.latents["x"], s.momenta["x"]]) / xi


def step_matrix(engine, fn, hyper, dim):
    """A of the engine's z' = A z + noise for z = (θ, momenta) of a ``dim``-coordinate site: basis states at T = 0."""
    columns = []
    for k in range(2 * dim):
        z = torch.zeros(2 * dim, dtype=torch.float64)
        z[k] = 1.0
        s = engine.step(engine.init({"x": z[:dim]}, {"x": z[dim:]}), None, fn, **hyper, temperature=0.0)[0]
        columns.append(torch.cat([s.latents["x"], s.momenta["x"]]))
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("step_size,friction,mass", [(0.05, 1.0, 1.0), (0.2, 3.0, 2.0), (0.01, 10.0, 0.5)])
def test_lyapunov_covariance_matches_the_update_rule(step_size, friction, mass):
    sigma, temp = 0.8, 0.6
    fn = quadratic(torch.tensor([[1 / sigma]], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    hyper = {"step_size": step_size, "friction": friction, "mass": mass}
    a, b = linear_map(fn, hyper, temp)
    eps, s2 = step_size, sigma**2
    decay = 1 - eps * friction / mass
    a_rule = torch.tensor([[1 - eps**2 / (mass * s2), eps / mass * decay], [-eps / s2, decay]], dtype=torch.float64)
    c = (2 * friction * eps * temp) ** 0.5
    b_rule = torch.tensor([eps / mass * c, c], dtype=torch.float64)
    torch.testing.assert_close(a, a_rule, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(b, b_rule, rtol=1e-14, atol=1e-14)
    cov = lyapunov(a, torch.outer(b, b))
    # the discrete chain is biased by O(ε) away from the continuous-time law T σ² ⊕ T mass
    assert cov[0, 0] == pytest.approx(temp * s2, rel=5 * eps / min(1.0, mass * s2) + 1e-3)


def test_small_step_limit_is_the_tempered_target():
    sigma, temp = 1.5, 0.5
    fn = quadratic(torch.tensor([[1 / sigma]], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    a, b = linear_map(fn, {"step_size": 1e-4, "friction": 1.0, "mass": 1.0}, temp)
    cov = lyapunov(a, torch.outer(b, b))
    torch.testing.assert_close(
        cov, torch.diag(torch.tensor([temp * sigma**2, temp], dtype=torch.float64)), rtol=1e-3, atol=1e-4
    )


def test_friction_too_large_for_step_size_is_refused():
    with pytest.raises(ValueError, match="step_size \\* friction / mass"):
        sghmc.SGHMC(lambda: None, step_size=0.5, friction=4.0)


def test_diagonal_mass_step_is_the_formula():
    a, b = torch.eye(2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    x, m = torch.tensor([0.3, 0.2], dtype=torch.float64), torch.tensor([0.1, -0.4], dtype=torch.float64)
    mass = {"x": torch.tensor([0.5, 4.0], dtype=torch.float64)}
    state, _ = sghmc.step(
        sghmc.init({"x": x}, {"x": m}),
        None,
        quadratic(a, b),
        step_size=0.1,
        friction=2.0,
        mass=mass,
        temperature=0.8,
        generator=torch.Generator().manual_seed(3),
    )
    xi = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    m_new = m + 0.1 * (b - x) - 0.1 * 2.0 / mass["x"] * m + (2 * 2.0 * 0.1 * 0.8) ** 0.5 * xi
    torch.testing.assert_close(state.momenta["x"], m_new, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(state.latents["x"], x + 0.1 / mass["x"] * m_new, rtol=1e-15, atol=1e-15)


def test_a_friction_per_coordinate_step_is_the_formula():
    a, b = torch.eye(2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    x, m = torch.tensor([0.3, 0.2], dtype=torch.float64), torch.tensor([0.1, -0.4], dtype=torch.float64)
    mass = {"x": torch.tensor([0.5, 4.0], dtype=torch.float64)}
    friction = {"x": torch.tensor([0.5, 6.0], dtype=torch.float64)}
    state, info = sghmc.step(
        sghmc.init({"x": x}, {"x": m}),
        None,
        quadratic(a, b),
        step_size=0.1,
        friction=friction,
        mass=mass,
        temperature=0.8,
        generator=torch.Generator().manual_seed(3),
    )
    xi = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    alpha = friction["x"]
    m_new = m + 0.1 * (b - x) - 0.1 * alpha / mass["x"] * m + (2 * alpha * 0.1 * 0.8).sqrt() * xi
    torch.testing.assert_close(state.momenta["x"], m_new, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(state.latents["x"], x + 0.1 / mass["x"] * m_new, rtol=1e-15, atol=1e-15)
    assert float(info.friction) == 6.0  # sample_stats.friction: the largest coordinate's


@pytest.mark.parametrize("step_size", [1e-3, 0.05])
def test_a_friction_per_coordinate_keeps_a_correlated_gaussian_as_the_stationary_law(step_size):
    """Any positive diagonal friction leaves π ⊗ N(0, T M) stationary in continuous time: the discrete chain's exact
    stationary covariance (discrete Lyapunov equation of the update rule) is T Σ for θ up to O(ε), whatever α_j."""
    precision = torch.tensor([[2.0, 1.2], [1.2, 1.0]], dtype=torch.float64)  # correlation -0.85
    covariance, temp = torch.linalg.inv(precision), 0.7
    fn = quadratic(torch.linalg.cholesky(precision).T, torch.zeros(2, dtype=torch.float64))
    mass = {"x": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    hyper = {"step_size": step_size, "friction": {"x": torch.tensor([0.5, 8.0], dtype=torch.float64)}, "mass": mass}
    a = step_matrix(sghmc, fn, hyper, 2)
    zero = sghmc.init({"x": torch.zeros(2, dtype=torch.float64)})
    s = sghmc.step(zero, None, fn, **hyper, temperature=temp, generator=torch.Generator().manual_seed(1))[0]
    xi = torch.randn(2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = s.momenta["x"] / xi  # each coordinate's injected sd, √(2 α_j ε T)
    torch.testing.assert_close(scale, (2 * hyper["friction"]["x"] * step_size * temp).sqrt(), rtol=1e-12, atol=0)
    b = torch.cat([torch.diag(step_size / mass["x"] * scale), torch.diag(scale)])
    stationary = lyapunov(a, b @ b.T)
    # the discretisation's bias: O(ε²) in θ (1.8e-7 at ε = 0.001, 4.4e-4 at 0.05), O(ε α/m) in the momenta; the
    # same update with the largest friction's noise in every coordinate is off by 4.9 in θ
    torch.testing.assert_close(stationary[:2, :2], temp * covariance, rtol=0, atol=step_size**2 * temp)
    largest = float(hyper["friction"]["x"].max())
    torch.testing.assert_close(
        stationary[2:, 2:], temp * torch.diag(mass["x"]), rtol=0, atol=step_size * largest * temp
    )


def test_fisher_mass_is_learnt_in_warmup_normalised_and_frozen():
    """Features of scale 1 and 10: the per-example gradient variance, so the Fisher mass, differs by about 100×."""
    problem = LinearRegression(num_data=500, dim=2, batch_size=20)
    problem.x[:, 1] *= 10.0
    mcmc = StochasticMCMC(
        SGHMC(problem.model, mass="fisher"), num_samples=20, num_warmup=100, num_chains=2, seed=0, progress_bar=False
    )
    mcmc.run(problem.x, problem.y)
    mass = mcmc.state.hyperparameters["mass"]["w"]  # chosen in warm-up, per chain
    torch.testing.assert_close(mass.mean(-1), torch.ones(2, dtype=mass.dtype))  # normalised to mean 1 per chain
    assert bool((mass[:, 1] / mass[:, 0] > 30).all()), mass  # ~100 expected; a factor 3 of slack for 100 steps
    with pytest.raises(ValueError, match="mass"):
        SGHMC(problem.model, mass="newton")


def test_a_friction_is_raised_where_the_chains_gradient_noise_asks_for_more():
    """With the noise corrected, α_j is at least ε V̄_j / (2Tρ) on every step (ρ = 1/2), at most m_j / ε."""
    from pyro_scalable.infer.gradients import GradientEstimate

    x, m = torch.tensor([0.3, 0.2, -0.1], dtype=torch.float64), torch.tensor([0.1, -0.4, 0.2], dtype=torch.float64)
    noise = torch.tensor([0.5, 40.0, 4000.0], dtype=torch.float64)  # quiet, loud, louder than any friction fits
    grads = torch.tensor([0.2, -0.1, 0.05], dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    # handed as the program hands it to a kernel that corrects for the noise: the noise, and it as the correction
    gradient = GradientEstimate(
        {"x": grads}, zero, zero, torch.tensor(False), {"x": noise}, zero + 10, {}, {"x": noise}
    )
    step_size, temperature, given = 0.1, 0.8, 2.0
    state, info = sghmc.update(
        sghmc.init({"x": x}, {"x": m}),
        gradient,
        step_size=step_size,
        friction=given,
        temperature=temperature,
        generator=torch.Generator().manual_seed(5),
    )
    # the State's first noise average is the measurement itself; ε V̄ / (2Tρ) = 0.1 V / 0.8
    held = torch.clamp(torch.clamp(step_size * noise / (2 * temperature * 0.5), min=given), max=1.0 / step_size)
    assert held.tolist() == pytest.approx([2.0, 5.0, 10.0])
    xi = torch.randn(3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    injected = torch.clamp(2 * held * step_size * temperature - step_size**2 * noise, min=0.0)
    m_new = m * (1 - step_size * held) + step_size * grads + injected.sqrt() * xi
    torch.testing.assert_close(state.momenta["x"], m_new, rtol=1e-14, atol=1e-14)
    assert float(info.friction) == pytest.approx(10.0)
    assert float(info.uncorrected) == pytest.approx(1 / 3)  # only the coordinate no friction can balance
