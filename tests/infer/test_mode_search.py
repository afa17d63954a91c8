"""The mode search from a vague prior's draw: the exact-Hessian check ends at the mode, not on a noise scale's ridge.

A linear regression with the wide proper priors a Stan model's flat ones become (Normal(0, 1000) coefficients, a
HalfNormal(1000) noise scale). A draw of that prior has a noise scale of about 1000: there the likelihood is nearly
flat in the coefficients, the L-BFGS metric learnt along the noise scale overstated their curvature, and the search
stopped 24 posterior sds from the mode (on an indefinite Hessian); the control variate centred there made SG-MCMC's
warm-up collapse to a step of 1e-100.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_sample

from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.infer.mode_search import MODE_TOLERANCE, find_mode

# The exact reference below takes torch.func.hessian (forward over reverse), whose first call in a process has torch
# script its jvp decompositions and warn that torch.jit.script is deprecated: a torch internal, not ours to act on
# (the search's own Hessian is plain autograd and loads none).
pytestmark = pytest.mark.filterwarnings(r"ignore:.*torch\.jit\.script. is deprecated:DeprecationWarning")

N, SCALE = 2000, 1000.0


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = 3.0 + x @ torch.tensor([2.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    return x, y + 1.5 * torch.randn(N, generator=g, dtype=torch.float64)


def model(x, y):
    alpha = pyro.sample("alpha", dist.Normal(x.new_tensor(0.0), SCALE))
    beta = pyro.sample("beta", dist.Normal(x.new_zeros(4), SCALE).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_tensor(SCALE)))
    with pyro.plate("data", N, subsample_size=N // 10) as idx:
        pyro.sample("obs", dist.Normal(alpha + x[idx] @ beta, sigma), obs=y[idx])


def log_joint(theta, x, y):
    """The model's log joint over (alpha, beta, log sigma), written out (with the log-Jacobian of sigma = exp)."""
    alpha, beta, log_sigma = theta[0], theta[1:5], theta[5]
    prior = dist.Normal(0.0, SCALE).log_prob(theta[:5]).sum() + dist.HalfNormal(SCALE).log_prob(log_sigma.exp())
    return prior + log_sigma + dist.Normal(alpha + x @ beta, log_sigma.exp()).log_prob(y).sum()


def exact_mode(x, y):
    design = torch.cat([torch.ones(N, 1, dtype=x.dtype), x], 1)
    fit = torch.linalg.lstsq(design, y.unsqueeze(-1)).solution.squeeze(-1)  # least squares: next to the mode
    theta = torch.cat([fit, (y - design @ fit).std().log().reshape(1)])
    for _ in range(20):  # Newton from there
        hessian = torch.func.hessian(log_joint)(theta, x, y)
        theta = theta - torch.linalg.solve(hessian, torch.func.grad(log_joint)(theta, x, y))
    return theta, -torch.func.hessian(log_joint)(theta, x, y)


@pytest.mark.parametrize("seed", range(3))
def test_the_search_from_a_vague_priors_draw_ends_at_the_mode(seed):
    x, y = data()
    bridge = ModelBridge(model, (x, y))
    start = {name: value[0] for name, value in bridge.init_latents(1, init_to_sample, seed=seed + 4).items()}
    assert float(start["sigma"]) > 3.0  # log sigma: a noise scale of e^3 or more, the ridge's side of the mode
    mode, search = find_mode(bridge, start, torch.Generator().manual_seed(seed))
    exact, precision = exact_mode(x, y)
    error = torch.cat([mode["alpha"].reshape(1), mode["beta"], mode["sigma"].reshape(1)]) - exact
    distance = float(error @ precision @ error) ** 0.5  # in posterior sds
    assert search.converged and search.hessian_passes >= 1
    assert distance < MODE_TOLERANCE * 6**0.5, (distance, mode)


def test_the_search_from_far_off_on_unscaled_predictors_ends_at_the_mode():
    """posteriordb's earnings data (height in inches, earnings in dollars) with weakly informative priors scaled to
    them: the intercept's, the slope's and the noise scale's curvatures 10¹⁰ apart. From the prior draw the search
    starts at (35 posterior sds off), L-BFGS stalled and a Levenberg-Marquardt shift sized in the latents' own units
    crawled (a few sds in 100 Newton steps, converged=False, 435 nats below the mode); sized where the Hessian's
    diagonal is 1, the search ends at the mode."""
    from tests.posteriordb import POSTERIORS
    from tests.posteriordb.regressions import LinearRegression

    x, y = POSTERIORS["earnings-earn_height"].args()
    priors = LinearRegression(x.new_tensor([4.26e5, 5.06e4]), "half-normal", float(10 * y.std()), 119)
    bridge = ModelBridge(priors, (x, y))
    start = {"beta": x.new_tensor([281915.0559, 13512.1254]), "sigma": x.new_tensor(9.3935)}
    mode, search = find_mode(bridge, start, torch.Generator().manual_seed(0), tolerance=0.01)
    least_squares = torch.linalg.lstsq(x, y.unsqueeze(-1)).solution.squeeze(-1)
    covariance = torch.linalg.inv(x.T @ x) * (y - x @ least_squares).var()
    assert search.converged
    # the mode's coefficients are the least-squares ones up to the priors' pull (under 1e-3 sd here)
    error = mode["beta"] - least_squares
    assert float(error @ torch.linalg.solve(covariance, error)) ** 0.5 < 0.05, mode


@pytest.mark.slow
def test_default_sghmc_with_vague_priors_does_not_collapse_its_warmup():
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the HealthWarning of a run at the default length is not the point here
        mcmc = StochasticMCMC(SGHMC(model), num_samples=1000, num_warmup=1000, num_chains=4, seed=0)
        mcmc.run(x, y)
    step_size = mcmc.sample_stats["step_size"][:, -1]
    assert bool((step_size > 1e-3).all()), step_size  # collapsed to 1e-100 .. 1e-20 before
    assert not bool(mcmc.sample_stats["repeated"].any())
    exact, precision = exact_mode(x, y)
    sd = torch.linalg.inv(precision).diagonal().sqrt()
    samples = mcmc.get_samples()
    means = torch.cat(
        [samples["alpha"].mean(0).reshape(1), samples["beta"].mean(0), samples["sigma"].log().mean(0).reshape(1)]
    )
    assert float(((means - exact).abs() / sd).max()) < 0.3  # the posterior's mean is within 0.1 sd of its mode here
