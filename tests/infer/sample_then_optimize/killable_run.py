"""A small sample-then-optimise run for test_checkpoint.py to kill with a real SIGKILL in a checkpoint write.

``python killable_run.py CHECKPOINT NTH MOMENT`` dies during its ``NTH`` checkpoint write
(:func:`tests.infer.killing.arm`); one checkpoint is written per epoch, 3 + 2 + 2 epochs in all.
"""

from __future__ import annotations

import sys

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import SampleThenOptimize
from tests.infer import killing


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + torch.randn(200, generator=g, dtype=torch.float64)
    return x, y


def model(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=50) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])


def engine(checkpoint=None, model=model) -> SampleThenOptimize:
    return SampleThenOptimize(
        model, num_samples=4, num_epochs=3, em_steps=2, em_epochs=2, seed=1, progress_bar=False, checkpoint=checkpoint
    )


if __name__ == "__main__":
    killing.arm(int(sys.argv[2]), sys.argv[3])
    engine(sys.argv[1]).run(*data())
