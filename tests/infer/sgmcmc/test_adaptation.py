"""Warm-up on its own: the power iteration, the step-size rules against their formulas, burn-in's settle, the unwrap."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_scalable.infer import BAOAB, SGHMC, SGLD
from pyro_scalable.infer.gradients import Density, NoiseEstimatingGradient, PlainGradient
from pyro_scalable.infer.sgmcmc import tuning
from pyro_scalable.infer.sgmcmc.adaptation import Adaptation, TunedState
from pyro_scalable.infer.sgmcmc.base import Phase
from pyro_scalable.infer.sgmcmc.curvature import curvature_measurements, hessian_product, power_iterations

from .test_sgld import quadratic


class NoisyQuadratic(Density):
    """log p(x) = -½ λ |x|² + (N/B) Σ_batch u_i·x: curvature λ exactly, per-example gradients -λx + N u_i."""

    def __init__(self, curvature: float, u: torch.Tensor):
        self.curvature, self.u = curvature, u

    def __call__(self, latents, batch):
        x = latents["x"]
        scale = self.u.shape[0] / batch.shape[-1]
        return -0.5 * self.curvature * x.square().sum() + scale * (self.u[batch] * x).sum()

    def examples(self, batch):
        return batch.unsqueeze(-1), 0, math.inf  # drawn with replacement: no finite-population factor


def test_power_iterations_schedule():
    assert [power_iterations(step) for step in range(10)] == [8, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    # the curvature average counts the measurements made in the first `count` steps (its weights 1, 1/2, ...)
    for count in range(1, 30):
        made = sum(power_iterations(step) > 0 for step in range(count))
        assert int(curvature_measurements(torch.tensor(count))) == made


@pytest.mark.parametrize("metric", [None, {"x": torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)}])
def test_power_iteration_finds_the_largest_eigenvalue_of_a_known_matrix(metric):
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    a = rotation @ torch.diag(torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64)) @ rotation.T
    fn = quadratic(torch.linalg.cholesky(a).T, torch.zeros(3, dtype=torch.float64))  # log p = -½ xᵀ A x
    start = {"x": torch.tensor([1.0, 0.3, -0.2], dtype=torch.float64)}
    product = hessian_product(fn, {"x": torch.zeros(3, dtype=torch.float64)}, None, start, metric, iterations=60)
    root = torch.ones(3, dtype=torch.float64) if metric is None else metric["x"].sqrt()
    largest = torch.linalg.eigvalsh(root[:, None] * a * root[None, :]).max()
    assert float(product["x"].norm()) == pytest.approx(float(largest), rel=1e-10)


def one_calibrated_step(kernel, fn, batch):
    """Warm-up's first step, calibrated (no burn-in), on one chain at x = 0.4."""
    estimator = NoiseEstimatingGradient(fn)
    warmup = Adaptation(kernel, 1, estimator, estimator)
    state = warmup.init({"x": torch.tensor([0.4], dtype=torch.float64)})
    phase = warmup.phase(0)
    assert phase == Phase(power_iterations=8, burn_in=False)
    gradient = warmup.estimate(state, batch, estimator, phase)
    return warmup.update(state, gradient, estimator, torch.Generator().manual_seed(0), phase)


@pytest.mark.parametrize("curvature", [3.0, 3000.0], ids=["noise-bound", "curvature-bound"])
def test_sgld_step_size_is_the_formula_on_a_gaussian_of_known_curvature_and_noise(curvature):
    u = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.float64)
    fn, batch, temperature = NoisyQuadratic(curvature, u), torch.tensor([0, 2, 3]), 0.7
    state, info = one_calibrated_step(SGLD(lambda: None, temperature=temperature), fn, batch)
    per_example = -curvature * 0.4 + 5 * u[batch]
    noise = per_example.var() / 3
    expected = min(0.1 / curvature, 0.5 * 2 * temperature / float(noise))  # ε λ ≤ 0.1 and ε V ≤ ρ 2T, ρ = 1/2
    assert float(state.tuned["step_size"]) == pytest.approx(expected, rel=1e-12)
    assert float(info.step_size) == float(state.tuned["step_size"])  # the step took the step size it chose
    torch.testing.assert_close(state.estimator.noise["x"], noise.reshape(1), rtol=1e-12, atol=0)
    assert float(state.curvature) == pytest.approx(curvature, rel=1e-12)


@pytest.mark.parametrize("given", [None, 2.0], ids=["chosen", "given"])
def test_sghmc_step_size_and_friction_are_the_formula(given):
    """Two coordinates whose gradient noise differs 100×: a friction each (chosen), or one bounding ε (given)."""
    u = torch.tensor([[0.5, 0.05], [-1.0, -0.1], [2.0, 0.2], [0.25, 0.025], [-0.75, -0.075]], dtype=torch.float64)
    fn, batch, temperature, x = NoisyQuadratic(3.0, u), torch.tensor([0, 2, 3]), 0.7, [0.4, -0.2]
    estimator = NoiseEstimatingGradient(fn)
    warmup = Adaptation(SGHMC(lambda: None, friction=given, temperature=temperature), 1, estimator, estimator)
    state = warmup.init({"x": torch.tensor(x, dtype=torch.float64)})
    gradient = warmup.estimate(state, batch, estimator, warmup.phase(0))
    state, info = warmup.update(state, gradient, estimator, torch.Generator().manual_seed(0), warmup.phase(0))
    noise = (-3.0 * torch.tensor(x, dtype=torch.float64) + 5 * u[batch]).var(dim=0) / 3
    rate = noise / (2 * temperature * 0.5)  # each coordinate's friction must be at least ε times this
    if given is None:
        step_size = min(0.3 / math.sqrt(3.0), math.sqrt(0.5 / float(rate.max())))
        friction = torch.clamp(torch.clamp(step_size * rate, min=0.1 / step_size), max=0.5 / step_size)
        assert friction[0] > 2.5 * friction[1]  # the quiet coordinate keeps the default decay, 0.9
        torch.testing.assert_close(state.tuned["friction"]["x"], friction, rtol=1e-12, atol=0)
        assert float(info.friction) == pytest.approx(float(friction.max()), rel=1e-12)  # sample_stats: the largest
    else:
        step_size = min(0.3 / math.sqrt(3.0), given / float(rate.max()), 0.5 / given)
        assert "friction" not in state.tuned and float(info.friction) == given
    assert float(state.tuned["step_size"]) == pytest.approx(step_size, rel=1e-12)


