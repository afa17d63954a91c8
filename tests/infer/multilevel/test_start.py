r"""Warm-up's start climbs to the globals' marginal mode: gold against the closed-form marginal of a hierarchy with
latent scales (the groups integrated out exactly), from starts hundreds of sds away, with a vague prior too."""

import math
from types import SimpleNamespace

import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_value

from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.row_groups import row_groups
from pyro_scalable.infer.multilevel import MultilevelMCMC
from pyro_scalable.infer.multilevel.start import TOLERANCE, climb
from pyro_scalable.infer.multilevel.sweep import Sweep

from .test_engine import SIZES, check, data, latent_scales, quadrature, scales_with_prior


def marginal(g, y, mu_scale):
    r"""The log posterior of (mu, log tau, log sigma) with every group's effect integrated out in closed form.

    Group k's rows: :math:`(2\pi\sigma^2)^{-n_k/2} e^{-S_k/2\sigma^2}\sqrt{2\pi\sigma^2/n_k}\,\mathcal{N}(\bar y_k;
    \mu, \tau^2 + \sigma^2/n_k)`, with the priors and the log transforms' Jacobians.
    """
    n = torch.bincount(g).double()
    means = torch.zeros(len(SIZES), dtype=torch.float64).index_add_(0, g, y) / n
    within = torch.zeros(len(SIZES), dtype=torch.float64).index_add_(0, g, (y - means[g]) ** 2)

    def log_post(z):
        m, lt, ls = z
        tau2, sigma2 = (2 * lt).exp(), (2 * ls).exp()
        var = tau2 + sigma2 / n
        groups = (
            -0.5 * n * torch.log(2 * math.pi * sigma2)
            - within / (2 * sigma2)
            + 0.5 * torch.log(2 * math.pi * sigma2 / n)
            - 0.5 * torch.log(2 * math.pi * var)
            - (means - m) ** 2 / (2 * var)
        )
        return groups.sum() - m**2 / (2 * mu_scale**2) - tau2 / 2 + lt - sigma2 / 8 + ls

    return log_post


def exact_mode(log_post):
    z = torch.tensor([0.5, math.log(0.7), 0.0], dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([z], max_iter=500, tolerance_grad=1e-12, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        loss = -log_post(z)
        loss.backward()
        return loss

    optimiser.step(closure)
    return z.detach()


@pytest.mark.parametrize("mu_scale", [3.0, 1000.0], ids=["weak", "vague"])
def test_the_climb_reaches_the_closed_form_marginals_mode_from_far_away(monkeypatch, mu_scale):
    monkeypatch.setattr("pyro_scalable.infer.multilevel.conditionals.MAP_ROWS", max(SIZES))  # the map reads all rows
    g, y = data()
    model = scales_with_prior(mu_scale)
    bridge = ModelBridge(model, (g, y))
    engine = SimpleNamespace(groups_per_step=None, global_steps=None, local_steps=None, num_chains=3, proxy=False)
    sweep = Sweep(bridge, row_groups(bridge), engine)
    # mu 40 away, tau e^3 and sigma e^-3 (hundreds of sds off in log sigma); then tau e^-4; then a neutral start
    theta = torch.tensor([[40.0, 3.0, -3.0], [-20.0, -4.0, 2.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.randn(3, len(SIZES), 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sweep.adapt_to(theta[:, None], b, b)
    mode, factor, value = climb(sweep, theta, b)

    log_post = marginal(g, y, mu_scale)
    exact = exact_mode(log_post)
    hessian = torch.autograd.functional.hessian(log_post, exact)
    sd = torch.linalg.inv(-hessian).diagonal().sqrt()
    assert torch.isfinite(value).all()
    # the climb stops within TOLERANCE of the mode in its Newton decrement: within sqrt(TOLERANCE) sds of it
    assert ((mode - exact).abs() / sd).max() <= math.sqrt(TOLERANCE), (mode, exact)
    # the factor is the marginal's curvature at the mode (the Laplace approximation the chains start from)
    for k in range(3):
        torch.testing.assert_close(
            factor[k] @ factor[k].T, -torch.autograd.functional.hessian(log_post, mode[k]), rtol=1e-3, atol=1e-3
        )
    # the value differs from the closed form by a constant only (the same at every chain's mode)
    gaps = value - torch.stack([log_post(z) for z in mode])
    torch.testing.assert_close(gaps, gaps[:1].expand(3), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_start_far_out_in_the_tails_still_samples_the_posterior():
    """Pyro's initialisation puts chains anywhere in [-2, 2]; a user's init_to_value anywhere at all."""
    g, y = data()
    far = init_to_value(values={"mu": torch.tensor(40.0), "tau": torch.tensor(20.0), "sigma": torch.tensor(0.01)})
    mcmc = MultilevelMCMC(latent_scales, num_samples=400, num_warmup=200, seed=3, init_strategy=far).run(g, y)
    s = mcmc.get_samples(group_by_chain=True)
    draws = torch.cat([s["mu"][..., None], s["tau"][..., None], s["sigma"][..., None], s["b"]], -1)
    check(draws, *quadrature(g, y))
