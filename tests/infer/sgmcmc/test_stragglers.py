"""Warm-up never hands sampling a chain that was left behind, and backs its step off after a divergence."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_uniform

from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC
from pyro_scalable.infer.gradients import NoiseEstimatingGradient
from pyro_scalable.infer.sgmcmc.adaptation import Adaptation, settle
from pyro_scalable.infer.sgmcmc.stragglers import GAP, WindowLog, copy_chains, donors_for, left_behind

from .test_adaptation import NoisyQuadratic


def test_a_window_finds_the_chain_far_below_the_others_and_the_one_that_diverged():
    window = WindowLog()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lp = torch.randn(5, generator=g, dtype=torch.float64) * 2.0 + torch.tensor([-10.0, -10.0, -10.5, -9.5, -40.0])
        window.observe(lp, torch.tensor([False, False, False, False, False]))
    window.observe(
        torch.tensor([-10.0, math.nan, -10.0, -10.0, -40.0]), torch.tensor([False, True, False, False, False])
    )
    assert window.left_behind().tolist() == [False, True, False, False, True]
    window.reset()
    assert window.left_behind() is None


def test_two_of_four_chains_far_below_are_both_behind_and_two_chains_are_never_compared():
    # the end of a warm-up at N = 10⁶ (latent-scale regression, seed 0): two chains 10⁴-10⁵ nats below, each
    # wandering by thousands; the lower of the two middle chains is one of them, so it cannot be the yardstick
    window = WindowLog()
    g = torch.Generator().manual_seed(2)
    centre = torch.tensor([-2.0, 2.0, -108_000.0, -25_000.0], dtype=torch.float64)
    spread = torch.tensor([2.0, 2.0, 6_000.0, 3_000.0], dtype=torch.float64)
    for _ in range(100):
        window.observe(centre + spread * torch.randn(4, generator=g, dtype=torch.float64), torch.zeros(4, dtype=bool))
    assert window.left_behind().tolist() == [False, False, True, True]
    pair = WindowLog()
    for _ in range(100):  # with two chains neither is the other's yardstick: only a diverged one is behind
        pair.observe(torch.tensor([-2.0, -25_000.0], dtype=torch.float64), torch.zeros(2, dtype=bool))
    assert not pair.left_behind().any()
    assert not left_behind(torch.tensor(-2.0), torch.tensor(1.0), torch.tensor(False))  # one chain's 0-d window


def test_chains_within_a_few_sds_of_each_other_are_all_kept():
    window = WindowLog()
    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor([0.0, 0.5, -0.5, 1.0], dtype=torch.float64) * 2.0  # up to half a GAP apart
    for _ in range(100):
        window.observe(offsets + 2.0 * torch.randn(4, generator=g, dtype=torch.float64), torch.zeros(4, dtype=bool))
    assert not window.left_behind().any()
    assert GAP * 2.0 > float(offsets.max() - offsets.min())


def test_no_restart_without_a_healthy_chain_or_without_a_straggler():
    assert donors_for(torch.tensor([True, True])) is None
    assert donors_for(torch.tensor([False, False])) is None


def test_a_restarted_chain_is_a_copy_of_its_donor_in_every_leaf():
    state = ({"x": torch.arange(8.0).reshape(4, 2)}, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    copied = copy_chains(state, torch.tensor([1, 3]), torch.tensor([0, 2]))
    assert copied[0]["x"].tolist() == [[0, 1], [0, 1], [4, 5], [4, 5]]
    assert copied[1].tolist() == [1.0, 1.0, 3.0, 3.0]
    assert state[1].tolist() == [1.0, 2.0, 3.0, 4.0]  # the original is left as it was


@pytest.mark.parametrize("kernel, order", [(SGHMC, 2), (SGLD, 1)], ids=["SGHMC", "SGLD"])
def test_a_diverging_warmup_step_halves_the_step_the_rule_chooses(kernel, order):
    u = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.float64)
    fn, batch = NoisyQuadratic(3000.0, u), torch.tensor([0, 2, 3])  # curvature-bound: the noise does not bind
    estimator = NoiseEstimatingGradient(fn)
    warmup = Adaptation(kernel(lambda: None, temperature=0.7), 4, estimator, estimator)
    phase = warmup.phase(3)._replace(power_iterations=1)  # calibrated (the second half of 4 steps)
    state = warmup.init({"x": torch.tensor([0.4], dtype=torch.float64)})
    state = state._replace(burning=torch.tensor(False))
    calm, _ = warmup.update(state, warmup.estimate(state, batch, estimator, phase), estimator, None, phase)
    diverging = warmup.estimate(calm, batch, estimator, phase)._replace(diverging=torch.tensor(True))
    halved, _ = warmup.update(calm, diverging, estimator, None, phase)  # a diverging step measures nothing: λ stays
    assert float(halved.backoff) == 0.5 and float(calm.backoff) == 1.0
    assert float(halved.tuned["step_size"]) == pytest.approx(0.5 * float(calm.tuned["step_size"]), rel=1e-12)
    assert order == warmup.rule.order
    # the curvature average is the measurement's, not the backed-off one the rule saw
    assert float(halved.curvature) == pytest.approx(float(calm.curvature), rel=1e-12)
    resumed = settle(warmup.kernel, halved._replace(burning=torch.tensor(True)), burn_in=False)
    assert float(resumed.backoff) == 1.0  # burn-in's divergences are forgiven where the calibrated half starts


def _regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", len(x), subsample_size=100) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, sigma), obs=None if y is None else y[idx])


def test_a_chain_started_at_a_stiff_point_is_restarted_and_the_run_agrees_with_itself():
    """The case behind the check: seed 10 drew one chain at sigma = 0.2 whose warm-up could not catch up.

    Before the check that chain ended 1,400 posterior sds from the others and r_hat was 600; the metric built from
    the window it polluted was wrong for every chain.
    """
    g = torch.Generator().manual_seed(1010)
    x = torch.randn(2000, 3, generator=g)
    w = torch.randn(3, generator=g)
    y = x @ w + 0.5 * torch.randn(2000, generator=g)
    kernel = SGHMC(_regression, init_strategy=init_to_uniform(radius=2.0))  # Pyro's draws, not the mode (N/B = 20)
    mcmc = StochasticMCMC(kernel, num_samples=600, num_warmup=1500, num_chains=4, seed=10, progress_bar=False)
    mcmc.run(x, y)
    assert int(mcmc.restarted.sum()) >= 1
    samples = mcmc.get_samples(group_by_chain=True)
    pooled_sd = samples["w"].std((0, 1))
    spread = (samples["w"].mean(1) - samples["w"].mean((0, 1))).abs() / pooled_sd
    assert float(spread.max()) < 0.5  # every chain's mean within half a posterior sd of the pooled mean
    assert mcmc.warmup_divergences.shape == (4,)
    stats = mcmc.to_inference_data(log_likelihood=False).sample_stats  # each chain's warm-up, along its draws
    assert stats["restarted"].values[:, 0].tolist() == mcmc.restarted.tolist()
    assert (stats["warmup_divergences"].values == mcmc.warmup_divergences.numpy()[:, None]).all()
