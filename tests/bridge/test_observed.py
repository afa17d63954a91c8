"""Observed values outside their likelihood's support are refused once, over the full data, naming the index."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge import ModelBridge, ModelError
from pyro_scalable.bridge.observed import check_observed_values, check_site_values

N = 300


def _glm(likelihood):
    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", N, subsample_size=20) as idx:
            pyro.sample("obs", likelihood(x[idx] @ w), obs=y[idx])

    return model


BERNOULLI = _glm(lambda f: dist.Bernoulli(logits=f))
POISSON = _glm(lambda f: dist.Poisson(f.exp()))
CATEGORICAL = _glm(lambda f: dist.Categorical(logits=torch.stack([f, -f, 0 * f], -1)))


@pytest.mark.parametrize(
    "model, values, bad, message",
    [
        (BERNOULLI, torch.bernoulli(torch.full((N,), 0.5)), -1.0, "Bernoulli labels must be 0 or 1"),
        (POISSON, torch.poisson(torch.full((N,), 2.0)), -2.0, "non-negative integers"),
        (POISSON, torch.poisson(torch.full((N,), 2.0)), 1.5, "non-negative integers"),
        (CATEGORICAL, torch.randint(0, 3, (N,)).float(), 3.0, "classes 0, ..., K - 1"),
    ],
    ids=["bernoulli-minus-one", "poisson-negative", "poisson-fraction", "categorical-out-of-range"],
)
def test_a_value_outside_the_support_names_the_site_and_index(model, values, bad, message):
    torch.manual_seed(0)
    x = torch.randn(N, 2)
    assert ModelBridge(model, (x, values)).observed == {"obs": {-1: "data"}}  # the clean data is accepted
    values = values.clone()
    values[N - 7] = bad  # in the last chunk, beyond any first minibatch
    with pytest.raises(ModelError, match=rf"'obs' has the value {bad} at index {N - 7} of plate 'data'.*{message}"):
        ModelBridge(model, (x, values))


def test_checked_in_chunks_across_the_whole_plate():
    x, y = torch.randn(N, 2), torch.bernoulli(torch.full((N,), 0.5))
    bridge = ModelBridge(BERNOULLI, (x, y))
    y[123] = 2.0  # the bridge holds the caller's tensor: a chunk of 50 finds the change in its third chunk
    with pytest.raises(ModelError, match="index 123 of plate 'data'"):
        check_observed_values(bridge, chunk_size=50)


def test_a_bridge_can_leave_the_check_to_a_pass_that_reads_every_chunk_with_the_same_error():
    x, y = torch.randn(N, 2), torch.bernoulli(torch.full((N,), 0.5))
    y[123] = 2.0
    with pytest.raises(ModelError) as full_data:
        ModelBridge(BERNOULLI, (x, y))
    bridge = ModelBridge(BERNOULLI, (x, y), check_values=False)  # built: the caller checks each chunk it reads
    assert not bridge.values_checked and ModelBridge(BERNOULLI, (x, y.clamp(max=1.0))).values_checked
    for start in range(0, N, 50):
        indices = {"data": torch.arange(start, min(start + 50, N))}
        node = bridge.trace_at(indices).nodes["obs"]
        if start != 100:  # the chunks without the bad value pass
            check_site_values("obs", node["fn"], node["value"], bridge.observed["obs"], indices)
            continue
        with pytest.raises(ModelError) as chunk:
            check_site_values("obs", node["fn"], node["value"], bridge.observed["obs"], indices)
        assert str(chunk.value) == str(full_data.value) and "index 123 of plate 'data'" in str(chunk.value)


def test_the_reason_a_mode_search_fails_names_what_fits_the_model():
    from pyro_scalable.bridge.observed import no_mode_reason

    def hierarchy(y):
        scale = pyro.sample("scale", dist.HalfNormal(1.0))
        with pyro.plate("groups", 4):
            z = pyro.sample("z", dist.Normal(0.0, scale))
        with pyro.plate("data", len(y), subsample_size=4) as idx:
            pyro.sample("obs", dist.Normal(z[idx % 4], 1.0), obs=y[idx])

    def regression(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=4) as idx:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])

    y = torch.randn(20, generator=torch.Generator().manual_seed(0))
    grouped = no_mode_reason(ModelBridge(hierarchy, (y,)))
    assert "'z' sit in a plate" in grouped and "non-centre it" in grouped
    assert no_mode_reason(ModelBridge(regression, (y,))).endswith("reparametrise the model")
    assert "scale of 1e+06" in no_mode_reason(ModelBridge(regression, (1e6 * y.sign(),)))
