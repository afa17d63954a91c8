"""Gradient-noise correction and warm-up: exact tier (the estimate and the corrected step are the formulas) and the
statistical test of issue 7 — minibatch 10 of 1,000 on a conjugate Pyro regression, corrected samplers calibrated,
uncorrected ones measurably too wide, both shown in the same test.

The statistical tolerance is the Monte-Carlo standard error of a standard deviation, sd / sqrt(2 ESS) (Gaussian
draws), with the ESS across chains; a run whose MCSE cannot resolve the 10% the issue asks for fails instead of
passing vacuously.
"""

from __future__ import annotations

import math

import pytest
import torch
from pyro.ops.stats import effective_sample_size

from pyro_scalable.bridge.model import Batch, ModelBridge
from pyro_scalable.infer import PSGLD, SGHMC, SGLD, SGNHT, StochasticMCMC, sgld
from pyro_scalable.infer.gradients import NOISE_WINDOW, Density, GradientEstimate, average_noise, estimate_gradient
from pyro_scalable.infer.gradients import estimate as estimate_module
from pyro_scalable.infer.sgmcmc.base import NOISE_EVERY

from ...conftest import LinearRegression


@pytest.mark.parametrize(
    "shared_from", [0, estimate_module.SHARED_FROM]
)  # the prior's terms apart, and in every example
@pytest.mark.parametrize("replacement", [False, True])
def test_noise_estimate_is_the_per_example_formula(replacement, shared_from, monkeypatch):
    monkeypatch.setattr(estimate_module, "SHARED_FROM", shared_from)
    problem = LinearRegression(num_data=50, dim=3, batch_size=10)
    bridge = ModelBridge(problem.model, (problem.x, problem.y))
    fn = bridge.log_posterior_fn
    fn.replacement = replacement
    w = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    idx = torch.tensor([0, 3, 3, 7, 11, 20, 21, 30, 41, 49])
    estimate = estimate_gradient(fn, {"w": w}, Batch({"data": idx}, bridge.args, bridge.kwargs), noise=True)
    per_example = -w + 50 * problem.x[idx] * (problem.y[idx] - problem.x[idx] @ w)[:, None]  # ∇log p(w) + N ∇ℓ_i
    shrink = (1.0 if replacement else 1 - 10 / 50) / 10
    torch.testing.assert_close(estimate.grads["w"], per_example.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(estimate.noise_variance["w"], per_example.var(0) * shrink, rtol=1e-12, atol=1e-12)
    plain = estimate_gradient(fn, {"w": w}, Batch({"data": idx}, bridge.args, bridge.kwargs))
    torch.testing.assert_close(plain.grads["w"], estimate.grads["w"], rtol=1e-12, atol=1e-12)
    assert plain.noise_variance == {}


class Examples(Density):
    """A log density with per-example terms, no Pyro: log p = Σ_i (-x² / (2n) + u_i x), examples of one point."""

    def __init__(self, u: torch.Tensor):
        self.u = u

    def __call__(self, latents, batch):
        n = self.u.shape[0]
        scale = n / batch.shape[-1]
        return (-(latents["x"] ** 2) / 2 + scale * (self.u[batch] * latents["x"]).sum()).sum()

    def examples(self, batch):
        return batch.unsqueeze(-1), 0, math.inf


def test_corrected_sgld_step_is_the_formula():
    u = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.float64)
    fn, batch, x = Examples(u), torch.tensor([0, 2, 3]), torch.tensor([0.4], dtype=torch.float64)
    eps, temp = 0.01, 0.8
    state, info = sgld.step(
        sgld.init({"x": x}),
        batch,
        fn,
        step_size=eps,
        temperature=temp,
        gradient_noise="correct",
        generator=torch.Generator().manual_seed(5),
    )
    g = -x + 5 * u[batch]  # per-example gradients
    variance = g.var() / 3  # drawn with replacement (population inf): no finite-population factor
    xi = torch.randn(1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = x + eps * g.mean() + torch.sqrt(2 * eps * temp - eps**2 * variance) * xi
    torch.testing.assert_close(state.latents["x"], expected, rtol=1e-13, atol=1e-13)
    assert float(info.noise_ratio) == pytest.approx(float(eps**2 * variance / (2 * eps * temp)))
    assert float(info.uncorrected) == 0.0


def test_a_noise_measurement_on_every_fourth_step_weighs_as_the_steps_it_stands_for():
    """Measured on steps 0, 4, 8, ...: the plain mean of the measurements until the window is full, then a moving
    average that forgets at the same rate in steps as one measured on every step (weight 4/50 per measurement)."""
    values = torch.linspace(1.0, 3.0, 40, dtype=torch.float64) ** 2
    average, kept = {}, []
    for t in range(4 * len(values)):
        measured = t % NOISE_EVERY == 0
        noise = {"x": values[t // NOISE_EVERY].reshape(1)} if measured else {}
        zero = torch.zeros(1, dtype=torch.float64)
        estimate = GradientEstimate({"x": zero}, zero.sum(), zero.sum(), torch.tensor(False), noise, zero.sum(), {})
        before = average
        average = average_noise(average, estimate, torch.tensor(t), NOISE_EVERY if measured else 0)
        if not measured:
            assert average is before  # nothing measured: the average as it was
        else:
            kept.append(float(average["x"]))
    full = NOISE_WINDOW // NOISE_EVERY  # 12 measurements: the weight 1/(n+1) reaches 4/50 after them
    for n in range(full):
        assert kept[n] == pytest.approx(float(values[: n + 1].mean()), rel=1e-12)
    expected = kept[full - 1]
    for n in range(full, len(values)):
        expected += NOISE_EVERY / NOISE_WINDOW * (float(values[n]) - expected)
        assert kept[n] == pytest.approx(expected, rel=1e-12)


def test_a_step_too_large_for_any_correction_injects_nothing_and_says_so():
    u = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.float64) * 100
    fn, batch, x = Examples(u), torch.tensor([0, 2, 3]), torch.tensor([0.4], dtype=torch.float64)
    state, info = sgld.step(
        sgld.init({"x": x}),
        batch,
        fn,
        step_size=0.01,
        gradient_noise="correct",
        generator=torch.Generator().manual_seed(5),
    )
    g = -x + 5 * u[batch]
    torch.testing.assert_close(state.latents["x"], x + 0.01 * g.mean())
    assert float(info.noise_ratio) > 1 and float(info.uncorrected) == 1.0


def sd_ratio(kernel, problem, num_chains, num_warmup, num_samples):
    """Per coordinate: (sd of the draws / exact posterior sd, its Monte-Carlo standard error)."""
    mcmc = StochasticMCMC(
        kernel, num_samples=num_samples, num_warmup=num_warmup, num_chains=num_chains, seed=0, progress_bar=False
    )
    mcmc.run(problem.x, problem.y)
    draws = mcmc.get_samples(group_by_chain=True)["w"]
    exact = problem.cov.diagonal().sqrt()
    ratios, errors = [], []
    for i in range(draws.shape[-1]):
        ess = float(effective_sample_size(draws[..., i], chain_dim=0, sample_dim=1))
        ratio = float(draws[..., i].std()) / float(exact[i])
        ratios.append(ratio)
        errors.append(ratio / math.sqrt(2 * ess))
    return torch.tensor(ratios), torch.tensor(errors), mcmc


KERNELS = {"sgld": SGLD, "sghmc": SGHMC, "psgld": PSGLD, "sgnht": SGNHT}
SIZES = (512, 300, 600)  # chains, warm-up, draws: ESS ~ 1,400 per coordinate, a 4-MCSE band of about 7.5%


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
@pytest.mark.parametrize("cls", KERNELS.values(), ids=KERNELS.keys())
def test_minibatch_of_10_in_1000_corrected_is_calibrated(cls):
    """The user picks the minibatch size and nothing else (step size from warm-up, noise corrected, Pyro's start)."""
    problem = LinearRegression(num_data=1000, dim=2, batch_size=10)
    # the plain correction (N/B = 100 would switch a control variate on: test_control_variates.py covers that)
    corrected, error, mcmc = sd_ratio(cls(problem.model, control_variate=None), problem, *SIZES)
    assert bool((4 * error < 0.08).all()), f"too few effective draws to resolve 10%: MCSE {error}"
    assert bool(((corrected - 1).abs() < 0.10).all()), f"corrected sd / exact sd = {corrected}"
    assert bool(((corrected - 1).abs() < 4 * error + 0.03).all()), corrected  # 3%: the warm-up's step-size bias
    stats = mcmc.sample_stats
    assert {"noise_ratio", "uncorrected", "step_size"} <= set(stats)
    assert float(stats["uncorrected"].float().mean()) < 0.01
    print(f"corrected {corrected.tolist()}, MCSE {error.tolist()}")


UNCORRECTED = {
    "sgld": SGLD,
    **{name: pytest.param(cls, marks=pytest.mark.slow) for name, cls in KERNELS.items() if name != "sgld"},
}


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
@pytest.mark.parametrize("cls", UNCORRECTED.values(), ids=UNCORRECTED.keys())
def test_minibatch_of_10_in_1000_uncorrected_is_too_wide(cls):
    """The same sampler and step-size rule without the correction: too wide, so the correction is what calibrates.

    The gradient noise adds ε²V per step on top of the wanted 2εT, up to half as much again at the chosen step size,
    so the sd comes out up to √1.5 ≈ 1.22× too wide (1.21 measured for all four kernels).
    """
    problem = LinearRegression(num_data=1000, dim=2, batch_size=10)
    uncorrected, error, _ = sd_ratio(cls(problem.model, gradient_noise="estimate"), problem, *SIZES)
    assert bool((uncorrected - 1 > 4 * error).all()), f"uncorrected sd / exact sd = {uncorrected} ± {error}"
    print(f"uncorrected {uncorrected.tolist()}, MCSE {error.tolist()}")


def test_group_size_rule():
    from pyro_scalable.bridge.log_posterior import group_size

    assert [group_size(b) for b in (2, 10, 32)] == [1, 1, 1]  # small minibatches: per example
    assert [group_size(b) for b in (50, 100, 128, 1000, 1024, 4096)] == [2, 4, 4, 40, 32, 128]
    assert [group_size(b) for b in (97, 134)] == [1, 1]  # no divisor in [16, 32]: per example


def test_grouped_noise_estimate_is_unbiased_over_partitions(monkeypatch):
    """Exact: averaged over all 720 orders of a minibatch of 6 (3 groups of 2), the grouped estimate is the
    per-example one, and every order's gradient is the minibatch gradient."""
    import itertools

    from pyro_scalable.bridge import log_posterior

    problem = LinearRegression(num_data=50, dim=3, batch_size=6)
    bridge = ModelBridge(problem.model, (problem.x, problem.y))
    fn = bridge.log_posterior_fn
    w = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    idx = torch.tensor([0, 3, 7, 11, 20, 41])
    per_example = -w + 50 * problem.x[idx] * (problem.y[idx] - problem.x[idx] @ w)[:, None]
    expected = per_example.var(0) * (1 - 6 / 50) / 6
    monkeypatch.setattr(log_posterior, "MAX_GROUPS", 3)
    monkeypatch.setattr(log_posterior, "MIN_GROUPS", 2)
    assert fn.examples(Batch({"data": idx}, bridge.args, bridge.kwargs)).group_size == 2
    total = torch.zeros(3, dtype=torch.float64)
    orders = list(itertools.permutations(range(6)))
    for order in orders:
        batch = Batch({"data": idx[list(order)]}, bridge.args, bridge.kwargs)
        estimate = estimate_gradient(fn, {"w": w}, batch, noise=True)
        torch.testing.assert_close(estimate.grads["w"], per_example.mean(0), rtol=1e-12, atol=1e-9)
        total += estimate.noise_variance["w"]
    torch.testing.assert_close(total / len(orders), expected, rtol=1e-10, atol=0.0)


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
@pytest.mark.parametrize("cls", [SGLD, SGHMC], ids=["sgld", "sghmc"])
def test_minibatch_of_200_grouped_noise_estimate_is_calibrated(cls):
    """At B = 200 the noise comes from 25 groups of 8 examples, not 200 single examples: still calibrated."""
    problem = LinearRegression(num_data=4000, dim=2, batch_size=200)
    corrected, error, mcmc = sd_ratio(cls(problem.model, control_variate=None), problem, *SIZES)
    assert bool((4 * error < 0.08).all()), f"too few effective draws to resolve 10%: MCSE {error}"
    assert bool(((corrected - 1).abs() < 4 * error + 0.03).all()), corrected
    print(f"corrected {corrected.tolist()}, MCSE {error.tolist()}")


@pytest.mark.parametrize("chosen", [True, False], ids=["warmup-step", "user-step"])
def test_uncorrected_warning_does_not_ask_to_lower_a_step_warmup_chose(chosen):
    from pyro_scalable.infer.sgmcmc.noise_probe import warn_uncorrected_noise

    stats = {"uncorrected": torch.full((2, 100), 0.05)}
    with pytest.warns(UserWarning, match="5.0% of the coordinates") as record:
        warn_uncorrected_noise(stats, 100, step_chosen=chosen)
    message = str(record[0].message)
    assert "subsample_size" in message
    assert ("Lower the step size" in message) is not chosen
    assert ("control_variate='map'" in message) is chosen


class SharedGradient(Density):
    """log p = (N/B) Σ_i (a + b)·u_i: autograd hands ``a`` and ``b`` one gradient tensor, which must stay intact."""

    def __init__(self, u: torch.Tensor):
        self.u = u

    def __call__(self, latents, batch):
        idx = batch.indices["data"]
        return self.u.shape[0] / idx.numel() * ((latents["a"] + latents["b"]) * self.u[idx].sum(0)).sum()

    def examples(self, batch):
        groups = batch.indices["data"].reshape(-1, 2)
        return Batch({"data": groups}, (), {}), Batch({"data": 0}, None, None), math.inf, 2


def test_the_noise_of_two_sites_sharing_one_gradient_tensor_is_each_sites_own():
    """The spread is centred in place only in memory no other site's gradient reads (here: one tensor for both)."""
    u = torch.randn(40, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fn, idx = SharedGradient(u), torch.arange(8)
    latents = {"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}
    estimate = estimate_gradient(fn, latents, Batch({"data": idx}, (), {}), noise=True)
    groups = 40 / 2 * u[idx].reshape(4, 2, 3).sum(1)  # each group's gradient, the same for a and b
    expected = 2 * groups.var(0) / 8  # m var_G(h_g) / B, drawn with replacement
    torch.testing.assert_close(estimate.noise_variance["a"], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(estimate.noise_variance["b"], expected, rtol=1e-12, atol=1e-12)
