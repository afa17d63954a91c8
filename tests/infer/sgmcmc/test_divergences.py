"""Diverging chains: marked, rejected, never a non-finite draw; ``on_divergence="stop"``."""

from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import init_to_value

from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC

F64 = torch.float64
M = 50


def unconstrained_scale_model(y):
    """The noise scale has no positivity constraint: a negative scale gives log(negative) = NaN."""
    scale = pyro.sample("scale", dist.Normal(y.new_tensor(3.0), 0.5))
    with pyro.plate("data", y.shape[0], subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(y.new_tensor(0.0), scale), obs=y[idx])


@pytest.fixture
def small_y():
    # sd 0.1: gradient ascent from scale = 1 overshoots below zero on its second step (see the comment below)
    return 0.1 * torch.randn(M, generator=torch.Generator().manual_seed(0), dtype=F64)


def _overshooting_sgld():
    # T = 0 makes the path deterministic: d/ds of the log-likelihood is about -M/s at s = 1, so the first step lands
    # near s = 0.5 and the second, with a gradient about -2M, below zero; the third evaluates log(negative) = NaN.
    init = init_to_value(values={"scale": torch.tensor(1.0, dtype=F64)})
    return SGLD(unconstrained_scale_model, step_size=0.01, temperature=0.0, init_strategy=init)


def test_divergence_is_marked_and_draws_stay_finite(small_y):
    pyro.set_rng_seed(0)
    mcmc = StochasticMCMC(_overshooting_sgld(), num_samples=10, num_chains=2, seed=0, progress_bar=False)
    with pytest.warns(UserWarning, match=r"kept draws and 0 warmup steps diverged"):
        mcmc.run(small_y)
    assert mcmc.num_samples == 10
    diverging = mcmc.sample_stats["diverging"]
    assert diverging.dtype == torch.bool and diverging.shape == (2, 10)
    # steps 2, 4, ... land below zero; each sends the chain back to s = 0.5, from where the next step is fine again
    assert not diverging[:, :2].any() and diverging[:, 2::2].all() and not diverging[:, 3::2].any()
    assert not torch.isfinite(mcmc.sample_stats["lp"][diverging]).any()
    draws = mcmc.get_samples(group_by_chain=True)["scale"]
    assert torch.isfinite(draws).all()
    # a rejected step returns to the last point with a finite density, which is the draw
    assert (draws[:, 2:] == draws[:, 1:2]).all()
    idata = mcmc.to_inference_data(log_likelihood=False)
    np.testing.assert_array_equal(idata.sample_stats["diverging"].values, diverging.numpy())
    assert np.isfinite(idata.posterior["scale"].values).all()


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
def test_on_divergence_stop_keeps_the_draws_taken(small_y, chain_method):
    pyro.set_rng_seed(0)
    mcmc = StochasticMCMC(
        _overshooting_sgld(),
        num_samples=10,
        num_chains=2,
        seed=0,
        chain_method=chain_method,
        on_divergence="stop",
        progress_bar=False,
    )
    with pytest.warns(UserWarning) as record:
        mcmc.run(small_y)
    messages = [str(w.message) for w in record]
    assert any("a chain diverged at step 2" in m and "the run ends with 3 draws per chain" in m for m in messages)
    assert any("2 kept draws and 0 warmup steps diverged" in m for m in messages)
    assert mcmc.num_samples == 3
    draws = mcmc.get_samples(group_by_chain=True)["scale"]
    assert draws.shape == (2, 3) and torch.isfinite(draws).all()
    assert mcmc.sample_stats["diverging"].tolist() == [[False, False, True]] * 2
    idata = mcmc.to_inference_data(log_likelihood=False)
    assert idata.posterior["scale"].shape == (2, 3)


def test_on_divergence_stop_during_warmup_is_an_error(small_y):
    pyro.set_rng_seed(0)
    mcmc = StochasticMCMC(
        _overshooting_sgld(), num_samples=5, num_warmup=10, on_divergence="stop", seed=0, progress_bar=False
    )
    with pytest.warns(UserWarning, match=r"a chain diverged at step 2"):
        with pytest.raises(RuntimeError, match=r"diverged during warmup and on_divergence='stop'; no draw was kept"):
            mcmc.run(small_y)


def normal_mean_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[0], subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])


@pytest.mark.parametrize(
    "kernel",
    [
        lambda: SGLD(normal_mean_model, step_size=10.0),
        lambda: SGHMC(normal_mean_model, step_size=0.99, friction=1.0),
    ],
    ids=["SGLD", "SGHMC"],
)
def test_huge_step_size_never_gives_non_finite_draws(kernel):
    # float32, the default: each step multiplies the distance to the mode by ~ -(step_size * N), until the squared
    # residual overflows; from there every step is rejected and marked
    y = torch.randn(M, generator=torch.Generator().manual_seed(1))
    mcmc = StochasticMCMC(kernel(), num_samples=40, num_chains=2, seed=0, progress_bar=False)
    with pytest.warns(UserWarning, match=r"diverged"):
        mcmc.run(y)
    diverging = mcmc.sample_stats["diverging"]
    assert diverging[:, -1].all() and not diverging[:, 0].any()
    assert torch.isfinite(mcmc.get_samples()["mu"]).all()
    idata = mcmc.to_inference_data(log_likelihood=False)
    assert np.isfinite(idata.posterior["mu"].values).all()
    assert idata.sample_stats["diverging"].values.sum() == int(diverging.sum())


def sqrt_scale_model(y):
    """scale = sqrt(v) with v unconstrained: for v < 0 the log density and its gradient are both NaN."""
    v = pyro.sample("v", dist.Normal(y.new_tensor(3.0), 0.5))
    with pyro.plate("data", y.shape[0], subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(y.new_tensor(0.0), v.sqrt()), obs=y[idx])


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])  # sequential: the CPU path that skips
def test_nan_gradient_is_rejected(small_y, chain_method):  # the rejection when a step is finite
    # the proposal from a point with a NaN gradient is NaN: it must never reach the draws
    init = init_to_value(values={"v": torch.tensor(-0.5, dtype=F64)})
    kernel = SGHMC(sqrt_scale_model, step_size=0.01, friction=10.0, init_strategy=init)
    mcmc = StochasticMCMC(kernel, num_samples=10, num_chains=2, seed=0, progress_bar=False, chain_method=chain_method)
    pyro.set_rng_seed(0)
    with pytest.warns(UserWarning, match=r"20 kept draws and 0 warmup steps diverged"):
        mcmc.run(small_y)
    assert mcmc.sample_stats["diverging"].all()
    assert torch.isnan(mcmc.sample_stats["grad_norm"]).all()
    torch.testing.assert_close(mcmc.get_samples()["v"], torch.full((20,), -0.5, dtype=F64), rtol=0, atol=0)


def test_a_diverged_chain_never_records_a_point_with_non_finite_log_density(small_y):
    pyro.set_rng_seed(0)
    mcmc = StochasticMCMC(_overshooting_sgld(), num_samples=10, seed=0, progress_bar=False)
    with pytest.warns(UserWarning, match=r"diverged"):
        mcmc.run(small_y)
    bridge = mcmc.bridge
    draws = mcmc.get_unconstrained_samples()
    for s in range(mcmc.num_samples):
        point = {k: v[s] for k, v in draws.items()}
        assert torch.isfinite(bridge.log_posterior(point, bridge.full_batch()))
