"""pSGLD: exact tier (T = 0 is torch's RMSprop, a seeded step is the formula) and the mixing gain it exists for."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import PSGLD, SGLD, StochasticMCMC, psgld

from .test_sgld import quadratic


def test_zero_temperature_always_updating_is_torch_rmsprop():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    fn, x0 = quadratic(a, b), torch.randn(3, generator=g, dtype=torch.float64)
    hyper = {"step_size": 0.01, "decay": 0.9, "damping": 1e-6}
    state = psgld.init({"x": x0.clone()})
    param = x0.clone().requires_grad_()
    opt = torch.optim.RMSprop([param], lr=0.01, alpha=0.9, eps=1e-6)
    for _ in range(30):
        state, _ = psgld.step(state, None, fn, **hyper, updates="always", temperature=0.0)
        opt.zero_grad()
        (-fn({"x": param}, None)).backward()
        opt.step()
        torch.testing.assert_close(state.latents["x"], param.detach(), rtol=1e-12, atol=1e-12)


def test_seeded_step_is_the_formula_and_warmup_mode_freezes_the_preconditioner():
    a, b = torch.diag(torch.tensor([3.0, 0.5], dtype=torch.float64)), torch.tensor([1.0, -1.0], dtype=torch.float64)
    fn, x = quadratic(a, b), torch.tensor([0.3, 0.2], dtype=torch.float64)
    state = psgld.init({"x": x})
    state = state._replace(
        square_avg={"x": torch.tensor([4.0, 0.25], dtype=torch.float64)}, square_count=state.step_count + 1
    )
    new, info = psgld.step(
        state, None, fn, step_size=0.1, temperature=0.7, damping=1e-5, generator=torch.Generator().manual_seed(3)
    )
    grad = a.T @ (b - a @ x)
    precond = 1.0 / (1e-5 + torch.tensor([2.0, 0.5], dtype=torch.float64))
    xi = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = x + 0.1 * precond * grad + torch.sqrt(2 * 0.1 * 0.7 * precond) * xi
    torch.testing.assert_close(new.latents["x"], expected, rtol=1e-14, atol=1e-14)
    # outside warm-up (no Hessian product in the gradient) the default "warmup" mode leaves v alone: Γ = 0
    torch.testing.assert_close(new.square_avg["x"], state.square_avg["x"])
    assert float(info.step_size) == pytest.approx(0.1)


def test_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="decay"):
        PSGLD(lambda: None, decay=1.0)
    with pytest.raises(ValueError, match="preconditioner"):
        PSGLD(lambda: None, preconditioner="sometimes")
    with pytest.raises(ValueError, match="num_warmup"):
        StochasticMCMC(PSGLD(lambda: None), num_samples=1)


def badly_scaled(x):
    """Posterior precisions 10⁴ and 1: condition number 10⁴, exact gradients (no subsampling)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=torch.zeros(x.shape[0], dtype=x.dtype))


def test_psgld_mixes_a_badly_scaled_gaussian_where_sgld_does_not():
    """Both with the step size warm-up chooses and no learnt metric (warm-up's metric would fix SGLD's scaling too:
    this test is about RMSprop's own preconditioner); the measure is the ESS per step of the flat direction.

    On a Gaussian target with exact gradients a coordinate of (preconditioned) SGLD with a frozen metric is AR(1),
    x' = ρ x + noise, whose ESS per step is (1 - ρ)/(1 + ρ) ≈ (1 - ρ)/2; and 1 - ρ = E[(x' - x)²] / (2 Var x).
    So the mean squared move per step, over Var x = 1, is the ESS per step, measured on the chains themselves
    without estimating an autocorrelation time that a chain which barely moves cannot show.
    """
    n = 100
    x = torch.zeros(n, 2, dtype=torch.float64)
    x[:, 0] = (1e4 - 1) ** 0.5 / n**0.5  # Σ x₀² = 10⁴ - 1: the stiff direction; w₁ sees only its prior
    ess_per_step = {}
    for name, kernel in {"sgld": SGLD(badly_scaled), "psgld": PSGLD(badly_scaled)}.items():
        mcmc = StochasticMCMC(
            kernel, num_samples=200, num_warmup=300, num_chains=16, seed=0, progress_bar=False, metric="unit"
        )
        mcmc.run(x)
        flat = mcmc.get_samples(group_by_chain=True)["w"][..., 1]
        ess_per_step[name] = float((flat[:, 1:] - flat[:, :-1]).square().mean()) / 2
    # SGLD's step is bound by the stiff direction (ε λ_max = 0.1 gives 1 - ρ = 10⁻⁵ in the flat one); RMSprop's
    # metric takes the condition number to about its square root (1 - ρ ≈ 10⁻³). Ask for a third of that gain.
    print(f"ESS per step of the flat direction: {ess_per_step}")
    assert ess_per_step["psgld"] > 30 * ess_per_step["sgld"], ess_per_step
