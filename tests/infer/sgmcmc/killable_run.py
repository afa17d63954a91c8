"""A small run for tests/infer/sgmcmc/test_checkpoint.py to kill: ``python killable_run.py CHECKPOINT PAUSE``.

``python killable_run.py CHECKPOINT PAUSE NTH MOMENT`` kills itself with SIGKILL during its ``NTH`` checkpoint write
(:func:`tests.infer.killing.arm`).

``PAUSE`` seconds of sleep before each step slow the run down enough for a test to kill it mid-way; the pause
does not change a single number, and lives outside the model (whose code is part of the checkpoint's fingerprint).
"""

from __future__ import annotations

import sys
import time

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from tests.infer import killing

NUM_WARMUP, NUM_SAMPLES = 10, 30


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 2, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0], dtype=torch.float64) + torch.randn(100, generator=g, dtype=torch.float64)
    return x, y


def model(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])


def sampler(checkpoint=None) -> StochasticMCMC:
    return StochasticMCMC(
        SGHMC(model, step_size=1e-3, friction=10.0),
        num_samples=NUM_SAMPLES,
        num_warmup=NUM_WARMUP,
        num_chains=3,
        seed=3,
        progress_bar=False,
        checkpoint=checkpoint,
        checkpoint_every=5,
    )


def slow_down(pause: float) -> None:
    """Sleep ``pause`` seconds before each step."""
    step = ChainStepper.step

    def slow_step(self, batch, step_index):
        time.sleep(pause)
        return step(self, batch, step_index)

    ChainStepper.step = slow_step


if __name__ == "__main__":
    slow_down(float(sys.argv[2]))
    if len(sys.argv) > 3:
        killing.arm(int(sys.argv[3]), sys.argv[4])
    sampler(sys.argv[1]).run(*data())
