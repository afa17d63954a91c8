"""The chain stepper's batched gradient: all chains' gradients in one backward pass equal each chain's own."""

from __future__ import annotations

from unittest import mock

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.func import grad_and_value

from pyro_scalable.bridge import Batch, ModelBridge
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC
from pyro_scalable.infer.gradients import chains_gradient, estimator, evaluate
from pyro_scalable.infer.gradients.estimate import chain_indices
from pyro_scalable.infer.sgmcmc import chains


def scaled_regression(x, y):
    """Two sites, one of them a constrained scalar, and a subsampled plate: float32, as users write it."""
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", len(y), subsample_size=8) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, sigma), obs=y[idx])


@pytest.fixture
def bridge():
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 * torch.randn(40, generator=torch.Generator().manual_seed(1))
    return ModelBridge(scaled_regression, (x, y))


@pytest.mark.parametrize("shared", [False, True])
def test_all_chains_in_one_backward_pass_equal_each_chains_own_gradient(bridge, shared):
    num_chains = 4
    latents = bridge.init_latents(num_chains, seed=3)
    sampler = EpochSampler(bridge.plates, num_chains, torch.Generator().manual_seed(2), bridge.device, shared=shared)
    batch = Batch(next(sampler), bridge.args, bridge.kwargs)
    fn = bridge.log_posterior_fn
    batched = chains_gradient(fn, latents, batch)
    for c in range(num_chains):
        one = {name: x[c] for name, x in latents.items()}
        gold_grads, gold_value = grad_and_value(fn)(one, Batch(chain_indices(batch.indices, c), *batch[1:]))
        torch.testing.assert_close(batched.log_posterior[c], gold_value)
        for name in one:
            torch.testing.assert_close(batched.grads[name][c], gold_grads[name])
        grads, _, norm, diverging = evaluate(fn, one, Batch(chain_indices(batch.indices, c), *batch[1:]))
        torch.testing.assert_close(batched.grad_norm[c], norm)
        assert not bool(batched.diverging[c]) and not bool(diverging)
    assert batched.grads["sigma"].shape == (num_chains,) and batched.noise_variance == {}


def test_a_chain_with_a_non_finite_density_is_flagged_and_leaves_the_others_alone(bridge):
    latents = bridge.init_latents(3, seed=3)
    latents["w"][1, 0] = float("nan")
    sampler = EpochSampler(bridge.plates, 3, torch.Generator().manual_seed(2), bridge.device)
    batch = Batch(next(sampler), bridge.args, bridge.kwargs)
    batched = chains_gradient(bridge.log_posterior_fn, latents, batch)
    assert batched.diverging.tolist() == [False, True, False]
    for c in (0, 2):
        assert all(bool(torch.isfinite(g[c]).all()) for g in batched.grads.values())


@pytest.mark.filterwarnings("ignore:in .* of the coordinates of the kept steps")  # a few steps from the start
@pytest.mark.parametrize(
    ("kernel", "measured"),
    [
        (lambda m: SGHMC(m, step_size=1e-3), 0),  # a hand-set step ignores the gradient noise: plain gradient
        # the noise on every 4th step, steps 0, 4, ..., 24: the plain gradient on the others
        (lambda m: SGLD(m, step_size=1e-4, gradient_noise="correct"), 7),
        # warm-up measures the noise and the curvature on burn-in's steps 0, 4, 8 and the noise on every calibrated
        # step (10 to 19); sampling (steps 20 to 24) as SGLD's
        (lambda m: SGHMC(m), 3 + 10 + 2),
    ],
)
def test_the_stepper_estimates_every_chain_at_once_on_every_eager_step(bridge, kernel, measured, monkeypatch):
    """Noise and curvature included: no step vmaps a gradient transform over the chains."""
    spy = mock.Mock(wraps=estimator.chains_estimate)
    monkeypatch.setattr(chains.ChainStepper, "_vstep", mock.Mock(side_effect=AssertionError("a vmapped step")))
    mcmc = StochasticMCMC(kernel(scaled_regression), num_samples=5, num_warmup=20, num_chains=3, progress_bar=False)
    with mock.patch.object(estimator, "chains_estimate", spy):  # an estimator's every_chain
        mcmc.run(*bridge.args)
    assert spy.call_count == 25
    assert sum(call.kwargs["noise"] for call in spy.call_args_list) == measured
    assert all(bool(torch.isfinite(x).all()) for x in mcmc.get_samples().values())
