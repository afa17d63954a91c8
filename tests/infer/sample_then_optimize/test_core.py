"""Gold tier for the sample-then-optimise core: the optimised sample solves the perturbed normal equations."""

from __future__ import annotations

import torch

from pyro_scalable.infer.linearized.sampling import core

D = torch.float64


def _problem(n=200, d=5, noise=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=D)
    precision = torch.linspace(0.5, 2.0, d, dtype=D)
    return x, 1 / noise**2, precision, g


def _perturbed_solution(x, b, precision, prior_sample, xi):
    h = b * x.T @ x + torch.diag(precision)
    rhs = precision * prior_sample + (b**0.5 * xi) @ x  # A theta0 + sum_i phi_i^T B_i^{1/2} xi_i, per sample
    return torch.linalg.solve(h, rhs.T).T


def _run(x, b, precision, targets, *, batch_size, epochs, step_size, generator, max_grad_norm=None):
    n = x.shape[0]

    def ggn_vp(z, idx):
        return b * (z @ x[idx].T) @ x[idx]

    state = core.init(targets)
    steps = epochs * (n // batch_size)
    for t in range(steps):
        idx = torch.randperm(n, generator=generator)[:batch_size]
        state, info = core.step(
            state,
            idx,
            ggn_vp,
            prior_precision=precision,
            data_scale=n / batch_size,
            step_size=step_size * (1 - t / steps),
            max_grad_norm=max_grad_norm,
        )
    return state, info


def _draws(x, b, precision, g, k):
    """theta0 ~ N(0, A^-1), xi ~ N(0, I), the regulariser centres, and the largest eigenvalue of H."""
    prior_sample = torch.randn(k, x.shape[1], generator=g, dtype=D) / precision.sqrt()
    xi = torch.randn(k, x.shape[0], generator=g, dtype=D)
    targets = core.regularizer_targets(prior_sample, precision, (b**0.5 * xi) @ x)
    largest = float(torch.linalg.eigvalsh(b * x.T @ x + torch.diag(precision)).max())
    return prior_sample, xi, targets, largest


def test_full_batch_optimum_is_the_perturbed_normal_equations_solution():
    x, b, precision, g = _problem()
    prior_sample, xi, targets, largest = _draws(x, b, precision, g, k=3)
    step_size = 0.5 / largest
    state, info = _run(x, b, precision, targets, batch_size=200, epochs=2000, step_size=step_size, generator=g)
    expected = _perturbed_solution(x, b, precision, prior_sample, xi)
    assert torch.allclose(state.samples, expected, rtol=1e-8, atol=1e-10)
    assert info.grad_norm.max() < 1e-8


def test_minibatch_sgd_with_decay_and_clipping_heads_for_the_same_point():
    """A convergence check, not a gold test: minibatch SGD reaches the solution at its usual O(1/sqrt(T)) pace."""
    x, b, precision, g = _problem()
    prior_sample, xi, targets, largest = _draws(x, b, precision, g, k=4)
    step_size = 0.2 / largest
    state, _ = _run(
        x, b, precision, targets, batch_size=20, epochs=300, step_size=step_size, generator=g, max_grad_norm=1e3
    )
    expected = _perturbed_solution(x, b, precision, prior_sample, xi)
    relative = (state.samples - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert relative.max() < 0.1


def test_preconditioned_full_batch_optimum_is_the_perturbed_normal_equations_solution():
    """Gold: with P = diag(M) + A the iteration still solves H z = A θⁿ; on features whose scales span 100x it gets
    there in 300 full-batch steps, where the plain step is still far off (its slow directions barely move)."""
    x, b, precision, g = _problem(d=6)
    x = x * torch.logspace(0, 2, 6, dtype=D)  # H's eigenvalues span about 10^4
    prior_sample, xi, targets, _ = _draws(x, b, precision, g, k=3)
    h = b * x.T @ x + torch.diag(precision)
    inverse = 1.0 / (b * x.square().sum(0) + precision)
    scaled_largest = float(torch.linalg.eigvalsh(inverse.sqrt()[:, None] * h * inverse.sqrt()).max())
    expected = _perturbed_solution(x, b, precision, prior_sample, xi)

    def full(z, _):
        return b * (z @ x.T) @ x

    results = {}
    for name, inv, step_size in (("diagonal", inverse, 0.5 / scaled_largest), ("none", None, 0.5 / largest_of(h))):
        state = core.init(targets)
        for _ in range(300):
            state, info = core.step(
                state,
                None,
                full,
                prior_precision=precision,
                data_scale=1.0,
                step_size=step_size,
                inverse_preconditioner=inv,
            )
        results[name] = ((state.samples - expected).norm(dim=-1) / expected.norm(dim=-1)).max()
    assert results["diagonal"] < 1e-8, results
    assert results["none"] > 0.1, results  # the same budget without the preconditioner: the check can fail


def largest_of(h):
    return float(torch.linalg.eigvalsh(h).max())
