"""The one-step compiled graph (``model_tracing(compile=True, block_steps=1)``): the closed-form gold tests run on it,
its first step agrees with the eager one from the same seed, and a step that fails to compile runs eagerly, saying why.

Compiling takes 10-20 s per phase on a CPU, so only the SGHMC gold test is in the fast tier.
"""

from __future__ import annotations

import logging

import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_sample

from pyro_scalable import model_tracing
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC
from pyro_scalable.infer.sgmcmc import chains, compiled_step

from ...conftest import LinearRegression
from .test_statistical import PROBLEM, SIZES, assert_matches, gradient_noise, sample, stationary_cov


@pytest.fixture
def compiled_steps(monkeypatch):
    """The run's :class:`~.chains.CompiledStep` objects, to check that the compiled step ran."""
    made = []
    original = chains.CompiledStep.__init__

    def init(self):
        original(self)
        made.append(self)

    monkeypatch.setattr(chains.CompiledStep, "__init__", init)
    return made


def assert_compiled(made: list) -> None:
    # the run's stepper (a later one, e.g. the health check's noise probe, may take too few steps to compile)
    assert any(m.steps for m in made), "the sampling step did not run compiled"
    assert all(m.refused is None for m in made), [m.refused for m in made]


@pytest.mark.parametrize("kind", ["sghmc", pytest.param("sgld", marks=pytest.mark.slow)], ids=["sghmc", "sgld"])
def test_compiled_step_matches_conjugate_posterior(kind, compiled_steps):
    """The statistical gold test of test_statistical.py (512 vectorised chains) with the whole step compiled."""
    problem = LinearRegression(**PROBLEM)
    if kind == "sghmc":
        step_size, friction = 1e-3, 50.0
        kernel = SGHMC(problem.model, step_size=step_size, friction=friction, init_strategy=init_to_sample)
        allowance = 2 * step_size * gradient_noise(problem) / (2 * friction)
    else:
        step_size, friction = 2e-5, 0.0
        kernel = SGLD(problem.model, step_size=step_size, init_strategy=init_to_sample)
        allowance = 2 * step_size * gradient_noise(problem) / 2
    with model_tracing(compile=True, block_steps=1):
        draws = sample(kernel, problem, *SIZES["fast"])
    assert_compiled(compiled_steps)
    assert_matches(draws, problem.mean, stationary_cov(problem, kind, step_size, 1.0, friction), allowance)


@pytest.mark.slow
def test_compiled_noise_corrected_one_chain_matches_posterior(compiled_steps):
    """One chain with the noise corrected (two compiled phases: with and without the noise measured), long enough
    for the mean and the variances to be checked against the closed form."""
    problem = LinearRegression(**PROBLEM)
    step_size, friction = 1e-3, 50.0
    kernel = SGHMC(
        problem.model, step_size=step_size, friction=friction, gradient_noise="correct", init_strategy=init_to_sample
    )
    with model_tracing(compile=True, block_steps=1):
        draws = sample(kernel, problem, 1, 500, 40_000)
    assert_compiled(compiled_steps)
    assert max(len(m.steps) for m in compiled_steps) == 2  # the noise measured on every 4th step, and not
    expected = stationary_cov(problem, "sghmc", step_size, 1.0, friction)
    allowance = 2 * step_size * gradient_noise(problem) / (2 * friction)  # the uncorrected bound, as for the eager
    assert_matches(draws, problem.mean, expected, allowance)


def test_a_step_that_fails_to_compile_runs_eagerly(monkeypatch, caplog, compiled_steps):
    """A compiler failure leaves the run on the eager step, the reason logged; the draws are the eager run's."""
    problem = LinearRegression(num_data=200, dim=2, batch_size=50)

    def run():
        kernel = SGHMC(problem.model, step_size=1e-3, friction=50.0)
        mcmc = StochasticMCMC(kernel, num_samples=30, num_warmup=10, seed=3, progress_bar=False)
        mcmc.run(problem.x, problem.y)
        return mcmc.get_samples()["w"]

    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    eager = run()
    monkeypatch.setattr(torch, "compile", refuse)
    with model_tracing(compile=True, block_steps=1), caplog.at_level(logging.WARNING, logger=compiled_step.__name__):
        fallen_back = run()
    assert compiled_steps[0].refused == "RuntimeError: no compiler here"
    assert "runs eagerly" in caplog.text
    torch.testing.assert_close(fallen_back, eager, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_compiled_run_leaves_torchs_generator_as_the_eager_run_does(device, compiled_steps):
    """The compiled step seeds torch's own generator for the device on every step: the user's state is put back."""
    problem = LinearRegression(num_data=200, dim=2, batch_size=50, device=device)
    states = []
    for compiled in (False, True):
        torch.manual_seed(11)
        with model_tracing(compile=compiled, block_steps=1):
            kernel = SGHMC(problem.model, step_size=1e-3, friction=50.0)
            StochasticMCMC(kernel, num_samples=30, num_warmup=10, seed=3, progress_bar=False).run(problem.x, problem.y)
        cuda = torch.cuda.get_rng_state(torch.device(device)) if device == "cuda" else torch.tensor([])
        states.append((torch.get_rng_state(), cuda))
    assert_compiled(compiled_steps)
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])


def test_runs_in_one_process_each_compile_their_own_step_past_torchs_recompile_limit(monkeypatch, compiled_steps):
    """torch.compile keeps at most ``recompile_limit`` graphs per code object (8 by default). Each phase's step has
    a code object of its own, so neither a run's second phase nor a later run finds the limit reached (which ran the
    step's outer frame eagerly, drew the noise in another order, and had the first-step check refuse it)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)  # the ninth run's state, at once
    problem = LinearRegression(num_data=200, dim=2, batch_size=50)
    for seed in range(2):
        kernel = SGHMC(problem.model, step_size=1e-3, friction=50.0, gradient_noise="correct")
        mcmc = StochasticMCMC(kernel, num_samples=80, num_warmup=0, seed=seed, progress_bar=False)
        with model_tracing(compile=True, block_steps=1):
            mcmc.run(problem.x, problem.y)
    assert sum(len(m.steps) for m in compiled_steps) >= 3  # two phases in a run, and the next run's first
    assert_compiled(compiled_steps)
