"""Minibatches from a DataLoader: ``pyro.plate(..., subsample=idx)`` fed by ``run(batches=loader)``."""

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
from pyro_scalable.inference_data import ARVIZ_MAJOR

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


@pytest.mark.arviz
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

    if ARVIZ_MAJOR == 0:  # arviz 1.x has no from_pyro
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
    full = mcmc.results.full_bridge.log_posterior(latents, mcmc.results.full_bridge.full_batch())
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
