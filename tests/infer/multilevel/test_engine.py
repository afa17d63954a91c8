r"""MultilevelMCMC against closed forms: a conjugate hierarchy, and one whose scales are latent (by quadrature).

Tolerances are Monte-Carlo errors: a mean within 5 of its standard errors (the reference sd over the square root of
the coordinate's effective sample size), an sd within 5 standard errors of the variance estimate (the centred
squares' sd over the root of their effective sample size), in every coordinate.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.stats import effective_sample_size

from pyro_scalable.infer.multilevel import MultilevelMCMC

SIZES = (1, 2, 3, 5, 8, 13, 30, 60)


def data(tau=0.7, sigma=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    g = g[torch.randperm(len(g), generator=gen)]
    effects = 0.5 + tau * torch.randn(len(SIZES), generator=gen, dtype=torch.float64)
    return g, effects[g] + sigma * torch.randn(len(g), generator=gen, dtype=torch.float64)


def known_scale(g, y):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 3.0))
    with pyro.plate("groups", len(SIZES)):
        b = pyro.sample("b", dist.Normal(mu, 0.7))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(b[g[idx]], 1.0), obs=y[idx])


def scales_with_prior(mu_scale):
    """A hierarchy whose group scale and noise scale are latent, with a Normal(0, ``mu_scale``) prior on its mean."""

    def model(g, y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), mu_scale))
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=y.dtype)))
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(2.0, dtype=y.dtype)))
        with pyro.plate("groups", len(SIZES)):
            b = pyro.sample("b", dist.Normal(mu, tau))
        with pyro.plate("data", len(y), subsample_size=10) as idx:
            pyro.sample("obs", dist.Normal(b[g[idx]], sigma), obs=y[idx])

    return model


latent_scales = scales_with_prior(3.0)


def conjugate(g, y):
    """The exact posterior mean and sd of (mu, b) of ``known_scale``."""
    n = torch.bincount(g).double()
    sums = torch.zeros(len(SIZES), dtype=torch.float64).index_add_(0, g, y)
    precision = torch.zeros(len(SIZES) + 1, len(SIZES) + 1, dtype=torch.float64)
    precision[0, 0] = 1 / 9 + len(SIZES) / 0.49
    precision[0, 1:] = precision[1:, 0] = -1 / 0.49
    precision[1:, 1:] = torch.diag(n + 1 / 0.49)
    covariance = torch.linalg.inv(precision)
    return covariance @ torch.cat([torch.zeros(1, dtype=torch.float64), sums]), covariance.diagonal().sqrt()


def quadrature(g, y, points=90):
    r"""Mean and sd of (mu, tau, sigma, b) of ``latent_scales`` with b integrated out in closed form.

    Given (mu, tau, sigma), group k's rows have the marginal likelihood
    :math:`(2\pi\sigma^2)^{-n_k/2} e^{-S_k/2\sigma^2} \sqrt{2\pi\sigma^2/n_k}\, \mathcal{N}(\bar y_k; \mu, \tau^2 +
    \sigma^2/n_k)` and :math:`b_k` a Normal conditional; a grid over (mu, log tau, log sigma) mixes them.
    """
    n = torch.bincount(g).double()
    means = torch.zeros(len(SIZES), dtype=torch.float64).index_add_(0, g, y) / n
    within = torch.zeros(len(SIZES), dtype=torch.float64).index_add_(0, g, (y - means[g]) ** 2)
    mu = torch.linspace(-3.0, 4.0, points, dtype=torch.float64)
    log_tau = torch.linspace(-6.0, 1.5, points, dtype=torch.float64)
    log_sigma = torch.linspace(-1.0, 0.8, points, dtype=torch.float64)
    m, lt, ls = torch.meshgrid(mu, log_tau, log_sigma, indexing="ij")
    tau, sigma = lt.exp()[..., None], ls.exp()[..., None]
    var = tau**2 + sigma**2 / n
    log_group = (
        -0.5 * n * torch.log(2 * math.pi * sigma**2)
        - within / (2 * sigma**2)
        + 0.5 * torch.log(2 * math.pi * sigma**2 / n)
        - 0.5 * torch.log(2 * math.pi * var)
        - (means - m[..., None]) ** 2 / (2 * var)
    )
    log_post = log_group.sum(-1) - m**2 / 18 - lt.exp() ** 2 / 2 + lt - ls.exp() ** 2 / 8 + ls
    w = torch.softmax(log_post.flatten(), 0).reshape(log_post.shape)
    for axis in range(3):  # the grid holds the mass: the edges carry none of it
        edges = w.sum(dim=tuple(a for a in range(3) if a != axis))
        assert edges[0] < 1e-6 and edges[-1] < 1e-6
    precision = 1 / tau**2 + n / sigma**2
    b_mean = (m[..., None] / tau**2 + n * means / sigma**2) / precision
    values = [m, lt.exp(), ls.exp()]
    mean = [float((w * v).sum()) for v in values] + [(w[..., None] * b_mean).sum((0, 1, 2))]
    second = [float((w * v**2).sum()) for v in values] + [(w[..., None] * (b_mean**2 + 1 / precision)).sum((0, 1, 2))]
    mean = torch.cat([torch.tensor(mean[:3], dtype=torch.float64), mean[3]])
    second = torch.cat([torch.tensor(second[:3], dtype=torch.float64), second[3]])
    return mean, (second - mean**2).sqrt()


def check(draws, mean, sd):
    """Every coordinate's mean and sd within 5 Monte-Carlo standard errors of the reference."""
    flat = draws.reshape(-1, draws.shape[-1])
    ess = effective_sample_size(draws)
    assert (ess > 100).all(), ess
    mean_error = (flat.mean(0) - mean).abs() / (sd / ess.sqrt())
    squares = (draws - flat.mean(0)) ** 2
    var_se = squares.reshape(-1, draws.shape[-1]).std(0) / effective_sample_size(squares).sqrt()
    sd_error = (flat.var(0) - sd**2).abs() / var_se
    assert (mean_error < 5).all(), mean_error
    assert (sd_error < 5).all(), sd_error


