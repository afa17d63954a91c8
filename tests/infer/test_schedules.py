"""Step-size and temperature schedules: their values over a run checked before its first step."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import SGHMC, SGLD, Cyclical, PolynomialDecay, StochasticMCMC
from pyro_scalable.infer.schedules import check_schedule


def model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])


def _stepwise(t):
    """A schedule written for one step count at a time (Python control flow): it cannot take a vector."""
    return 1e-3 if int(t) < 30 else -1e-3


@pytest.mark.parametrize(
    "kernel, said",
    [
        (
            lambda: SGLD(model, step_size=lambda t: 1e-3 * (1 - t / 100)),
            r"step_size is a schedule whose value at step 100 is 0",
        ),
        (
            lambda: SGLD(model, step_size=lambda t: torch.where(t < 40, 1e-3, float("nan"))),
            r"step_size is a schedule whose value at step 40 is nan",
        ),
        (lambda: SGLD(model, step_size=_stepwise), r"step_size is a schedule whose value at step 30 is -0\.001"),
        (
            lambda: SGHMC(model, step_size=1e-3, temperature=lambda t: 1.0 - 0.01 * t),
            r"temperature is a schedule whose value at step 101 is -0\.01",
        ),
    ],
)
def test_a_schedule_that_leaves_its_range_is_named_with_the_step_before_the_run(kernel, said):
    # Before, a negative or NaN step size (or a negative temperature) ran, and the warning said "a smaller step_size".
    with pytest.raises(ValueError, match=rf"^{said} \(of the run's 150 steps\); .* must be finite and >=? 0"):
        StochasticMCMC(kernel(), num_samples=100, num_warmup=50, progress_bar=False)


@pytest.mark.parametrize(
    "step_size, temperature",
    [
        (PolynomialDecay(a=1e-3), 1.0),
        (Cyclical(initial=1e-3, cycle_length=20), 0.0),
        (lambda t: 1e-3, lambda t: 0.0 * t),
    ],
)
def test_schedules_that_stay_in_range_run(step_size, temperature):
    y = torch.randn(50, generator=torch.Generator().manual_seed(0))
    kernel = SGLD(model, step_size=step_size, temperature=temperature)
    mcmc = StochasticMCMC(kernel, num_samples=20, num_warmup=10, seed=0, progress_bar=False).run(y)
    assert mcmc.get_samples()["mu"].shape == (20,)


def test_a_schedule_is_read_once_for_the_whole_run_where_it_takes_a_vector():
    calls = []

    def schedule(t):
        calls.append(tuple(t.shape))
        return 1e-3 / (1 + t)

    check_schedule("step_size", schedule, 10_000)
    assert calls == [(10_000,)]
