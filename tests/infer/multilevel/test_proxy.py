"""The rows' proxy is the second-order Taylor expansion of their log-likelihood: its coefficients are the blocks of
the full Hessian by autodiff (any model), and it is exact where the rows are quadratic in the latents."""

import pyro
import pyro.distributions as dist
import torch
from torch.autograd.functional import hessian, jacobian

from pyro_scalable.infer.multilevel.proxy import fit

from .test_group_terms import slopes
from .test_sweep import sweep_at


def fixed_effect(x, g, y, num_groups):
    """A global slope and varying intercepts and slopes with a known noise: rows quadratic in every latent."""
    beta = pyro.sample("beta", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 3.0))
    tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=y.dtype)))
    with pyro.plate("groups", num_groups):
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=y.dtype), tau))
        s = pyro.sample("s", dist.Normal(torch.tensor(0.0, dtype=y.dtype), tau))
    with pyro.plate("data", len(y), subsample_size=7) as idx:
        k = g[idx]
        pyro.sample("obs", dist.Normal(a[k] + (beta + s[k]) * x[idx], 0.8), obs=y[idx])


def rows_of(sweep):
    every = (sweep.rows.all, sweep.rows.group, sweep.num_groups)
    return lambda theta, b: sweep._rows_by_group(theta, b, *every)


def test_the_proxys_coefficients_are_the_blocks_of_the_rows_hessian():
    sweep, theta, b = sweep_at(slopes)  # a positive local and a latent noise scale: not quadratic
    rows = rows_of(sweep)
    taylor = fit(rows, theta, b)
    d, (num_groups, p) = theta.shape[0], b.shape
    joint = torch.cat([theta, b.reshape(-1)])
    total = lambda z: rows(z[:d], z[d:].reshape(num_groups, p)).sum()  # noqa: E731
    full, gradient = hessian(total, joint), jacobian(total, joint)
    torch.testing.assert_close(taylor.gamma, gradient[:d])
    torch.testing.assert_close(taylor.g, gradient[d:].reshape(num_groups, p))
    torch.testing.assert_close(taylor.big_gamma, full[:d, :d])

    # T: the derivative in theta of each group's block of the Hessian
    def local_hessian(t):
        return hessian(lambda x: rows(t, x.reshape(num_groups, p)).sum(), b.reshape(-1), create_graph=True)

    third = jacobian(local_hessian, theta)
    for k in range(num_groups):
        block = slice(d + k * p, d + (k + 1) * p)
        local = slice(k * p, (k + 1) * p)
        torch.testing.assert_close(taylor.t[k], third[local, local])
        torch.testing.assert_close(taylor.h[k], full[block, block])
        torch.testing.assert_close(taylor.c[k], full[block, :d])
        other = torch.ones(num_groups * p, dtype=torch.bool)
        other[k * p : (k + 1) * p] = False  # a group's locals meet no other group's in the rows
        assert full[block, d:][:, other].abs().max() == 0


def test_the_proxy_is_exact_where_the_rows_are_quadratic():
    sweep, theta, b = sweep_at(fixed_effect)
    rows = rows_of(sweep)
    taylor = fit(rows, theta, b)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        t = theta + torch.randn(theta.shape, generator=gen, dtype=theta.dtype)
        x = b + torch.randn(b.shape, generator=gen, dtype=b.dtype)
        change = rows(t, x) - rows(theta, b)  # each group's rows, exactly
        q = taylor.groups(t, x)
        torch.testing.assert_close(change.sum(), q.sum() + taylor.globals(t))
        exact = torch.func.grad(lambda y, t=t: rows(t, y).sum())(x)
        torch.testing.assert_close(taylor.gradient_b(t, x), exact)
        # the locals alone moved: each group's own rows, group by group
        torch.testing.assert_close(rows(theta, x) - rows(theta, b), taylor.groups(theta, x))
