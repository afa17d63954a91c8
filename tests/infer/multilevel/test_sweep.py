"""The sweep's Laplace map by central differences: each group's conditional gradient and curvature equal autodiff's
(exactly for a Gaussian conditional, closely for any smooth one), in value and in their derivative in the globals
(what the globals' move differentiates), and its centre is the conditional's mode where the conditional is Gaussian."""

from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.func import grad, jacrev, vmap

from pyro_scalable.bridge import ModelBridge
from pyro_scalable.bridge.hierarchy import irregular_point
from pyro_scalable.bridge.row_groups import RowGroups, row_groups
from pyro_scalable.infer.multilevel.rows import Rows
from pyro_scalable.infer.multilevel.sweep import Sweep

from .test_group_terms import data


def gaussian(x, g, y, num_groups):
    """Non-centred intercepts and slopes with a latent noise scale: Gaussian in the locals whatever the globals."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=y.dtype), 3.0).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(torch.ones(2, dtype=y.dtype)).to_event(1))
    sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=y.dtype), 1.0))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
        s = pyro.sample("s", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
    with pyro.plate("data", len(y), subsample_size=7) as idx:
        k = g[idx]
        pyro.sample("obs", dist.Normal(mu[0] + tau[0] * a[k] + (mu[1] + tau[1] * s[k]) * x[idx], sigma), obs=y[idx])


def heavy_tailed(x, g, y, num_groups):
    """Student-t group effects and rows: a conditional that is not Gaussian in the locals."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros(2, dtype=y.dtype), 3.0).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(torch.ones(2, dtype=y.dtype)).to_event(1))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.StudentT(4.0, mu[0], tau[0]))
        s = pyro.sample("s", dist.StudentT(4.0, mu[1], tau[1]))
    with pyro.plate("data", len(y), subsample_size=7) as idx:
        pyro.sample("obs", dist.StudentT(5.0, a[g[idx]] + s[g[idx]] * x[idx], 1.0), obs=y[idx])


def sweep_at(model, proxy=False):
    bridge = ModelBridge(model, data())
    engine = SimpleNamespace(groups_per_step=None, global_steps=None, local_steps=None, num_chains=1, proxy=proxy)
    sweep = Sweep(bridge, row_groups(bridge), engine)
    theta, b = sweep.layout.split({k: v[None] for k, v in irregular_point(bridge).items()})
    return sweep, theta[0], b[0]


