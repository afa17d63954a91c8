"""The per-example split behind the gradient-noise estimate, and where it cannot be made."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pyro_scalable.bridge import Batch, ModelBridge, ModelError
from pyro_scalable.bridge.traced import TRACE_AFTER
from pyro_scalable.infer import SGLD, StochasticMCMC

N, B = 50, 10


def loader_model(x, y, idx=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", dist.Normal(w * x, 1.0), obs=y)


def test_a_caller_indexed_plate_cannot_be_split_and_says_so():
    x, y = torch.randn(N), torch.randn(N)
    bridge = ModelBridge(loader_model, (x[:B], y[:B], torch.arange(B)))
    assert bridge.plates == {} and bridge.given_plates == {"data": N}
    with pytest.raises(ModelError, match="plate 'data' takes its minibatch from the model's arguments"):
        bridge.log_posterior_fn.examples(Batch({}, bridge.args, bridge.kwargs))


def test_a_noise_correcting_kernel_fed_by_a_dataloader_raises_instead_of_skipping_the_correction():
    """It used to read the gradient as exact: noise_ratio 0, a 10x larger step, draws 2.2x too wide, no word."""
    x, y = torch.randn(N), torch.randn(N)
    loader = DataLoader(TensorDataset(x, y, torch.arange(N)), batch_size=B, shuffle=True)
    mcmc = StochasticMCMC(SGLD(loader_model), num_samples=5, num_warmup=5, progress_bar=False, seed=0)
    with pytest.raises(ModelError, match="subsample_size=B"):
        mcmc.run(x, y, batches=loader)


def hierarchy(x, y):
    """A group scale (log-transformed, with its Jacobian), weights below it, a Student-t likelihood: float64."""
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), tau).to_event(1))
    with pyro.plate("data", len(y), subsample_size=B) as idx:
        pyro.sample("obs", dist.StudentT(4.0, x[idx] @ w, 0.5), obs=y[idx])


def test_the_prior_and_data_terms_sum_to_the_log_posterior_through_pyro_and_the_recorded_graph():
    """The noise estimate evaluates the prior's terms once and the data's per group: each is its own closed form."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = torch.randn(N, generator=g, dtype=torch.float64)
    bridge = ModelBridge(hierarchy, (x, y))
    for call in range(TRACE_AFTER + 2):  # the Pyro path, then the recorded graphs
        u = torch.tensor(0.1 * call - 0.3, dtype=torch.float64)
        w = torch.tensor([0.2, -0.1 * call], dtype=torch.float64)
        idx = torch.randperm(N, generator=g)[:B]
        batch = Batch({"data": idx}, bridge.args, {})
        prior = bridge.log_posterior_part("prior", {"tau": u, "w": w}, batch)
        data = bridge.log_posterior_part("data", {"tau": u, "w": w}, batch)
        tau = u.exp()
        expected_prior = (
            dist.HalfNormal(torch.ones((), dtype=torch.float64)).log_prob(tau)
            + u
            + dist.Normal(0.0, tau).log_prob(w).sum()
        )
        expected_data = N / B * dist.StudentT(4.0, x[idx] @ w, 0.5).log_prob(y[idx]).sum()
        torch.testing.assert_close(prior, expected_prior, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(data, expected_data, rtol=1e-12, atol=1e-9)
        total = bridge.log_posterior({"tau": u, "w": w}, batch)
        torch.testing.assert_close(prior + data, total, rtol=1e-12, atol=1e-9)
    assert [len(tracer.graphs) for tracer in bridge.tracers] == [1, 1, 1], [t.refused for t in bridge.tracers]
