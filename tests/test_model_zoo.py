"""The models users write, run briefly by every engine with its defaults.

Every kernel with nothing but the model (warm-up chooses the step size, the gradient noise is corrected), and the
Laplace guide and sample-then-optimise where they apply, on a zoo of ordinary Pyro models: float32 and float64;
constrained scales (HalfNormal, Gamma, LogNormal), simplex and correlation-matrix sites; Normal, StudentT,
Bernoulli, Poisson and Categorical likelihoods; centred and non-centred hierarchies; a ``PyroModule`` network;
both plate styles; nested plates. Each run either ends with finite draws or raises a :class:`ModelError` naming a
site. Anything else (a torch error, a NaN draw) fails.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.nn import PyroModule, PyroSample
from torch.utils.data import DataLoader, TensorDataset

from pyro_scalable import ModelError
from pyro_scalable.infer import (
    BAOAB,
    PSGLD,
    SGHMC,
    SGLD,
    SGNHT,
    AutoLinearizedLaplace,
    SampleThenOptimize,
    StochasticMCMC,
)

N, B, D, G = 120, 12, 3, 4
KERNELS = {"SGLD": SGLD, "SGHMC": SGHMC, "PSGLD": PSGLD, "SGNHT": SGNHT, "BAOAB": BAOAB}


def _data(dtype, likelihood="normal"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=dtype)
    f = x @ torch.tensor([1.0, -0.5, 0.25], dtype=dtype)
    group = torch.arange(N) % G
    if likelihood == "bernoulli":
        y = torch.bernoulli(torch.sigmoid(f), generator=g)
    elif likelihood == "poisson":
        y = torch.poisson(f.exp(), generator=g)
    elif likelihood == "categorical":
        y = (f > 0).to(torch.long) + (f > 1).to(torch.long)
    else:
        y = f + 0.5 * torch.randn(N, generator=g, dtype=dtype)
    return x, y, group


def linear_halfnormal_scale(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, sigma), obs=y[idx])


def linear_gamma_precision(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    precision = pyro.sample("precision", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, precision.rsqrt()), obs=y[idx])


def student_t_lognormal_scale(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.StudentT(4.0, x[idx] @ w, scale), obs=y[idx])


def logistic(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 5.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w + b), obs=y[idx])


def poisson(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 0.5).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Poisson((x[idx] @ w).exp()), obs=y[idx])


def categorical(x, y, group):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D, 3), 1.0).to_event(2))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Categorical(logits=x[idx] @ w), obs=y[idx])


def hierarchical_non_centred(x, y, group):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    raw = pyro.sample("raw", dist.Normal(x.new_zeros(G), 1.0).to_event(1))
    effect = mu + tau * raw
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(effect[group[idx]], sigma), obs=y[idx])


def hierarchical_centred(x, y, group):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    effect = pyro.sample("effect", dist.Normal(mu, tau).expand([G]).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.Normal(effect[group[idx]], 1.0), obs=y[idx])


def mixture_simplex(x, y, group):
    weights = pyro.sample("weights", dist.Dirichlet(x.new_ones(2)))
    locs = pyro.sample("locs", dist.Normal(x.new_tensor([-1.0, 1.0]), 1.0).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        mixture = dist.MixtureSameFamily(dist.Categorical(weights), dist.Normal(locs, 1.0))
        pyro.sample("obs", mixture, obs=y[idx])


def correlated_normal(x, y, group):
    corr = pyro.sample("corr", dist.LKJCholesky(D, x.new_tensor(2.0)))
    scales = pyro.sample("scales", dist.HalfNormal(x.new_ones(D)).to_event(1))
    with pyro.plate("data", N, subsample_size=B) as idx:
        pyro.sample("obs", dist.MultivariateNormal(x.new_zeros(D), scale_tril=scales[..., None] * corr), obs=x[idx])


class _Net(PyroModule):
    def __init__(self, dtype):
        super().__init__()
        self.hidden = PyroModule[torch.nn.Linear](D, 8).to(dtype)
        self.hidden.weight = PyroSample(dist.Normal(torch.zeros(8, D, dtype=dtype), 1.0).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(torch.zeros(8, dtype=dtype), 1.0).to_event(1))
        self.out = PyroModule[torch.nn.Linear](8, 1).to(dtype)
        self.out.weight = PyroSample(dist.Normal(torch.zeros(1, 8, dtype=dtype), 1.0).to_event(2))
        self.out.bias = PyroSample(dist.Normal(torch.zeros(1, dtype=dtype), 1.0).to_event(1))

    def forward(self, x, y, group):
        data = pyro.plate("data", N, subsample_size=B)
        f = self.out(torch.tanh(self.hidden(x[data.indices]))).squeeze(-1)  # the net runs outside the plate
        with data as idx:
            pyro.sample("obs", dist.Normal(f, 0.5), obs=y[idx])


def loader_style(x, y, idx=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample=idx):
        pyro.sample("obs", dist.Normal(x @ w, sigma), obs=y)


def nested_plates(x, y, group):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(D, 1), 1.0).to_event(2))
    with pyro.plate("features", D, dim=-2), pyro.plate("data", N, subsample_size=B, dim=-1) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=x[idx].T)


ZOO = {
    "linear-halfnormal-scale": (linear_halfnormal_scale, "normal"),
    "linear-gamma-precision": (linear_gamma_precision, "normal"),
    "student-t-lognormal-scale": (student_t_lognormal_scale, "normal"),
    "logistic": (logistic, "bernoulli"),
    "poisson": (poisson, "poisson"),
    "categorical": (categorical, "categorical"),
    "hierarchical-non-centred": (hierarchical_non_centred, "normal"),
    "hierarchical-centred": (hierarchical_centred, "normal"),
    "mixture-simplex": (mixture_simplex, "normal"),
    "correlated-normal-lkj": (correlated_normal, "normal"),
    "pyromodule-net": (None, "normal"),
    "dataloader-plate": (loader_style, "normal"),
    "nested-plates": (nested_plates, "normal"),
}


def _run(kernel_name, model_name, dtype):
    pyro.clear_param_store()
    model, likelihood = ZOO[model_name]
    x, y, group = _data(dtype, likelihood)
    if model is None:
        model = _Net(dtype)
    mcmc = StochasticMCMC(
        KERNELS[kernel_name](model), num_samples=10, num_warmup=20, num_chains=2, seed=0, progress_bar=False
    )
    if model is loader_style:
        data = TensorDataset(x, y, torch.arange(N))
        loader = DataLoader(data, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(0))
        mcmc.run(x, y, batches=loader)
    else:
        mcmc.run(x, y, group)
    return mcmc


# float32 is what users' data is, and where the crashes were; float64 runs every kernel in the slow tier only
CASES = [
    pytest.param(
        kernel,
        dtype,
        marks=[pytest.mark.slow] if dtype == torch.float64 and kernel != "SGLD" else [],
        id=f"{kernel}-{str(dtype)[6:]}",
    )
    for kernel in KERNELS
    for dtype in (torch.float32, torch.float64)
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model_name", list(ZOO))
@pytest.mark.parametrize("kernel_name, dtype", CASES)
def test_default_kernel_runs_or_names_the_site(kernel_name, dtype, model_name):
    try:
        mcmc = _run(kernel_name, model_name, dtype)
    except ModelError as error:
        assert "site '" in str(error) or "plate '" in str(error), str(error)
        return
    samples = mcmc.get_samples(group_by_chain=True)
    assert samples, "no draws"
    for name, value in samples.items():
        assert bool(torch.isfinite(value).all()), f"site '{name}' has non-finite draws"
    assert not math.isnan(float(mcmc.sample_stats["step_size"].mean()))


# ---------------------------------------------------------------------------------------------------- Laplace, STO


def _map_guide(model, args):
    """The MAP as a user finds it: Pyro's SVI on the model's own minibatches, here briefly."""
    guide = AutoLinearizedLaplace(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(50):
        svi.step(*args)
    return guide


def _zoo_args(model_name, dtype):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, likelihood = ZOO[model_name]
    x, y, group = _data(dtype, likelihood)
    model = _Net(dtype) if model is None else model
    return model, ((x, y) if model is loader_style else (x, y, group))


def _laplace(model_name, dtype):
    model, args = _zoo_args(model_name, dtype)
    posterior = _map_guide(model, args).laplace_approximation(*args, check_map=False)  # the default structure
    return posterior.get_samples(8, seed=0)


def _sample_then_optimize(model_name, dtype):
    model, args = _zoo_args(model_name, dtype)
    engine = SampleThenOptimize(model, num_samples=4, num_epochs=2, map_steps=50, seed=0, progress_bar=False)
    engine.run(*args)
    return engine.get_samples()


ENGINES = {"Laplace": _laplace, "SampleThenOptimize": _sample_then_optimize}
ENGINE_CASES = [
    pytest.param(
        engine, dtype, marks=[pytest.mark.slow] if dtype == torch.float64 else [], id=f"{engine}-{str(dtype)[6:]}"
    )
    for engine in ENGINES
    for dtype in (torch.float32, torch.float64)
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model_name", list(ZOO))
@pytest.mark.parametrize("engine, dtype", ENGINE_CASES)
def test_linearised_engines_run_or_name_the_site(engine, dtype, model_name):
    try:
        samples = ENGINES[engine](model_name, dtype)
    except ModelError as error:  # e.g. a likelihood with no GGN (a mixture), or a site the engine cannot linearise
        assert "site '" in str(error) or "plate '" in str(error), str(error)
        return
    assert samples, "no draws"
    # each site in the data's dtype, or in the one the model gives it (Pyro's own trace): a prior built from Python
    # numbers (`dist.Normal(0.0, 5.0)`) is float32 beside float64 data, and such a site comes back float32 where the
    # engine holds it fixed and float64 where it is linearised with float64 sites (one flat vector)
    model, args = _zoo_args(model_name, dtype)
    trace = pyro.poutine.trace(model).get_trace(*args)
    own = {name: node["value"].dtype for name, node in trace.nodes.items() if node["type"] == "sample"}
    for name, value in samples.items():
        assert value.dtype in (dtype, own[name]), f"site '{name}' came back in {value.dtype} (model: {own[name]})"
        assert bool(torch.isfinite(value).all()), f"site '{name}' has non-finite draws"
