"""The per-example split behind the gradient-noise estimate, and where it cannot be made."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pyro_scalable.bridge import Batch, ModelBridge, ModelError
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
