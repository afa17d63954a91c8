"""The sweep's group-prior curvature by central differences: the exact Hessian for a Gaussian group prior, close for
any smooth one, in both its value and its derivative in the globals (what the globals' move differentiates)."""

from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.func import jacrev, vmap

from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.hierarchy import irregular_point
from pyro_scalable.bridge.row_groups import row_groups
from pyro_scalable.infer.multilevel.sweep import Sweep

from .test_group_terms import data, slopes


def heavy_tailed(x, g, y, num_groups):
    """Student-t group effects: a group prior that is not Gaussian in the locals."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=y.dtype), 3.0).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(torch.ones(2, dtype=y.dtype)).to_event(1))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.StudentT(4.0, mu[0], tau[0]))
        s = pyro.sample("s", dist.StudentT(4.0, mu[1], tau[1]))
    with pyro.plate("data", len(y), subsample_size=7) as idx:
        pyro.sample("obs", dist.Normal(a[g[idx]] + s[g[idx]] * x[idx], 1.0), obs=y[idx])


def sweep_at(model):
    bridge = ModelBridge(model, data())
    engine = SimpleNamespace(groups_per_step=None, global_steps=None, local_steps=None, num_chains=1)
    sweep = Sweep(bridge, row_groups(bridge), engine)
    theta, b = sweep.layout.split({k: v[None] for k, v in irregular_point(bridge).items()})
    return sweep, theta[0], b[0]


@pytest.mark.parametrize("model, width, tolerance", [(slopes, 0.7, 1e-6), (heavy_tailed, 1e-3, 1e-4)])
def test_prior_curvature_by_differences_matches_the_hessian(model, width, tolerance):
    sweep, theta, b = sweep_at(model)
    widths = torch.full_like(b, width) * torch.linspace(0.5, 1.5, b.numel(), dtype=b.dtype).reshape(b.shape)
    exact = lambda t: sweep._block_curvature(sweep._group_prior, b, t)  # noqa: E731 -- autodiff, reverse over reverse
    differences = lambda t: sweep._prior_differences(t, b, widths)  # noqa: E731
    torch.testing.assert_close(differences(theta), exact(theta), rtol=tolerance, atol=tolerance)
    # the globals' move differentiates Q_k(theta) (it follows the group scales): the derivative agrees too
    slope = jacrev(exact)(theta)
    assert slope.abs().amax() > 0.1
    torch.testing.assert_close(jacrev(differences)(theta), slope, rtol=10 * tolerance, atol=10 * tolerance)
    # and under vmap over chains, as the sweep calls it
    stacked = vmap(lambda t: sweep._prior_differences(t, b, widths))(torch.stack([theta, theta]))
    torch.testing.assert_close(stacked[1], differences(theta))
