"""Chains that share each step's minibatch (``StochasticMCMC(shared_minibatches=True)``)."""

from __future__ import annotations

import math

import pytest
import torch
from pyro.ops.stats import effective_sample_size

from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC

from ...conftest import LinearRegression


@pytest.mark.parametrize("replacement", [False, True])
def test_a_shared_stream_is_one_chain_stream(regression, replacement):
    bridge = ModelBridge(regression.model, (regression.x, regression.y))
    shared = EpochSampler(
        bridge.plates, 5, torch.Generator().manual_seed(3), bridge.device, replacement=replacement, shared=True
    )
    single = EpochSampler(bridge.plates, 1, torch.Generator().manual_seed(3), bridge.device, replacement=replacement)
    for _ in range(25):  # 25 x 100 > N = 1000: the epoch's reshuffle included
        got, want = next(shared)["data"], next(single)["data"]
        assert got.shape == (regression.batch_size,)
        assert torch.equal(got, want[0])


def run(kernel, data, **options):
    mcmc = StochasticMCMC(kernel, num_samples=20, num_warmup=5, num_chains=3, seed=1, progress_bar=False, **options)
    mcmc.run(*data)
    return mcmc.get_samples(group_by_chain=True)["w"]


@pytest.mark.parametrize("kernel_cls", [SGLD, SGHMC])
def test_vectorized_shared_chains_equal_a_loop_and_see_one_minibatch(regression, kernel_cls):
    kernel = kernel_cls(regression.model, step_size=1e-3, temperature=0.0)
    data = (regression.x, regression.y)
    vectorized = run(kernel, data, shared_minibatches=True)
    sequential = run(kernel, data, shared_minibatches=True, chain_method="sequential")
    torch.testing.assert_close(vectorized, sequential, rtol=1e-10, atol=1e-12)
    # the same starts (one seed) on per-chain minibatches go elsewhere
    unshared = run(kernel, data)
    assert not torch.allclose(vectorized[:, 1:], unshared[:, 1:])


def test_shared_minibatches_are_refused_with_data_parallel_and_checked(regression):
    with pytest.raises(ValueError, match="distributed='data'"):
        StochasticMCMC(SGLD(regression.model), num_samples=5, num_warmup=5, shared_minibatches=True, distributed="data")
    with pytest.raises((TypeError, ValueError), match="shared_minibatches"):
        StochasticMCMC(SGLD(regression.model), num_samples=5, num_warmup=5, shared_minibatches="yes")


def test_chains_sharing_minibatches_are_calibrated_at_b_10():
    """SGHMC's defaults (step from warm-up, noise corrected) with every chain on the same minibatch, B = 10.

    The chains share their gradient noise, so neither the pooled ESS nor a per-chain one gives the Monte-Carlo
    error of the pooled variance. Its estimate is the mean over steps of s_t = mean over chains of (x_ct - μ)²
    (μ the exact posterior mean): one time series, whose autocorrelation holds both the chains' own and their
    shared fluctuations, so Pyro's single-chain ESS of s_t gives an honest MCSE.
    """
    problem = LinearRegression(num_data=1000, dim=2, batch_size=10)
    mcmc = StochasticMCMC(
        SGHMC(problem.model),
        num_samples=1500,
        num_warmup=300,
        num_chains=32,
        seed=0,
        progress_bar=False,
        shared_minibatches=True,
    )
    mcmc.run(problem.x, problem.y)
    draws = mcmc.get_samples(group_by_chain=True)["w"]  # (chains, draws, 2)
    exact_var = problem.cov.diagonal()
    for i in range(2):
        s = (draws[..., i] - problem.mean[i]).square().mean(0)  # (draws,)
        ess = float(effective_sample_size(s[None, :, None], chain_dim=0, sample_dim=1))
        mcse = float(s.std()) / math.sqrt(ess)
        ratio = math.sqrt(float(s.mean()) / float(exact_var[i]))
        error = 0.5 * mcse / float(exact_var[i])  # delta method: sd = sqrt(variance)
        print(f"coordinate {i}: sd ratio {ratio:.3f} +- {error:.3f} (ESS of s_t {ess:.0f})")
        assert 4 * error < 0.08, f"too few effective draws to resolve 10%: MCSE {error:.3f}"
        assert abs(ratio - 1) < 4 * error + 0.03, (ratio, error)  # 3%: warm-up's step-size bias, as unshared
