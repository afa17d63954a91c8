"""The rows' groups read from a multilevel model: exactly the index the model uses, or a refusal that says why."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.row_groups import group_plates, row_groups


def unequal_groups(num_groups: int, num_rows: int, seed: int = 0) -> torch.Tensor:
    """Each row's group, of sizes from 1 to many (Zipf-like), shuffled so that no group's rows are contiguous."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_groups + 1, dtype=torch.float64) ** 1.1
    group = torch.multinomial(weights, num_rows - num_groups, replacement=True, generator=g)
    group = torch.cat([torch.arange(num_groups), group])  # every group has a row
    return group[torch.randperm(num_rows, generator=g)]


def varying_slopes(x, g, y, num_groups, dtype):
    w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=dtype), 1.0))
    tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=dtype)))
    with pyro.plate("counties", num_groups):
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=dtype), tau))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=dtype), 1.0))
    with pyro.plate("homes", len(y), subsample_size=100) as idx:
        pyro.sample("obs", dist.Normal(a[g[idx]] + (w + b[g[idx]]) * x[idx], 0.5), obs=y[idx])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_groups,num_rows", [(50, 3000), (10_000, 60_000)], ids=["50", "10000"])
def test_varying_intercepts_and_slopes_give_the_models_own_index(dtype, num_groups, num_rows):
    g = unequal_groups(num_groups, num_rows)
    x, y = torch.randn(num_rows, dtype=dtype), torch.randn(num_rows, dtype=dtype)
    found = row_groups(ModelBridge(varying_slopes, (x, g, y, num_groups, dtype)))
    assert (found.plate, found.data_plate, found.sites) == ("counties", "homes", ("a", "b"))
    assert torch.equal(found.group, g)
    assert torch.equal(found.sizes, torch.bincount(g, minlength=num_groups))
    assert int(found.sizes.max()) > 20 * int(found.sizes.min())  # unequal: from a few rows to many


def non_centred_logistic(x, g, y):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    with pyro.plate("schools", 7):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
    with pyro.plate("pupils", len(y), subsample_size=20) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=mu + tau * z[g[idx]] + x[idx]), obs=y[idx])


def test_a_non_centred_logistic_hierarchy():
    g = unequal_groups(7, 400, seed=1)
    x, y = torch.randn(400), torch.bernoulli(torch.full((400,), 0.4))
    found = row_groups(ModelBridge(non_centred_logistic, (x, g, y)))
    assert found.sites == ("z",) and torch.equal(found.group, g)


def crossed(g1, g2, y, membership=False):
    with pyro.plate("counties", 5):
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
    with pyro.plate("years", 3):
        c = pyro.sample("c", dist.Normal(0.0, 1.0))
    with pyro.plate("homes", len(y), subsample_size=10) as idx:
        loc = a[g1[idx]] + (a[g2[idx] % 5] if membership else c[g2[idx]])
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=y[idx])


def test_crossed_groups_are_read_per_plate_and_the_plate_must_be_named():
    g1, g2, y = unequal_groups(5, 200, seed=2), unequal_groups(3, 200, seed=3), torch.randn(200)
    bridge = ModelBridge(crossed, (g1, g2, y))
    assert group_plates(bridge) == {"counties": ("a",), "years": ("c",)}
    with pytest.raises(ValueError, match="needs one group plate.*'counties', 'years'.*plate="):
        row_groups(bridge)
    assert torch.equal(row_groups(bridge, plate="years").group, g2)
    assert torch.equal(row_groups(bridge, plate="counties").group, g1)


def test_multiple_membership_is_refused_naming_the_row():
    g1, g2, y = torch.arange(40) % 5, (torch.arange(40) + 1) % 3, torch.randn(40)
    with pytest.raises(ValueError, match=r"row 0 of plate 'homes' reads several groups of the plate 'counties'"):
        row_groups(ModelBridge(crossed, (g1, g2, y, True)), plate="counties")


def test_a_model_without_groups_is_told_what_to_add():
    def regression(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=10) as idx:
            pyro.sample("obs", dist.Normal(w * x[idx], 1.0), obs=y[idx])

    with pytest.raises(ValueError, match="needs one group plate.*b\\[g\\[idx\\]\\]; found none"):
        row_groups(ModelBridge(regression, (torch.randn(50), torch.randn(50))))


def test_a_row_that_reads_no_group_is_named():
    def partly(g, y):
        with pyro.plate("groups", 3):
            b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=4) as idx:
            loc = torch.where(idx < 6, b[g[idx]], torch.zeros(()))  # the last rows read none
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=y[idx])

    with pytest.raises(ValueError, match=r"rows \[6, 7, 8, 9\] of plate 'data' read no latent of the group plate"):
        row_groups(ModelBridge(partly, (torch.arange(10) % 3, torch.randn(10))))


def test_observations_in_the_group_plate_are_told_to_take_a_data_plate():
    def eight_schools(y, sigma):  # as it is usually written: one plate for the effects and their estimates
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        with pyro.plate("schools", len(y)):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("y", dist.Normal(theta, sigma), obs=y)

    with pytest.raises(ValueError, match=r"has none \(observations in the group plate itself.*b\[g\[idx\]\]"):
        row_groups(ModelBridge(eight_schools, (torch.randn(8), torch.ones(8))))
