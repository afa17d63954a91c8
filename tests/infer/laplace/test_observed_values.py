"""The Laplace fit checks the observed values' support chunk by chunk, inside the one pass that reads every chunk."""

from __future__ import annotations

import pytest
import torch

import pyro_scalable.bridge.model as bridge_model
from pyro_scalable.bridge import ModelError
from pyro_scalable.infer import AutoLinearizedLaplace
from tests.infer.linearized.nets import MLP, random_latents

N, CHUNK = 120, 16
BAD_AT = N - 7  # in the last chunk: the pass has accumulated the earlier chunks when it reaches it


def _problem(likelihood: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    if likelihood == "categorical":
        return MLP((3, 4, 3), "categorical", batch_size=CHUNK), x, torch.randint(0, 3, (N,), generator=g)
    y = (
        torch.bernoulli(torch.full((N,), 0.5), generator=g)
        if likelihood == "bernoulli"
        else torch.poisson(torch.full((N,), 2.0), generator=g)
    )
    return MLP((3, 4, 1), likelihood, batch_size=CHUNK), x, y.double()


def _fit(model, x, y, structure):
    return AutoLinearizedLaplace(model).laplace_approximation(
        x,
        y,
        structure=structure,
        map_latents=random_latents(model, x),
        check_map=False,
        chunk_size=CHUNK,
        rank=4,
        num_samples=2,
        sampler_options={"num_epochs": 1},
    )


# Without a check these fail otherwise: Bernoulli -1 and Poisson 1.5 give a finite, meaningless log-likelihood (no
# error at all), a Categorical class 3 of 3 an index error from the likelihood's gather.
@pytest.mark.parametrize(
    "likelihood, bad, message",
    [
        ("bernoulli", -1.0, "Bernoulli labels must be 0 or 1"),
        ("poisson", 1.5, "non-negative integers"),
        ("categorical", 3, "classes 0, ..., K - 1"),
    ],
)
@pytest.mark.parametrize("structure", ["diag", "kron", "full", "low_rank", "sampled"])
def test_a_value_outside_the_support_in_a_later_chunk_raises_the_bridges_error(likelihood, bad, message, structure):
    model, x, y = _problem(likelihood)
    y[BAD_AT] = bad
    with pytest.raises(ModelError, match=rf"'y' has the value {bad} at index {BAD_AT} of plate 'data'.*{message}"):
        _fit(model, x, y, structure)


@pytest.mark.parametrize("structure", ["diag", "kron", "full", "low_rank"])
def test_a_structure_fitted_by_the_pass_does_not_walk_the_data_a_second_time_for_the_check(structure, monkeypatch):
    model, x, y = _problem("categorical")
    expected = _fit(model, x, y, structure).log_marginal_likelihood()

    def walks_the_data(bridge, chunk_size=None):
        raise AssertionError("the bridge's full-data check ran on a Laplace fit that reads every chunk itself")

    monkeypatch.setattr(bridge_model, "check_observed_values", walks_the_data)
    torch.testing.assert_close(_fit(model, x, y, structure).log_marginal_likelihood(), expected, rtol=0, atol=0)