def test_a_conjugate_hierarchy_is_exact():
    g, y = data()
    mcmc = MultilevelMCMC(known_scale, num_samples=400, num_warmup=200, seed=1).run(g, y)
    s = mcmc.get_samples(group_by_chain=True)
    check(torch.cat([s["mu"][..., None], s["b"]], -1), *conjugate(g, y))
    # Gaussian conditionals: warm-up takes the Newton move to s = 1, a fresh draw of every group, accepted always
    assert mcmc.step_sizes["local"] == [1.0] * 4
    # the globals' trajectory (3 steps) lasts at most a quarter period of the mass matrix's Gaussian
    assert max(mcmc.step_sizes["global"]) <= math.pi / 6 * (1 + 1e-6)
    torch.testing.assert_close(mcmc.sample_stats["accept_prob"], torch.ones_like(mcmc.sample_stats["accept_prob"]))
    # the result surface every engine shares: ArviZ with the pointwise log-likelihood, and predictions
    idata = mcmc.to_inference_data()
    assert {"posterior", "sample_stats", "log_likelihood", "observed_data"} <= set(idata.groups())
    assert idata.posterior["b"].shape == (4, 400, len(SIZES))
    assert idata.log_likelihood["obs"].shape == (4, 400, len(y))
    assert mcmc.posterior_predictive(g, y)["obs"].shape == (1600, len(y))


