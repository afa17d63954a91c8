"""The group terms of a multilevel model sum to its log joint, and each group's conditional reads its own rows."""

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.group_terms import group_terms
from pyro_scalable.bridge.hierarchy import irregular_point
from pyro_scalable.bridge.row_groups import row_groups
from pyro_scalable.infer.multilevel.layout import Layout


def slopes(x, g, y, num_groups):
    """Varying intercepts and slopes with a latent noise scale and group scale (positive sites: Jacobians)."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=y.dtype), 3.0).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(torch.ones(2, dtype=y.dtype)).to_event(1))
    sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=y.dtype), 1.0))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(mu[0], tau[0]))
        s = pyro.sample("s", dist.LogNormal(mu[1], tau[1]))  # a positive local: its Jacobian is a group term
    with pyro.plate("data", len(y), subsample_size=7) as idx:
        pyro.sample("obs", dist.Normal(a[g[idx]] + s[g[idx]] * x[idx], sigma), obs=y[idx])


def data(num_groups=6, num_rows=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.cat([torch.arange(num_groups), torch.randint(0, num_groups, (num_rows - num_groups,), generator=gen)])
    x = torch.randn(num_rows, generator=gen, dtype=torch.float64)
    return x, g, x + torch.randn(num_rows, generator=gen, dtype=torch.float64), num_groups


def test_terms_sum_to_the_log_joint_and_split_by_group():
    args = data()
    bridge = ModelBridge(slopes, args)
    groups = row_groups(bridge)
    latents = irregular_point(bridge)
    terms = group_terms(bridge, groups, latents, torch.arange(len(args[2])))
    total = bridge.log_posterior(latents, bridge.full_batch())
    torch.testing.assert_close(terms.globals + terms.groups.sum() + terms.rows.sum(), total)
    # a group's conditional: moving group 2's latents changes group 2's term and its rows' only
    moved = {**latents, "a": latents["a"].clone(), "s": latents["s"].clone()}
    moved["a"][2] += 0.3
    moved["s"][2] -= 0.2
    after = group_terms(bridge, groups, moved, torch.arange(len(args[2])))
    changed_groups = torch.nonzero(after.groups != terms.groups).flatten().tolist()
    changed_rows = torch.nonzero(after.rows != terms.rows).flatten()
    assert changed_groups == [2]
    assert torch.equal(changed_rows, torch.nonzero(args[1] == 2).flatten())
    # rows are read through the plate's subsample: the terms of some rows are those rows' terms
    some = torch.tensor([5, 0, 17])
    torch.testing.assert_close(group_terms(bridge, groups, latents, some).rows, terms.rows[some])


def test_layout_round_trip():
    bridge = ModelBridge(slopes, data())
    layout = Layout(bridge, row_groups(bridge))
    latents = {k: torch.stack([v, v + 1]) for k, v in irregular_point(bridge).items()}
    theta, b = layout.split(latents)
    assert theta.shape == (2, 5) and b.shape == (2, 6, 2)
    assert torch.equal(b[1, 3], torch.stack([latents["a"][1, 3], latents["s"][1, 3]]))
    joined = layout.join(theta, b)
    assert all(torch.equal(joined[k], latents[k]) for k in latents)
