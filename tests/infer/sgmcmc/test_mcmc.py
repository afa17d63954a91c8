"""The driver: exact equivalences (T = 0 is SGD through the Pyro bridge; vmap = loop), seeds, shapes, fallback."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_median, init_to_uniform

from pyro_scalable.bridge import Batch, ModelBridge
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC

from ...conftest import LinearRegression


def run(kernel, data, **kwargs):
    options = dict(num_samples=30, num_warmup=10, num_chains=3, seed=1, progress_bar=False)
    options.update(kwargs)
    mcmc = StochasticMCMC(kernel, **options)
    mcmc.run(*data)
    return mcmc


def test_zero_temperature_sgld_is_torch_sgd_on_the_pyro_model(regression):
    lr, seed, steps = 1e-4, 7, 25
    mcmc = run(
        SGLD(regression.model, step_size=lr, temperature=0.0),
        (regression.x, regression.y),
        num_samples=steps,
        num_warmup=0,
        num_chains=1,
        seed=seed,
    )
    bridge = ModelBridge(regression.model, (regression.x, regression.y))
    param = bridge.init_latents(1, init_to_uniform, seed=seed)["w"][0].clone().requires_grad_()
    sampler = EpochSampler(bridge.plates, 1, torch.Generator().manual_seed(seed), bridge.device)
    opt = torch.optim.SGD([param], lr=lr)
    draws = mcmc.get_samples()["w"]
    for t in range(steps):
        # draw t is the point whose gradient step t evaluated: SGD's parameter after t steps
        torch.testing.assert_close(draws[t], param.detach(), rtol=1e-12, atol=1e-12)
        indices = {k: v[0] for k, v in next(sampler).items()}
        opt.zero_grad()
        (-bridge.log_posterior({"w": param}, Batch(indices, bridge.args, bridge.kwargs))).backward()
        opt.step()


@pytest.mark.parametrize("kernel_cls", [SGLD, SGHMC])
def test_vectorized_chains_equal_a_loop(regression, kernel_cls):
    kernel = kernel_cls(regression.model, step_size=1e-3, temperature=0.0)
    data = (regression.x, regression.y)
    vectorized = run(kernel, data, chain_method="vectorized").get_samples(group_by_chain=True)["w"]
    sequential = run(kernel, data, chain_method="sequential").get_samples(group_by_chain=True)["w"]
    torch.testing.assert_close(vectorized, sequential, rtol=1e-10, atol=1e-12)


def test_seed_reproduces_and_chains_differ(regression):
    kernel = SGLD(regression.model, step_size=1e-4)
    data = (regression.x, regression.y)
    first = run(kernel, data).get_samples(group_by_chain=True)["w"]
    again = run(kernel, data).get_samples(group_by_chain=True)["w"]
    other = run(kernel, data, seed=2).get_samples(group_by_chain=True)["w"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.allclose(first[0], first[1])


def test_shapes_thinning_and_stats(regression):
    mcmc = run(
        SGHMC(regression.model, step_size=1e-3, friction=10.0),
        (regression.x, regression.y),
        num_samples=7,
        num_warmup=3,
        thin=3,
        num_chains=2,
    )
    assert mcmc.get_samples(group_by_chain=True)["w"].shape == (2, 7, 2)
    assert mcmc.get_samples()["w"].shape == (14, 2)
    stats = mcmc.sample_stats
    # noise_ratio and uncorrected are dropped: the noise was not estimated (gradient_noise="ignore")
    assert set(stats) == {
        "lp",
        "grad_norm",
        "step_size",
        "temperature",
        "diverging",
        "friction",
        "repeated",
        "warmup_divergences",
        "restarted",
    }
    assert all(v.shape == (2, 7) for v in stats.values())
    assert stats["diverging"].dtype == torch.bool
    assert mcmc.get_samples()["w"].device.type == "cpu"


def test_constrained_sites_are_returned_constrained():
    y = torch.randn(200, dtype=torch.float64) * 2.0

    def model(y):
        scale = pyro.sample("scale", dist.HalfNormal(torch.tensor(5.0, dtype=torch.float64)))
        with pyro.plate("data", len(y), subsample_size=50) as idx:
            pyro.sample("obs", dist.Normal(0.0, scale), obs=y[idx])

    mcmc = run(SGLD(model, step_size=1e-4, init_strategy=init_to_median), (y,), num_samples=50)
    assert bool((mcmc.get_samples()["scale"] > 0).all())
    unconstrained = mcmc.get_unconstrained_samples()["scale"]
    torch.testing.assert_close(unconstrained.exp(), mcmc.get_samples()["scale"])


def test_sequential_fallback_warns_once_and_runs():
    y = torch.randn(100) + 1.0

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        if bool(mu.detach() > 1e6):  # data-dependent Python control flow: vmap cannot batch this
            raise AssertionError
        with pyro.plate("data", len(y), subsample_size=20) as idx:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])

    mcmc = StochasticMCMC(SGLD(model, step_size=1e-3), num_samples=10, num_chains=2, seed=0, progress_bar=False)
    with pytest.warns(UserWarning, match="chains run one after another"):
        mcmc.run(y)
    assert mcmc.get_samples(group_by_chain=True)["mu"].shape == (2, 10)


def test_full_data_model_for_predictive(regression):
    mcmc = run(SGLD(regression.model, step_size=1e-4), (regression.x, regression.y))
    predictive = pyro.infer.Predictive(mcmc.kernel.model, mcmc.get_samples(), return_sites=["obs"])
    assert predictive(regression.x, None)["obs"].shape == (90, len(regression.y))


def test_results_before_run_raise():
    mcmc = StochasticMCMC(SGLD(lambda: None, step_size=0.1), num_samples=1)
    with pytest.raises(RuntimeError, match="run"):
        mcmc.get_samples()


@pytest.mark.parametrize("kernel_cls", [SGLD, SGHMC])
def test_runs_on_the_data_device(kernel_cls, device):
    problem = LinearRegression(device=device, dtype=torch.float32)
    mcmc = run(kernel_cls(problem.model, step_size=1e-3), (problem.x, problem.y))
    assert mcmc.bridge.device.type == device.type
    assert mcmc.get_samples()["w"].device.type == "cpu"
    assert torch.isfinite(mcmc.get_samples()["w"]).all()


def test_warnings_from_inside_a_run_point_at_the_users_call():
    """However many of the package's frames lie between (the driver's phases, the stepper), the user's line."""
    problem = LinearRegression(num_data=100, dim=2, batch_size=10)
    mcmc = StochasticMCMC(SGLD(problem.model, step_size=1e-3), num_samples=20, num_warmup=0, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(problem.x, problem.y)
    assert caught, "a 20-draw run should warn about its health"
    assert {w.filename for w in caught} == {__file__}


def test_an_adapting_kernel_without_warmup_is_refused_with_the_reason():
    """The default kernel learns its step in warm-up: a run without one says so instead of sampling blind."""

    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="learns its step size .* num_warmup=0: give num_warmup"):
        StochasticMCMC(SGHMC(model), num_samples=7)
