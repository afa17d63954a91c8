"""Every engine on the device of the user's data, in float32, as a GPU user runs it (``device`` is CPU and CUDA).

Two ways users put a Pyro model on a GPU: data on the device and a model that builds its tensors from the data
(``x.new_zeros``), or ``torch.set_default_device("cuda")`` and a model written with Python floats in its priors
(Pyro's own GPU examples). Both are run here with each engine; the statistical checks are the CPU suite's, with
their Monte-Carlo tolerances, so a wrong answer on the device fails as it would on the CPU. CI has no GPU: the CUDA
half runs on a lent GPU machine (``pytest -m cuda``), its figures in the closing notes.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.records import Batch
from pyro_scalable.bridge.traced import TRACE_AFTER, model_tracing
from pyro_scalable.infer import (
    BAOAB,
    EKF,
    SGHMC,
    SWAG,
    AutoLinearizedLaplace,
    DiagonalEKF,
    SampleThenOptimize,
    StochasticMCMC,
    sample_posterior_predictive,
)

from .conftest import LinearRegression
from .infer.sgmcmc.test_calibration import sd_ratio

F32 = torch.float32


def float_prior_model(x, y=None):
    """Priors with Python floats: their tensors come from torch's default device."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    scale = pyro.sample("scale", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, scale), obs=None if y is None else y[idx])


def known_noise_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])


