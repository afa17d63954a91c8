"""The gradient estimator, the run's injected object: its state's closed form, ``StochasticMCMC(gradient=...)``."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.bridge import Batch
from pyro_scalable.infer import SGHMC, SGLD, StochasticMCMC
from pyro_scalable.infer.gradients import (
    Density,
    Estimator,
    GradientEstimator,
    NoiseEstimatingGradient,
    PlainGradient,
)

F64 = torch.float64


class Linear(Density):
    """log p = Σ_i a_i x over the minibatch's examples (scaled by N/B = 10): per-example gradients 10 a_i."""

    def __init__(self, a):
        self.a = a

    def __call__(self, latents, batch):
        return 10.0 * (self.a.index_select(0, batch.reshape(-1)) * latents["x"]).mean()

    def examples(self, batch):
        return batch, 0, float("inf")  # drawn with replacement: no finite-population correction


def test_the_noise_average_is_the_running_mean_then_an_exponential_one():
    """Measurements standing for k steps weigh k/(t+k) (at least k/50): with k = 1 the first 50 are their mean."""
    a = torch.arange(40, dtype=F64).square() / 100
    estimator = NoiseEstimatingGradient(Linear(a))
    latents = {"x": torch.tensor(0.3, dtype=F64)}
    state = estimator.init(latents)
    measured = []
    for t in range(5):
        batch = torch.arange(4 * t, 4 * t + 4)
        gradient, state = estimator.estimate(state, latents, batch, noise_every=1)
        measured.append((10.0 * a[batch]).var() / 4)  # the sample variance of the per-example gradients, / B
        torch.testing.assert_close(gradient.noise_variance["x"], torch.stack(measured).mean(), rtol=1e-12, atol=0)
        torch.testing.assert_close(gradient.grads["x"], 10.0 * a[batch].mean(), rtol=1e-12, atol=0)
    assert int(state.count) == 5
    # a step that measures nothing counts, and leaves the average as it was
    before = state.noise["x"]
    gradient, state = estimator.estimate(state, latents, torch.arange(4), noise_every=0)
    assert int(state.count) == 6 and torch.equal(gradient.noise_variance["x"], before)
    # one measurement standing for 4 steps at t = 6: weight 4/10
    batch = torch.arange(20, 24)
    _, after = estimator.estimate(state, latents, batch, noise_every=4)
    expected = before + 0.4 * ((10.0 * a[batch]).var() / 4 - before)
    torch.testing.assert_close(after.noise["x"], expected, rtol=1e-12, atol=0)


def test_a_plain_gradient_hands_no_noise_and_keeps_none():
    estimator = PlainGradient(Linear(torch.ones(8, dtype=F64)))
    latents = {"x": torch.tensor(0.3, dtype=F64)}
    gradient, state = estimator.estimate(estimator.init(latents), latents, torch.arange(4), noise_every=1)
    assert gradient.noise_variance == {} and state.noise == {} and int(state.count) == 1
    assert isinstance(estimator, GradientEstimator) and isinstance(estimator.over(Linear(None)), PlainGradient)


def regression(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
    with pyro.plate("data", len(y), subsample_size=10) as idx:
        pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 2, generator=g, dtype=F64)
    return x, x @ torch.tensor([1.0, -1.0], dtype=F64) + torch.randn(100, generator=g, dtype=F64)


def run(kernel, **options):
    mcmc = StochasticMCMC(kernel, num_samples=10, num_warmup=20, num_chains=2, seed=0, progress_bar=False, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short run: unhealthy on purpose
        mcmc.run(*data())
    return mcmc.get_samples(group_by_chain=True)["w"]


@pytest.mark.parametrize(
    "make,gradient",
    [
        (lambda: SGLD(regression, control_variate=None), NoiseEstimatingGradient),  # warm-up, noise corrected
        (lambda: SGHMC(regression, step_size=1e-3, control_variate=None), PlainGradient),  # noise ignored
    ],
    ids=["sgld-defaults", "sghmc-hand-set"],
)
def test_passing_the_default_estimator_gives_the_default_draws(make, gradient):
    torch.testing.assert_close(run(make(), gradient=gradient), run(make()), rtol=0, atol=0)


class Frozen(Estimator):
    """A user's estimator: the minibatch gradient, multiplied by zero."""

    def measure(self, latents, batch, noise_every=0):
        gradient = super().measure(latents, batch, noise_every)
        return gradient._replace(grads={name: 0.0 * g for name, g in gradient.grads.items()})

    def every_chain(self, latents, batch: Batch, noise_every=0):
        gradient = super().every_chain(latents, batch, noise_every)
        return gradient._replace(grads={name: 0.0 * g for name, g in gradient.grads.items()})


def test_a_users_estimator_is_what_the_kernel_is_handed():
    """At T = 0 SGLD is gradient ascent: with a gradient of zero no chain moves from where it started."""
    kernel = SGLD(regression, step_size=0.1, temperature=0.0, control_variate=None)
    draws = run(kernel, gradient=Frozen)
    assert torch.equal(draws, draws[:, :1].expand_as(draws))
    assert not torch.equal(draws[0, 0], draws[1, 0])  # from each chain's own start
    moving = run(SGLD(regression, step_size=0.1, temperature=0.0, control_variate=None))
    assert not torch.equal(moving[:, 0], moving[:, -1])


def test_a_gradient_that_cannot_serve_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match="gradient must be a gradient estimator's class"):
        StochasticMCMC(SGLD(regression, step_size=0.1), num_samples=2, gradient=3)
    with pytest.raises(TypeError, match="no GradientEstimator"):
        StochasticMCMC(SGLD(regression, step_size=0.1), num_samples=2, gradient=lambda density: object()).run(*data())
    with pytest.raises(ValueError, match="does not measure the gradient noise.*give a step_size"):
        StochasticMCMC(SGLD(regression), num_samples=2, num_warmup=4, gradient=PlainGradient).run(*data())
    for mode in ("correct", "estimate"):  # a hand-set step: the noise would go uncorrected (unreported), silently
        kernel = SGLD(regression, step_size=1e-3, gradient_noise=mode)
        with pytest.raises(ValueError, match=f"which SGLD.* is to {mode}: give gradient_noise='ignore'"):
            StochasticMCMC(kernel, num_samples=2, gradient=PlainGradient).run(*data())
