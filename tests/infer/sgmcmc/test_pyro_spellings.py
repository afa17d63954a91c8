"""Pyro's (and NumPyro's) argument spellings, and pyro.infer.MCMC given our kernel: one line naming what to use."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import BAOAB, PSGLD, SGHMC, SGLD, SGNHT, StochasticMCMC


def model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y), subsample_size=5) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])


@pytest.mark.parametrize(
    ("spelling", "value", "ours"),
    [
        ("warmup_steps", 100, r"num_warmup="),
        ("disable_progbar", True, r"progress_bar=False"),
        ("thinning", 2, r"thin="),
        ("initial_params", {"mu": torch.zeros(())}, r"init_strategy=.*init_to_value"),
        ("hook_fn", print, r"no per-step hook"),
        ("mp_context", "spawn", r"chain_method=.*distributed='chains'"),
        ("disable_validation", False, r"pyro.enable_validation"),
        ("transforms", {}, r"biject_to"),
        ("save_params", ["mu"], r"get_samples\(\)\[site\]"),
        ("jit_model_args", True, r"not JIT-compiled"),
    ],
)
def test_pyro_spelling_names_ours(spelling, value, ours):
    with pytest.raises(
        TypeError, match=rf"^StochasticMCMC has no argument {spelling}= \(pyro.infer.MCMC's\): .*{ours}"
    ):
        StochasticMCMC(SGLD(model, step_size=0.1), num_samples=10, **{spelling: value})


def test_unknown_argument_is_a_plain_type_error():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_draws'"):
        StochasticMCMC(SGLD(model, step_size=0.1), num_samples=10, num_draws=3)


def test_numpyro_parallel_chain_method_is_explained():
    with pytest.raises(ValueError, match=r"chain_method='parallel'.*'vectorized'.*distributed='chains'"):
        StochasticMCMC(SGLD(model, step_size=0.1), num_samples=10, chain_method="parallel")


@pytest.mark.parametrize("kernel_cls", [SGLD, SGHMC, PSGLD, SGNHT, BAOAB])
def test_pyro_mcmc_refuses_our_kernel_naming_stochastic_mcmc(kernel_cls):
    mcmc = pyro.infer.MCMC(kernel_cls(model, step_size=0.01), num_samples=5, warmup_steps=5, disable_progbar=True)
    with pytest.raises(TypeError, match=rf"^{kernel_cls.__name__} is a stochastic-gradient kernel.*StochasticMCMC"):
        mcmc.run(torch.randn(20))
