"""SGLD: exact tier (T = 0 is SGD, seeded step = formula) and gold tier (AR(1) stationary variance)."""

from __future__ import annotations

import pytest
import torch

from pyro_scalable.infer import sgld


def quadratic(a: torch.Tensor, b: torch.Tensor):
    """log p(x) = -½‖A x - b‖² (a Gaussian target with exact gradients)."""

    def log_posterior_fn(latents, batch):
        return -0.5 * (a @ latents["x"] - b).square().sum()

    return log_posterior_fn


def test_zero_temperature_is_torch_sgd():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    fn, x0, lr = quadratic(a, b), torch.randn(3, generator=g, dtype=torch.float64), 0.05
    state = sgld.init({"x": x0.clone()})
    param = x0.clone().requires_grad_()
    opt = torch.optim.SGD([param], lr=lr)
    for _ in range(20):
        state, _ = sgld.step(state, None, fn, step_size=lr, temperature=0.0)
        opt.zero_grad()
        (-fn({"x": param}, None)).backward()
        opt.step()
        # equal up to the rounding of the gradient of -f versus f
        torch.testing.assert_close(state.latents["x"], param.detach(), rtol=1e-14, atol=1e-14)


def test_seeded_step_is_the_formula():
    a, b = torch.eye(2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    x = torch.tensor([0.3, 0.2], dtype=torch.float64)
    state, info = sgld.step(
        sgld.init({"x": x}),
        None,
        quadratic(a, b),
        step_size=0.1,
        temperature=0.7,
        generator=torch.Generator().manual_seed(3),
    )
    xi = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = x + 0.1 * (b - x) + (2 * 0.1 * 0.7) ** 0.5 * xi
    torch.testing.assert_close(state.latents["x"], expected, rtol=1e-15, atol=1e-15)
    assert int(state.step_count) == 1 and not bool(info.diverging)
    assert float(info.step_size) == 0.1 and float(info.temperature) == pytest.approx(0.7)


@pytest.mark.parametrize("step_size", [1e-3, 0.1, 0.5])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_stationary_variance_is_ar1(step_size, temperature):
    """The engine's coefficients give Var = T σ² / (1 - ε / (2σ²)) exactly (no sampling)."""
    sigma = 1.3
    fn = quadratic(torch.tensor([[1 / sigma]], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    one = {"x": torch.ones(1, dtype=torch.float64)}
    zero = {"x": torch.zeros(1, dtype=torch.float64)}
    # deterministic part: x' = A x
    a = sgld.step(sgld.init(one), None, fn, step_size=step_size, temperature=0.0)[0].latents["x"]
    # noise part: from x = 0, x' = B ξ with ξ from the same seed
    bxi = sgld.step(
        sgld.init(zero),
        None,
        fn,
        step_size=step_size,
        temperature=temperature,
        generator=torch.Generator().manual_seed(1),
    )[0].latents["x"]
    xi = torch.randn(1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    variance = (bxi / xi) ** 2 / (1 - a**2)
    expected = temperature * sigma**2 / (1 - step_size / (2 * sigma**2))
    torch.testing.assert_close(variance, torch.tensor([expected], dtype=torch.float64), rtol=1e-12, atol=0)


def test_nonfinite_gradient_rejects_the_step():
    def fn(latents, batch):
        return -torch.log(latents["x"]).sum()  # NaN gradient... and value for negative x

    state = sgld.init({"x": torch.tensor([-1.0])})
    new, info = sgld.step(state, None, fn, step_size=0.1, generator=torch.Generator().manual_seed(0))
    assert bool(info.diverging)
    torch.testing.assert_close(new.latents["x"], state.latents["x"])