@pytest.mark.parametrize("model, width, tolerance", [(gaussian, 0.7, 1e-6), (heavy_tailed, 1e-3, 1e-4)])
def test_the_conditionals_by_differences_match_autodiff(model, width, tolerance):
    sweep, theta, b = sweep_at(model)
    widths = width * torch.linspace(0.5, 1.5, b.numel(), dtype=b.dtype).reshape(b.shape)
    exact = lambda t: (grad(lambda y: sweep._joint(t, y)[0])(b), sweep._curvature(t, b))  # noqa: E731 -- autodiff
    differences = lambda t: sweep._differences(t, b, widths)  # noqa: E731
    for ours, theirs in zip(differences(theta), exact(theta), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    # the globals' move differentiates them (they follow the group scale and mean): the derivatives agree too
    for ours, theirs in zip(jacrev(differences)(theta), jacrev(exact)(theta), strict=True):
        assert theirs.abs().amax() > 0.1
        torch.testing.assert_close(ours, theirs, rtol=10 * tolerance, atol=10 * tolerance)
    # and under vmap over chains, as the sweep calls them
    stacked = vmap(lambda t: sweep._differences(t, b, widths))(torch.stack([theta, theta]))
    torch.testing.assert_close(stacked[1][1], differences(theta)[1])


def test_the_laplace_centre_is_a_gaussian_conditionals_mode():
    sweep, theta, b = sweep_at(gaussian)
    fallback = torch.eye(2, dtype=b.dtype).expand(b.shape[0], 2, 2)
    centre, factor = sweep._laplace(theta, b, torch.full_like(b, 0.3), fallback)
    gradient = grad(lambda y: sweep._joint(theta, y)[0])(centre)
    torch.testing.assert_close(gradient, torch.zeros_like(gradient), rtol=0, atol=1e-9)
    torch.testing.assert_close(factor @ factor.transpose(-1, -2), sweep._curvature(theta, centre))


def test_the_maps_rows_are_a_fixed_weighted_sample_of_each_group():
    sizes = torch.tensor([1, 5, 40, 7])
    shuffle = torch.randperm(53, generator=torch.Generator().manual_seed(1))
    group = torch.repeat_interleave(torch.arange(4), sizes)[shuffle]
    rows = Rows(RowGroups(plate="g", data_plate="d", sites=("b",), group=group, sizes=sizes))
    assert rows.sample(40, torch.float64)[2] is None  # no group over the limit: every row, unweighted
    kept, kept_group, weight = rows.sample(6, torch.float64)
    assert torch.equal(kept_group, group[kept]) and len(set(kept.tolist())) == len(kept)
    assert torch.bincount(kept_group, minlength=4).tolist() == [1, 5, 6, 6]
    # weighted, the sample's per-group sums of a constant are the full groups' sums
    full = torch.zeros(4, dtype=torch.float64).index_add(0, kept_group, weight)
    torch.testing.assert_close(full, sizes.double())
    assert torch.equal(rows.sample(6, torch.float64)[0], kept)  # fixed: the same sample every time


def test_warm_up_gives_the_proxy_up_after_a_window_whose_second_stage_rejected_too_often():
    sweep, theta, b = sweep_at(gaussian, proxy=True)
    chain = (theta[None, None], b[None], b[None])
    sweep.adapt_to(*chain, proxy=True)
    assert sweep.proxy
    sweep.seconds = {"local": [torch.tensor(0.99)], "global": [torch.tensor(0.9), torch.tensor(0.8)]}
    sweep.adapt_to(*chain, proxy=True)
    assert sweep.proxy  # a good window keeps it
    sweep.seconds = {"local": [torch.tensor(0.99)], "global": [torch.tensor(0.6), torch.tensor(0.7)]}
    sweep.adapt_to(*chain, proxy=True)
    assert not sweep.proxy and not sweep.wants_proxy  # a poor one: the exact moves for the rest of the run


def test_the_globals_mass_matrix_is_the_negative_hessian_averaged_over_the_window():
    """At a window's end the globals' mass matrix is the transformed density's negative Hessian averaged over the
    window's mean and evenly spaced draws of it, not read at one point (where, in a funnel's neck, it can be nearly
    singular along the scale); at the start (a window of one point) it is the Hessian there."""
    from pyro_scalable.infer.multilevel.mala import precision_factor
    from pyro_scalable.infer.multilevel.sweep import CURVATURE_POINTS, _curvature_points

    sweep, theta, b = sweep_at(heavy_tailed)
    shifts = torch.linspace(-1.0, 1.0, 20, dtype=theta.dtype)[:, None] * torch.ones_like(theta)
    window = (theta + 0.4 * shifts)[None]  # (C = 1, T = 20, d)
    points = _curvature_points(window, window.mean(1))
    assert points.shape == (1, CURVATURE_POINTS, theta.shape[0])
    torch.testing.assert_close(points[0, 0], window[0].mean(0))
    assert torch.equal(points[0, 1], window[0, 0]) and torch.equal(points[0, -1], window[0, -1])
    sweep.adapt_to(window, b[None], b[None])
    fixed = (sweep.b_ref[0], sweep.width[0], sweep.fallback[0], ())
    centre, factor = sweep._laplace(points[0, 0], *fixed)
    eps = (factor.transpose(-1, -2) @ (sweep.b_ref[0] - centre).unsqueeze(-1)).squeeze(-1)
    density = lambda x: sweep._transformed(x, torch.zeros_like(b), eps, *fixed)[0]  # noqa: E731
    hessians = torch.stack([jacrev(jacrev(density))(x) for x in points[0]])
    assert not torch.allclose(hessians[1], hessians[-1], rtol=0.05)  # the points' curvatures differ
    # (far from the mode, as here, the mean can still be indefinite: its eigenvalues are then floored)
    torch.testing.assert_close(sweep.global_factor[0], precision_factor(-hessians.mean(0)), rtol=1e-6, atol=1e-6)
    # at the start, one point: its own Hessian
    sweep.adapt_to(theta[None, None], b[None], b[None])
    assert _curvature_points(theta[None, None], theta[None]).shape == (1, 1, theta.shape[0])