def test_baoab_friction_is_the_formula():
    """One O decay for all: the largest up to 0.9 whose kicks' noise stays within ρ of O's, noisiest coordinate."""
    u = torch.tensor([[0.5, 0.05], [-1.0, -0.1], [2.0, 0.2], [0.25, 0.025], [-0.75, -0.075]], dtype=torch.float64)
    fn, batch, temperature, x = NoisyQuadratic(3.0, u), torch.tensor([0, 2, 3]), 0.7, [0.4, -0.2]
    estimator = NoiseEstimatingGradient(fn)
    warmup = Adaptation(BAOAB(lambda: None, temperature=temperature), 1, estimator, estimator)
    state = warmup.init({"x": torch.tensor(x, dtype=torch.float64)})
    gradient = warmup.estimate(state, batch, estimator, warmup.phase(0))
    state, info = warmup.update(state, gradient, estimator, torch.Generator().manual_seed(0), warmup.phase(0))
    noise = float(((-3.0 * torch.tensor(x, dtype=torch.float64) + 5 * u[batch]).var(dim=0) / 3).max())  # unit mass
    budget = 0.5 * temperature
    step_size = min(0.5 / math.sqrt(3.0), math.sqrt(budget * (1 - 0.25) / 0.25 / noise))
    decay = min(math.sqrt(budget / (budget + step_size**2 * noise)), 0.9)
    assert float(state.tuned["step_size"]) == pytest.approx(step_size, rel=1e-12)
    assert float(state.tuned["friction"]) == pytest.approx(-math.log(decay) / step_size, rel=1e-12)
    assert float(info.friction) == float(state.tuned["friction"])


def test_fisher_mass_is_the_noise_normalised_to_mean_one():
    noise = {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([0.0])}
    mass = tuning.fisher_mass(noise)
    torch.testing.assert_close(mass["a"], torch.tensor([0.75, 2.25]))
    torch.testing.assert_close(mass["b"], torch.tensor([1e-3]))  # floored at a thousandth of the mean


def test_settle_moves_the_chain_to_the_burn_in_average_and_zeroes_its_momenta():
    fn = quadratic(torch.eye(2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64))
    kernel = SGHMC(lambda: None, step_size=0.1, friction=1.0, mass="fisher")  # adapts: the Fisher mass

    class Examples(Density):  # exact gradients, offered as one example: noise 0
        def __call__(self, latents, batch):
            return fn(latents, batch)

        def examples(self, batch):
            return None

    estimator = NoiseEstimatingGradient(Examples())
    warmup = Adaptation(kernel, 4, estimator, estimator)  # steps 0 and 1 are burn-in
    state = warmup.init({"x": torch.tensor([3.0, 2.0], dtype=torch.float64)})
    generator = torch.Generator().manual_seed(0)
    positions = []
    for t in range(4):
        phase = warmup.phase(t)
        assert phase.burn_in == (t < 2) and phase.power_iterations == 0  # the step size is given
        state, _ = warmup.update(state, warmup.estimate(state, None, estimator, phase), estimator, generator, phase)
        positions.append(state.kernel.latents["x"].clone())
        if t == 2:
            # the first calibrated step ends at the average of the burn-in's positions (weights 1, then 1/2)
            centre = positions[0] + 0.5 * (positions[1] - positions[0])
            torch.testing.assert_close(state.kernel.latents["x"], centre, rtol=0, atol=0)
            assert bool((state.kernel.momenta["x"] == 0).all())
    assert not torch.equal(positions[3], positions[2])  # later steps move on from there
    assert not bool(state.burning)


def test_finish_keeps_the_kernel_state_the_chosen_hyperparameters_and_the_noise_average_only():
    u = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.float64)
    kernel = SGHMC(lambda: None, mass="fisher")
    state, _ = one_calibrated_step(kernel, NoisyQuadratic(3.0, u), torch.tensor([0, 2]))
    estimator = NoiseEstimatingGradient(NoisyQuadratic(3.0, u))
    tuned = Adaptation(kernel, 2, estimator, estimator).finish(state)
    assert isinstance(tuned, TunedState) and tuned.kernel is state.kernel
    assert tuned.estimator is state.estimator  # sampling goes on with warm-up's average of the gradient noise
    plain = Adaptation(kernel, 2, estimator, PlainGradient(estimator.density)).finish(state)
    assert plain.estimator.noise == {} and plain.estimator.count is state.estimator.count  # a plain one keeps none
    assert set(tuned.hyperparameters) == {"step_size", "friction", "mass"}
