"""The full-data log-likelihood's chunks: the output's dtype, how many calls of the model, the progress bar."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_scalable.bridge.likelihood as likelihood
from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.likelihood import full_data_log_likelihood

N, B, S = 20_000, 100, 64


def model(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=B) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


@pytest.fixture(scope="module")
def bridge():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 2, generator=g)
    return ModelBridge(model, (x, torch.bernoulli(torch.sigmoid(x[:, 0]), generator=g)))


def draws():
    return {"w": torch.randn(S, 2, generator=torch.Generator().manual_seed(1))}


def test_the_output_is_written_in_the_dtype_asked_for_from_the_models_float32_values(bridge):
    plain = full_data_log_likelihood(bridge, draws())["obs"]
    wide = full_data_log_likelihood(bridge, draws(), out_dtype=torch.float64)["obs"]
    assert plain.dtype == torch.float32 and wide.dtype == torch.float64
    assert torch.equal(wide, plain.double())  # the model ran in float32; only the output is wider


def test_default_chunks_hold_about_a_million_values_not_one_minibatch_each(bridge, monkeypatch):
    calls = []
    pointwise = likelihood._pointwise
    monkeypatch.setattr(likelihood, "_pointwise", lambda *a: calls.append(None) or pointwise(*a))
    full_data_log_likelihood(bridge, draws())
    assert len(calls) == -(-N // (likelihood.CHUNK_VALUES // S))  # 2 chunks of 16,384 points, not 20 of 1,024


def test_a_large_output_shows_a_progress_bar_with_its_size(bridge, monkeypatch, capsys):
    full_data_log_likelihood(bridge, draws())
    assert "log-likelihood" not in capsys.readouterr().err
    monkeypatch.setattr(likelihood, "PROGRESS_VALUES", S * N)
    full_data_log_likelihood(bridge, draws(), out_dtype=torch.float64)
    assert "log-likelihood (0.0 GB per site)" in capsys.readouterr().err
