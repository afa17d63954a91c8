"""Cyclical SGLD and the kept-draws policy: gold tests against the closed-form law of the chain.

On a Gaussian target N(0, σ²) with exact gradients, SGLD's update is linear: θ_{t+1} = a_t θ_t + sqrt(2 ε_t T_t) ξ_t
with a_t = 1 - ε_t / σ², so from a fixed start the law of θ_t is Gaussian with mean m_t and variance v_t given by
m_{t+1} = a_t m_t and v_{t+1} = a_t² v_t + 2 ε_t T_t. The draw the driver records at step t is θ_t (the point the
step's gradient was taken at). Many chains give the kept draws' mean and variance at each kept step, compared with
the recursion within their Monte-Carlo error.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_value

from pyro_scalable.infer import CyclicalSGLD, StochasticMCMC
from pyro_scalable.infer.sgmcmc.kept import CycleStage, Thinning
from pyro_scalable.infer.sgmcmc.program import KernelContract

SIGMA, START = 1.5, 2.0


def gaussian():
    """Prior N(0, 2σ²) and one observation 0 with noise N(0, 2σ²): the posterior of x is N(0, σ²)."""
    scale = math.sqrt(2.0) * SIGMA
    x = pyro.sample("x", dist.Normal(torch.tensor(0.0, dtype=torch.float64), scale))
    pyro.sample("y", dist.Normal(x, scale), obs=torch.tensor(0.0, dtype=torch.float64))


def law(step_size, cycle_length, exploration, temperature, steps):
    """(m_t, v_t) for t = 0..steps: the closed-form law of cyclical SGLD on N(0, σ²) from θ_0 = START."""
    stage = math.ceil(exploration * cycle_length)
    mean, variance, out = START, 0.0, [(START, 0.0)]
    for t in range(steps):
        r = (t % cycle_length) / cycle_length
        eps = 0.5 * step_size * (math.cos(math.pi * r) + 1.0)
        temp = temperature if t % cycle_length >= stage else 0.0
        a = 1.0 - eps / SIGMA**2
        mean, variance = a * mean, a * a * variance + 2.0 * eps * temp
        out.append((mean, variance))
    return out


@pytest.mark.parametrize(("cycle_length", "exploration", "thin", "num_warmup"), [(40, 0.5, 1, 0), (25, 0.3, 2, 30)])
def test_the_kept_draws_follow_the_closed_form_law_of_the_cycles(cycle_length, exploration, thin, num_warmup):
    chains, step_size, temperature, num_samples = 4000, 0.6, 0.8, 30
    kernel = CyclicalSGLD(
        gaussian,
        step_size=step_size,
        cycle_length=cycle_length,
        exploration=exploration,
        temperature=temperature,
        init_strategy=init_to_value(values={"x": torch.tensor(START, dtype=torch.float64)}),
    )
    mcmc = StochasticMCMC(
        kernel,
        num_samples=num_samples,
        num_warmup=num_warmup,
        num_chains=chains,
        thin=thin,
        seed=1,
        progress_bar=False,
    )
    mcmc.run()
    policy = CycleStage(cycle_length, exploration, thin)
    total = num_warmup + policy.steps(num_samples, num_warmup)
    kept = [t for t in range(total) if policy.keeps(t, num_warmup)]
    assert len(kept) == num_samples and kept[-1] == total - 1
    exact = law(step_size, cycle_length, exploration, temperature, total)
    draws = mcmc.get_samples(group_by_chain=True)["x"]  # (chains, num_samples)
    stats = mcmc.sample_stats
    for k, t in enumerate(kept):
        mean, variance = exact[t]
        r = (t % cycle_length) / cycle_length
        torch.testing.assert_close(
            stats["step_size"][:, k],
            torch.full((chains,), 0.5 * step_size * (math.cos(math.pi * r) + 1.0), dtype=torch.float64),
        )
        assert bool(
            (stats["temperature"][:, k] == temperature).all()
        )  # a sampling stage's draw, never an exploring one
        column = draws[:, k]
        mean_error = 5.0 * math.sqrt(variance / chains) + 1e-12
        variance_error = 5.0 * variance * math.sqrt(2.0 / (chains - 1)) + 1e-12
        assert abs(float(column.mean()) - mean) <= mean_error, (t, float(column.mean()), mean)
        assert abs(float(column.var()) - variance) <= variance_error, (t, float(column.var()), variance)


def test_the_first_kept_draw_of_a_cycle_is_where_exploring_left_every_chain():
    """After the exploration stage at T = 0 every chain is at the same point: the deterministic ascent's."""
    kernel = CyclicalSGLD(
        gaussian,
        step_size=0.6,
        cycle_length=20,
        exploration=0.5,
        init_strategy=init_to_value(values={"x": torch.tensor(START, dtype=torch.float64)}),
    )
    mcmc = StochasticMCMC(kernel, num_samples=1, num_chains=5, seed=0, progress_bar=False)
    mcmc.run()
    draws = mcmc.get_samples()["x"]
    torch.testing.assert_close(draws, torch.full((5,), law(0.6, 20, 0.5, 1.0, 10)[10][0], dtype=torch.float64))


@pytest.mark.parametrize("cycle_length", [1, 7, 10])
@pytest.mark.parametrize("exploration", [0.0, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("thin", [1, 2, 3])
@pytest.mark.parametrize("num_warmup", [0, 4, 13])
def test_the_cycle_policy_counts_the_steps_it_keeps(cycle_length, exploration, thin, num_warmup):
    try:
        policy = CycleStage(cycle_length, exploration, thin)
    except ValueError:
        assert (cycle_length - math.ceil(exploration * cycle_length)) // thin < 1  # refused: no draw per cycle
        return
    for num_samples in range(1, 12):
        steps = policy.steps(num_samples, num_warmup)
        kept = [t for t in range(num_warmup, num_warmup + steps) if policy.keeps(t, num_warmup)]
        assert len(kept) == num_samples and kept[-1] == num_warmup + steps - 1
        for t in kept:
            position = t % cycle_length - math.ceil(exploration * cycle_length)
            assert position >= 0 and (position + 1) % thin == 0


def test_thinning_keeps_every_thin_th_step_after_warmup():
    policy = Thinning(3)
    assert [t for t in range(5, 5 + policy.steps(4, 5)) if policy.keeps(t, 5)] == [7, 10, 13, 16]


def test_the_kernel_keeps_the_contract_and_refuses_bad_settings():
    kernel = CyclicalSGLD(gaussian, step_size=0.1, cycle_length=10)
    assert isinstance(kernel, KernelContract) and not kernel.adapts
    assert kernel.kept_draws(2) == CycleStage(10, 0.5, 2)
    with pytest.raises(ValueError, match="needs step_size"):
        CyclicalSGLD(gaussian, step_size=None, cycle_length=10)
    with pytest.raises(ValueError, match="exploration must be in"):
        CyclicalSGLD(gaussian, step_size=0.1, cycle_length=10, exploration=1.0)
    with pytest.raises(ValueError, match="keeps no draw"):
        CyclicalSGLD(gaussian, step_size=0.1, cycle_length=2, exploration=0.9)
    with pytest.raises(TypeError, match="cycle_length must be an int"):
        CyclicalSGLD(gaussian, step_size=0.1, cycle_length=2.5)
