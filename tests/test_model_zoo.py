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
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
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
from tests.model_zoo import ZOO, B, N, loader_style, zoo_model

KERNELS = {"SGLD": SGLD, "SGHMC": SGHMC, "PSGLD": PSGLD, "SGNHT": SGNHT, "BAOAB": BAOAB}


def _run(kernel_name, model_name, dtype):
    pyro.clear_param_store()
    model, args = zoo_model(model_name, dtype)
    x, y = args[:2]
    mcmc = StochasticMCMC(
        KERNELS[kernel_name](model), num_samples=10, num_warmup=20, num_chains=2, seed=0, progress_bar=False
    )
    if model is loader_style:
        data = TensorDataset(x, y, torch.arange(N))
        loader = DataLoader(data, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(0))
        mcmc.run(x, y, batches=loader)
    else:
        mcmc.run(*args)
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
    return zoo_model(model_name, dtype)


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
