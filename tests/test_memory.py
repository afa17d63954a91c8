"""Allocations of one value per draw and data point are refused before they run out of memory, never a dead process.

The memory available is set small by replacing what ``/proc/meminfo`` says (``_meminfo_available``): the check,
the message and the conversion after it are the library's own.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable import memory, to_inference_data
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.plates import FullDataModel
from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.inference_data import LOO_COPIES
from pyro_scalable.memory import MemoryLimitError, MemoryLimitWarning, available_memory, check_memory
from tests.arviz_compat import group_names

pytestmark = pytest.mark.arviz  # converts to ArviZ: run against both majors by scripts/test.sh

N, NUM_CHAINS, NUM_SAMPLES = 200, 2, 50
LOG_LIKELIHOOD = NUM_CHAINS * NUM_SAMPLES * N * 8  # 160 kB in float64


def model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x), subsample_size=20) as idx:
        pyro.sample("obs", dist.Normal(w * x[idx], 1.0), obs=None if y is None else y[idx])


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g, dtype=torch.float64)
    return x, 0.5 * x + torch.randn(N, generator=g, dtype=torch.float64)


@pytest.fixture(scope="module")
def run(data):
    sampler = StochasticMCMC(
        SGHMC(model, step_size=0.01), num_samples=NUM_SAMPLES, num_warmup=20, num_chains=NUM_CHAINS, seed=0
    )
    sampler.progress_bar = False
    return sampler.run(*data)


def available(monkeypatch, num_bytes: int | None) -> None:
    """The machine has ``num_bytes`` available, as /proc/meminfo would say, and no cgroup limit."""
    monkeypatch.setattr(memory, "_meminfo_available", lambda: num_bytes)
    monkeypatch.setattr(memory, "_cgroup_available", lambda: None)


def test_available_memory_is_read_from_the_system():
    free = available_memory("cpu")
    assert isinstance(free, int) and 0 < free
    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text().splitlines() if meminfo.exists() else []
    total = next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemTotal")), None)
    assert total is None or free <= total
    assert available_memory("meta") is None  # unknown: nothing is refused
    check_memory(10**30, "meta", "anything")


def test_a_cgroup_limit_lowers_what_is_available(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 10**10)
    monkeypatch.setattr(memory, "_cgroup_available", lambda: 10**6)
    assert available_memory() == 10**6


def test_the_log_likelihood_is_refused_with_the_figures_and_what_works(run, monkeypatch):
    before = {k: v.clone() for k, v in run.get_unconstrained_samples(group_by_chain=True).items()}
    available(monkeypatch, 100_000)  # a limit of 50 kB for a 160 kB group: refused, thin=4 fits
    with pytest.raises(MemoryLimitError) as refused:
        run.to_inference_data()
    message = str(refused.value)
    assert message.startswith(
        f"the log_likelihood group ({NUM_CHAINS} chains × {NUM_SAMPLES} draws × {N} points, float64) would need "
        "160.0 kB, more than 50% of the 100.0 kB of memory available"
    )
    for remedy in (
        "thin=4 keeps every 4th draw of each chain (40.0 kB",
        "a subset of the data as args=(...)",
        "log_likelihood_dtype=torch.float32 halves it",
        "log_likelihood=False leaves the group out",
        "pyro_scalable.loo.streaming_loo(source, ...)",
    ):
        assert remedy in message, remedy
    assert isinstance(refused.value, MemoryError)
    # nothing computed is lost: the run's draws are those it had, and every remedy converts
    for name, value in run.get_unconstrained_samples(group_by_chain=True).items():
        assert torch.equal(value, before[name])
    assert "log_likelihood" not in group_names(run.to_inference_data(log_likelihood=False))
    with pytest.warns(MemoryLimitWarning, match=rf"az.loo on it needs about {LOO_COPIES} times that again"):
        thinned = run.to_inference_data(thin=4)
    assert thinned["log_likelihood"]["obs"].shape == (NUM_CHAINS, NUM_SAMPLES // 4 + 1, N)
    assert thinned["sample_stats"]["lp"].shape == (NUM_CHAINS, NUM_SAMPLES // 4 + 1)
    assert (thinned["posterior"]["w"].values == run.get_samples(group_by_chain=True)["w"][:, ::4].numpy()).all()
    with pytest.warns(MemoryLimitWarning):
        single = run.to_inference_data(thin=2, log_likelihood_dtype=torch.float32)
    assert str(single["log_likelihood"]["obs"].dtype) == "float32"


def test_no_warning_where_az_loo_fits(run, monkeypatch):
    available(monkeypatch, 2 * (1 + LOO_COPIES) * LOG_LIKELIHOOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLimitWarning)
        run.to_inference_data()


def test_the_limit_is_a_documented_fraction_that_can_be_raised(run, monkeypatch):
    available(monkeypatch, LOG_LIKELIHOOD + 1000)
    with pytest.raises(MemoryLimitError, match=r"more than 50% of the 161.0 kB"):
        run.to_inference_data()
    monkeypatch.setattr(memory, "MEMORY_FRACTION", 1.0)
    with pytest.warns(MemoryLimitWarning):
        run.to_inference_data()


def test_posterior_predictive_draws_are_refused(run, monkeypatch):
    available(monkeypatch, 100_000)
    with pytest.raises(MemoryLimitError, match=r"the posterior_predictive group \(2 chains × 50 draws of obs\)"):
        run.to_inference_data(log_likelihood=False, posterior_predictive=True)
    with pytest.raises(MemoryLimitError, match=r"100 predictive draws of obs \(200 values each\) would need 160.0 kB"):
        run.posterior_predictive()
    with pytest.raises(MemoryLimitError, match=r"get_samples\(num_samples=25\)"):
        run.posterior_predictive()
    with pytest.raises(MemoryLimitError, match=r"the predictive laws of 100 draws \(200 values each\)"):
        run.uncertainty()


def test_prior_draws_are_refused(run, monkeypatch):
    available(monkeypatch, 100_000)
    with pytest.raises(MemoryLimitError, match=r"the prior and prior_predictive groups \(1000 draws of w, obs\)"):
        run.to_inference_data(log_likelihood=False, prior=1000)


class Gaussian:
    """A posterior that draws on request (the GaussianSource protocol), and must not be asked for a draw here."""

    num_chains = 1

    def __init__(self, bridge):
        self.bridge = bridge

    def get_samples(self, num_samples=None, group_by_chain=False, seed=None):
        raise AssertionError("drawn before the memory was checked")


def test_draws_of_a_gaussian_posterior_are_refused_before_they_are_drawn(data, monkeypatch):
    def wide(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(1000, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(x * w[0], 1.0), obs=y)

    available(monkeypatch, 10**6)
    bridge = ModelBridge(FullDataModel(wide), data, {})
    with pytest.raises(MemoryLimitError, match=re.escape("1000 draws of the posterior's 1,000 latent values")):
        to_inference_data(Gaussian(bridge), num_samples=1000)


@pytest.mark.cuda
def test_a_gpu_allocation_is_checked_against_the_gpu_memory():
    free, total = torch.cuda.mem_get_info()
    assert free <= available_memory("cuda") <= total
    with pytest.raises(MemoryLimitError, match=r"more than 50% of the .* of memory available on cuda"):
        check_memory(2 * total, "cuda", "twice the GPU's memory")
