"""Shared fixtures: devices (CUDA when present), float64 helpers and a conjugate Bayesian linear regression."""

from __future__ import annotations

import os

import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import HealthCheck, settings

# Property-based tests (tests/bridge/test_properties.py, tests/test_inference_data_properties.py): "ci" keeps
# them fast on a shared 2-core machine; HYPOTHESIS_PROFILE=dev explores many more examples. No deadline: the first
# example of a test pays for Pyro's and torch's warm-up.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    # hypothesis, reporting a falsifying example, touches mypy_extensions.TypedDict (deprecated): with warnings as
    # errors that would hide the example behind an INTERNALERROR
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _clear_param_store():
    pyro.clear_param_store()
    yield


class LinearRegression:
    """y = X w + noise, w ~ N(0, prior_scale^2 I), known noise scale: the posterior is Gaussian in closed form."""

    def __init__(
        self,
        num_data=1000,
        dim=2,
        batch_size=100,
        noise_scale=1.0,
        prior_scale=1.0,
        seed=0,
        dtype=torch.float64,
        device="cpu",
    ):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_data, dim, generator=g, dtype=dtype).to(device)
        w = torch.randn(dim, generator=g, dtype=dtype).to(device)
        self.y = self.x @ w + noise_scale * torch.randn(num_data, generator=g, dtype=dtype).to(device)
        self.noise_scale, self.prior_scale, self.batch_size = noise_scale, prior_scale, batch_size
        precision = self.x.T @ self.x / noise_scale**2 + torch.eye(dim, dtype=dtype, device=device) / prior_scale**2
        self.cov = torch.linalg.inv(precision)
        self.mean = self.cov @ (self.x.T @ self.y) / noise_scale**2

    def model(self, x, y):
        zeros = x.new_zeros(x.shape[-1])
        w = pyro.sample("w", dist.Normal(zeros, self.prior_scale).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=self.batch_size) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, self.noise_scale), obs=None if y is None else y[idx])


@pytest.fixture
def regression() -> LinearRegression:
    return LinearRegression()