@pytest.mark.parametrize("num_samples", [400, pytest.param(2000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("proxy", [False, True], ids=["exact", "proxy"])
def test_latent_scales_match_quadrature(num_samples, proxy, monkeypatch):
    """With the rows' proxy (delayed acceptance) as without: the noise scale makes the rows not quadratic.

    The proxy is kept however its second stage accepts (on 60 rows it accepts about 0.8 of the shared moves, near
    the give-up threshold): the draws checked are the proxy's, exact whatever its efficiency.
    """
    monkeypatch.setattr("pyro_scalable.infer.multilevel.sweep.SECOND_STAGE", 0.0)
    g, y = data()
    mcmc = MultilevelMCMC(latent_scales, num_samples=num_samples, num_warmup=200, seed=2, proxy=proxy).run(g, y)
    assert mcmc.proxy_used is proxy  # the draws checked are the proxy's, not the exact moves' after giving it up
    s = mcmc.get_samples(group_by_chain=True)
    draws = torch.cat([s["mu"][..., None], s["tau"][..., None], s["sigma"][..., None], s["b"]], -1)
    check(draws, *quadrature(g, y))


def test_a_model_without_a_group_plate_is_refused_naming_what_to_add():
    def flat(y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=5):
            pyro.sample("obs", dist.Normal(w, 1.0), obs=y)

    with pytest.raises(ValueError, match="needs one group plate"):
        MultilevelMCMC(flat, num_samples=10, num_warmup=10).run(torch.randn(20))


@pytest.mark.slow
def test_the_guides_radon_example_runs_healthy():
    """docs/multilevel.md's example, as the guide shows it: no HealthWarning, every r_hat <= 1.01."""
    import runpy
    import warnings
    from pathlib import Path

    from pyro_scalable.infer.health import HealthWarning, rank_r_hat

    snippet = Path(__file__).resolve().parents[3] / "docs" / "snippets" / "multilevel_radon.py"
    with warnings.catch_warnings():
        warnings.simplefilter("error", HealthWarning)
        namespace = runpy.run_path(str(snippet))
    samples = namespace["mcmc"].get_samples(group_by_chain=True)
    worst = max(float(rank_r_hat(v.reshape(*v.shape[:2], -1).double()).max()) for v in samples.values())
    assert worst <= 1.01


def test_warm_up_restarts_a_chain_whose_steps_collapsed_from_the_yardstick_chain():
    from types import SimpleNamespace

    from pyro_scalable.infer.multilevel.mala import DualAveraging

    engine = MultilevelMCMC(conjugate, num_chains=4, seed=0)
    sweep = SimpleNamespace(
        local_step=DualAveraging(torch.tensor([1.0, 1.1, 0.9, 1.2])),
        global_step=DualAveraging(torch.tensor([0.5, 0.6, 1e-4, 0.55])),
    )
    theta, b = torch.arange(4.0)[:, None], torch.arange(8.0).reshape(4, 2, 1)
    window, b_mean = theta[:, None].expand(4, 3, 1), b + 0.5
    theta2, b2, window2, b_mean2 = engine._restart_stuck(sweep, theta, b, window, b_mean)
    donor = 3  # the upper middle chain by global step (0.5, 0.55, 0.6: the third smallest of four)
    assert engine.restarted.tolist() == [0, 0, 1, 0]
    for new, old in ((theta2, theta), (b2, b), (window2, window), (b_mean2, b_mean)):
        assert torch.equal(new[2], old[donor]) and torch.equal(new[[0, 1, 3]], old[[0, 1, 3]])
    assert sweep.global_step.step[2] == sweep.global_step.step[donor]
    # no chain far behind: nothing changes
    assert engine._restart_stuck(sweep, theta2, b2, window2, b_mean2)[0] is not None
    assert engine.restarted.tolist() == [0, 0, 1, 0]


def test_a_chain_stalled_after_the_last_restart_check_is_named_and_not_told_to_run_longer():
    """Warm-up's last window (its last 40%) has no restart check: a chain whose step collapsed there (Grunfeld's
    panel, one seed: 0.0019 against 0.49-0.62) moves that many times slower, and the length the ESS asks for would
    not mend it, so the warning names the chain and another remedy."""
    import warnings
    from types import SimpleNamespace

    from pyro_scalable.infer.health import HealthWarning, warn_unhealthy
    from pyro_scalable.infer.multilevel.engine import _stalled
    from pyro_scalable.infer.multilevel.mala import DualAveraging

    theta = torch.zeros(4, 6)
    healthy = SimpleNamespace(
        local_step=DualAveraging(torch.tensor([1.47, 1.5, 1.5, 1.48])),
        global_step=DualAveraging(torch.tensor([0.49, 0.61, 0.62, 0.55])),
    )
    assert _stalled(healthy, theta) is None
    stuck = SimpleNamespace(
        local_step=healthy.local_step, global_step=DualAveraging(torch.tensor([0.49, 0.61, 0.62, 0.0019]))
    )
    stalled = _stalled(stuck, theta)
    assert "global step of chain 3 ended at 0.0019, below a tenth of chain 1's 0.61" in stalled.problem
    draws = torch.randn(4, 400, generator=torch.Generator().manual_seed(0))
    draws[3] = 0.5 + 0.01 * draws[3]  # the stuck chain barely moves
    with pytest.warns(HealthWarning) as caught:
        warn_unhealthy({"w": draws}, {}, stalled=stalled)
    message = str(caught[0].message)
    assert message.startswith("the chains are not healthy: the global step of chain 3") and "another seed" in message
    assert "num_samples=" not in message
    with warnings.catch_warnings():  # healthy chains: the stalled step alone raises nothing
        warnings.simplefilter("error", HealthWarning)
        warn_unhealthy({"w": torch.randn(4, 400, generator=torch.Generator().manual_seed(1))}, {}, stalled=stalled)