class Net(PyroModule):
    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch
        self.hidden = PyroModule[nn.Linear](3, 16)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([16, 3]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([16]).to_event(1))
        self.out = PyroModule[nn.Linear](16, 1)
        self.out.weight = PyroSample(dist.Normal(0.0, 0.25).expand([1, 16]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        plate = pyro.plate("data", x.shape[0], subsample_size=self.batch)
        f = self.out(torch.tanh(self.hidden(x[plate.indices]))).squeeze(-1)
        with plate as idx:
            return pyro.sample("y", dist.Normal(f, 0.3), obs=None if y is None else y[idx])


def regression_data(n: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    return x, x @ torch.linspace(-1.0, 1.0, d) + 0.5 * torch.randn(n, generator=gen)


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
def test_sghmc_with_a_control_variate_is_calibrated_on_the_device(device):
    """B = 10 of N = 1000 in float32 on the device, the control variate at the mode: calibrated to Monte-Carlo error."""
    problem = LinearRegression(num_data=1000, dim=2, batch_size=10, dtype=F32, device=device)
    ratio, error, mcmc = sd_ratio(SGHMC(problem.model, control_variate="map"), problem, 256, 300, 600)
    assert mcmc.bridge.device.type == device.type and mcmc.control_variate is not None
    assert bool((4 * error < 0.08).all()), f"too few effective draws to resolve 10%: MCSE {error}"
    assert bool(((ratio - 1).abs() < 4 * error + 0.03).all()), ratio
    draws = mcmc.get_samples(group_by_chain=True)["w"]
    sd = problem.cov.diagonal().sqrt().cpu()
    assert bool((((draws.mean((0, 1)) - problem.mean.cpu()) / sd).abs() < 0.1).all())


def test_the_recorded_model_replays_on_the_device(device):
    """The bridge's recording (made in a thread of its own) runs on the data's device and equals the model."""
    x, y = (t.to(device) for t in regression_data(200, 3))
    with torch.device(device):  # PyroSample's priors take torch's default device when the module is built
        _check_replay(Net(batch=20), x, y)


@pytest.mark.cuda
def test_a_module_built_off_the_device_names_its_site_and_the_fix():
    """A PyroModule built before torch.set_default_device keeps CPU priors (as in Pyro): the error says so."""
    x, y = (t.cuda() for t in regression_data(200, 3))
    with pytest.raises(ModelError, match=r"latent site 'hidden\.weight' is cpu but .* is cuda:0.*set_default_device"):
        ModelBridge(Net(batch=20), (x, y))


def _check_replay(net, x, y):
    bridge = ModelBridge(net, (x, y))
    plate = next(iter(bridge.plates.values()))
    latents = {k: v[0] for k, v in bridge.init_latents(1, seed=0).items()}
    for seed in range(TRACE_AFTER + 2):
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randperm(plate.size, generator=gen, device="cpu")[: plate.subsample_size].to(x.device)
        batch = Batch({plate.name: idx}, bridge.args, {})
        value = bridge.log_posterior(latents, batch)
    assert len(bridge.traced.graphs) == 1, bridge.traced.refused
    assert value.device.type == x.device.type
    with model_tracing(False):
        plain = bridge.log_posterior(latents, batch)
    torch.testing.assert_close(value, plain, rtol=1e-5, atol=1e-3)


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
def test_default_device_and_float_priors_run_every_engine(device):
    """``torch.set_default_device``: the user's model never names a device; every engine runs there."""
    x, y = regression_data(400, 3)
    with torch.device(device):
        x, y = x.to(device), y.to(device)
        mcmc = StochasticMCMC(
            SGHMC(float_prior_model), num_samples=50, num_warmup=50, num_chains=2, seed=0, progress_bar=False
        )
        mcmc.run(x, y)
        samples = mcmc.get_samples()
        assert torch.isfinite(samples["w"]).all() and samples["scale"].min() > 0
        predictive = sample_posterior_predictive(float_prior_model, samples, x[:10], seed=0, return_sites=["y"])
        assert torch.isfinite(predictive["y"]).all()

        latents = {"w": torch.linspace(-1.0, 1.0, 3, device=device), "scale": torch.tensor(0.5, device=device)}
        posterior = AutoLinearizedLaplace(float_prior_model).laplace_approximation(
            x, y, map_latents=latents, check_map=False, structure="full"
        )
        assert posterior.sample(4).device.type == device.type

        sto = SampleThenOptimize(float_prior_model, num_samples=8, num_epochs=5, seed=0, progress_bar=False)
        sto.run(x, y)
        assert torch.isfinite(sto.get_samples()["w"]).all()

        swag = SWAG(float_prior_model, num_epochs=3, rank=2, seed=0, progress_bar=False).run(x, y)
        draws = swag.sample(4)
        assert draws.shape == (4, 4) and draws.device.type == device.type and torch.isfinite(draws).all()

        ekf = EKF(known_noise_model, seed=0, progress_bar=False).run(x, y)  # dense: the Woodbury update there
        assert torch.isfinite(ekf.mean[0]).all() and ekf.sample(4).device.type == device.type
        diagonal = DiagonalEKF(known_noise_model, seed=0, progress_bar=False).run(x, y)
        assert torch.isfinite(diagonal.mean[0]).all()


def test_sample_then_optimize_matches_the_conjugate_posterior_on_the_device(device):
    """Gold on the device: the optimised rows solve the perturbed normal equations (float64 here, as on the CPU)."""
    problem = LinearRegression(num_data=400, dim=4, batch_size=100, noise_scale=0.5, prior_scale=0.7, device=device)
    engine = SampleThenOptimize(
        problem.model, num_samples=5, num_epochs=150, variance_reduction="all", seed=0, progress_bar=False
    )
    engine.run(problem.x, problem.y)
    alpha = 1 / problem.prior_scale**2
    precision = torch.linalg.inv(problem.cov)
    exact = torch.linalg.solve(precision, alpha * engine.state.targets[:-1].T.to(device)).T
    torch.testing.assert_close(engine.state.samples[:-1].to(device), exact, rtol=1e-8, atol=1e-10)
    assert engine.get_samples()["w"].device.type == "cpu"  # draws_device's default


def test_vectorised_chains_of_a_pyro_module_on_the_device(device):
    """16 vectorised chains of a ``PyroModule`` network on the device: one vmapped step, finite draws, no fallback."""
    x, y = (t.to(device) for t in regression_data(500, 3))
    with torch.device(device):
        mcmc = StochasticMCMC(
            SGHMC(Net(batch=50), step_size=1e-4),
            num_samples=20,
            num_warmup=0,
            num_chains=16,
            seed=0,
            progress_bar=False,
        )
        mcmc.run(x, y)
    draws = mcmc.get_samples(group_by_chain=True)
    assert draws["hidden.weight"].shape == (16, 20, 16, 3)
    assert all(bool(torch.isfinite(v).all()) for v in draws.values())
    assert math.isfinite(float(mcmc.sample_stats["lp"].mean()))


def test_draws_kept_on_the_cpu_are_those_the_device_computed(device):
    """A GPU's draws go to page-locked CPU memory without waiting for the device: none is lost or half-copied."""
    x, y = (t.to(device) for t in regression_data(400, 3))

    def run(draws_device):
        mcmc = StochasticMCMC(
            SGHMC(known_noise_model, step_size=1e-4),
            num_samples=300,
            num_warmup=20,
            num_chains=4,
            seed=3,
            progress_bar=False,
            draws_device=draws_device,
        )
        with torch.device(device):  # the model's priors are Python floats
            mcmc.run(x, y)
        return mcmc

    on_cpu, on_device = run("cpu"), run(device)
    assert on_cpu.results.draws["w"].is_pinned() == (device.type == "cuda")
    for name, value in on_device.results.draws.items():
        torch.testing.assert_close(on_cpu.results.draws[name], value.cpu(), rtol=0, atol=0)
    for name, value in on_device.results.stats.items():
        torch.testing.assert_close(on_cpu.results.stats[name], value.cpu(), rtol=0, atol=0, equal_nan=True)


def partial_pooling(x, group, y, batch=8):
    """Group intercepts around a population mean with a latent group scale, a latent noise scale (centred)."""
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("groups", 4):
        a = pyro.sample("a", dist.Normal(mu, tau))
    with pyro.plate("data", len(y), subsample_size=batch) as idx:
        pyro.sample("obs", dist.Normal(a[group[idx]] + x[idx], sigma), obs=y[idx])


@pytest.mark.parametrize("kernel", [SGHMC, BAOAB])
def test_a_hierarchy_with_every_default_on_the_device(device, kernel):
    """Warm-up's control variate at its window means, its metric, a friction per coordinate, the noise measured on
    every fourth step and the batched controlled gradient in between: on the device, float32, finite draws of the
    right shape."""
    g = torch.Generator().manual_seed(6)
    group = torch.arange(4).repeat_interleave(10)
    x = torch.randn(40, generator=g)
    y = (torch.tensor([-1.0, 0.0, 0.5, 2.0])[group] + x + 0.3 * torch.randn(40, generator=g)).to(device)
    mcmc = StochasticMCMC(
        kernel(partial_pooling), num_samples=200, num_warmup=300, num_chains=4, seed=0, progress_bar=False
    )
    mcmc.run(x.to(device), group.to(device), y)
    assert mcmc.control_variate is not None and mcmc.bridge.device.type == device.type
    draws = mcmc.get_samples(group_by_chain=True)
    assert draws["a"].shape == (4, 200, 4)
    assert all(bool(torch.isfinite(v).all()) for v in draws.values())
    assert float(mcmc.sample_stats["diverging"].float().mean()) == 0.0
    friction = mcmc.sample_stats["friction"]
    assert bool(torch.isfinite(friction).all()) and bool((friction > 0).all())


@pytest.mark.filterwarnings("ignore:in .* of the coordinates")
def test_a_centred_hierarchy_starts_and_is_centred_at_its_mode_on_the_device(device):
    """ "auto" on a centred hierarchy with enough rows a group: the mode search on the device, the chains started
    there, and the group intercepts' posterior means where the data put them (50 rows a group, noise sd 0.3: each
    intercept's posterior sd is about 0.3 / √50 = 0.04; the tolerance is 5 of them, shrinkage to μ is 1% of it)."""
    g = torch.Generator().manual_seed(7)
    group = torch.arange(4).repeat_interleave(50)
    truth = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    x = torch.randn(200, generator=g)
    y = truth[group] + x + 0.3 * torch.randn(200, generator=g)
    mcmc = StochasticMCMC(
        SGHMC(lambda *a: partial_pooling(*a, batch=20)),
        num_samples=300,
        num_warmup=300,
        num_chains=4,
        seed=0,
        progress_bar=False,
    )
    mcmc.run(x.to(device), group.to(device), y.to(device))
    assert mcmc.mode_search is not None and mcmc.control_variate is not None  # "auto" chose the mode
    assert mcmc.bridge.device.type == device.type  # the draws are kept on the CPU (pinned): see the test above
    a = mcmc.get_samples()["a"]
    assert bool(torch.isfinite(a).all())
    group_means = torch.stack([(y - x)[group == j].mean() for j in range(4)])
    assert float((a.mean(0).cpu() - group_means).abs().max()) < 5 * 0.3 / math.sqrt(50)
