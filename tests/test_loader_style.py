"""Minibatches from a DataLoader (``pyro.plate(..., subsample=idx)``), and diverging chains (DESIGN.md §1, §6)."""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import init_to_value
from torch.utils.data import DataLoader, TensorDataset

from pyro_scalable.bridge import Batch
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning)
    import arviz as az

N, B, D = 60, 16, 2  # 60 = 3 * 16 + 12: the loader's last minibatch is short
F64 = torch.float64


def model(x, y, idx=None):
    """The DataLoader style: the caller hands over a minibatch and its indices; the plate scales by N / len(idx)."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(1.0)))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", dist.Normal((x * w.unsqueeze(-2)).sum(-1), sigma), obs=y)


def _init():
    # sigma = 1 keeps the first steps well inside the region where the gradient is moderate
    return init_to_value(values={"sigma": torch.tensor(1.0, dtype=F64)})


def _sgld():
    return SGLD(model, step_size=1e-3, init_strategy=_init())


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -0.5], dtype=F64) + 0.5 * torch.randn(N, generator=g, dtype=F64)
    return x, y


def _loader(x, y, seed=0):
    dataset = TensorDataset(x, y, torch.arange(N))
    return DataLoader(dataset, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(seed))


class _Recorder:
    """Wraps a loader and remembers every minibatch index set it hands out."""

    def __init__(self, loader):
        self.loader = loader
        self.seen: list[torch.Tensor] = []

    def __iter__(self):
        for x_b, y_b, idx_b in self.loader:
            self.seen.append(idx_b)
            yield x_b, y_b, idx_b


@pytest.mark.parametrize("kernel", ["SGLD", "SGHMC"])
def test_loader_run_and_full_data_inference_data(data, kernel):
    x, y = data
    engine = _sgld() if kernel == "SGLD" else SGHMC(model, step_size=0.005, friction=20.0, init_strategy=_init())
    loader = _Recorder(_loader(x, y))
    mcmc = StochasticMCMC(engine, num_samples=30, num_warmup=30, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(x, y, batches=loader)

    # the loader was cycled through several epochs, short last minibatch included
    assert len(loader.seen) >= 60
    assert {len(idx) for idx in loader.seen} == {B, N - 3 * B}
    samples = mcmc.get_samples(group_by_chain=True)
    assert samples["w"].shape == (2, 30, D) and samples["sigma"].shape == (2, 30)
    assert torch.isfinite(samples["w"]).all() and (samples["sigma"] > 0).all()
    assert not mcmc.sample_stats["diverging"].any()
    assert not torch.equal(samples["w"][0], samples["w"][1])  # the chains are independent

    idata = mcmc.to_inference_data()
    assert idata.log_likelihood["obs"].shape == (2, 30, N)
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "data")
    assert idata.observed_data["obs"].shape == (N,)
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y.numpy())
    chain, draw = 1, 29
    w = torch.from_numpy(idata.posterior["w"].values[chain, draw])
    sigma = torch.tensor(idata.posterior["sigma"].values[chain, draw])
    expected = torch.distributions.Normal(x @ w, sigma).log_prob(y).numpy()
    np.testing.assert_allclose(idata.log_likelihood["obs"].values[chain, draw], expected, rtol=1e-10, atol=1e-12)

    from_pyro = az.from_pyro(mcmc)
    assert from_pyro.log_likelihood["obs"].shape == (2, 30, N)
    np.testing.assert_allclose(
        from_pyro.log_likelihood["obs"].values, idata.log_likelihood["obs"].values, rtol=1e-10, atol=1e-12
    )
    assert from_pyro.observed_data["obs"].shape == (N,)


def test_loader_log_posterior_is_scaled_by_the_plate(data):
    # Over one epoch of the loader, the N/len(idx)-weighted minibatch estimates average (by the minibatch share of
    # the data) to the full-data log joint: the plate does the scaling, short last minibatch included.
    x, y = data
    mcmc = StochasticMCMC(_sgld(), num_samples=1, progress_bar=False, seed=0)
    mcmc.run(x, y, batches=_loader(x, y))
    latents = {k: v[0, 0] for k, v in mcmc.get_unconstrained_samples(group_by_chain=True).items()}
    full = mcmc._full_bridge.log_posterior(latents, mcmc._full_bridge.full_batch())
    total = 0.0
    for x_b, y_b, idx_b in _loader(x, y, seed=3):
        total = total + len(idx_b) / N * mcmc.bridge.log_posterior(latents, Batch({}, (x_b, y_b, idx_b), {}))
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-10)


def test_loader_only_has_no_log_likelihood(data):
    x, y = data
    mcmc = StochasticMCMC(_sgld(), num_samples=5, progress_bar=False, seed=0)
    mcmc.run(batches=_loader(x, y))
    assert mcmc.get_samples()["w"].shape == (5, D)
    with pytest.warns(UserWarning, match=r"no full data was passed to run\(\)"):
        idata = mcmc.to_inference_data()
    assert "log_likelihood" not in idata.groups() and "posterior" in idata.groups()


def test_loader_yielding_dicts(data):
    x, y = data
    batches = [{"x": x[i : i + B], "y": y[i : i + B], "idx": torch.arange(i, min(i + B, N))} for i in range(0, N, B)]
    mcmc = StochasticMCMC(_sgld(), num_samples=8, progress_bar=False, seed=0)
    mcmc.run(x=x, y=y, batches=batches)
    assert mcmc.to_inference_data().log_likelihood["obs"].shape == (1, 8, N)


def test_empty_loader_is_an_error(data):
    mcmc = StochasticMCMC(_sgld(), num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match=r"batches is empty"):
        mcmc.run(*data, batches=[])


# ---------------------------------------------------------------------------------------------------- divergences

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


def test_nan_gradient_is_rejected(small_y):
    # the proposal from a point with a NaN gradient is NaN: it must never reach the draws
    init = init_to_value(values={"v": torch.tensor(-0.5, dtype=F64)})
    kernel = SGHMC(sqrt_scale_model, step_size=0.01, friction=10.0, init_strategy=init)
    mcmc = StochasticMCMC(kernel, num_samples=10, num_chains=2, seed=0, progress_bar=False)
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
