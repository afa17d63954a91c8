"""``poutine.scale`` and ``poutine.mask`` on the likelihood, in every linearised engine's curvature, evidence and draws.

Gold: a weight of ``w`` on a point is the point repeated ``w`` times (a mask: 0 or 1 times). So at any point θ* the
Laplace posterior of the weighted model equals, to rounding, the one of the plain model on the data with each row
repeated — its precision, its log-likelihood and its evidence — for every structure, likelihood and kind of weight.
Sample-then-optimise is checked against the linear-Gaussian model's closed form under each kind of weight.
"""

from __future__ import annotations

from contextlib import nullcontext

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer import AutoLinearizedLaplace, SampleThenOptimize
from pyro_scalable.infer.linearized.families import likelihood_of
from tests.glm_models import glm, linear_gaussian_posterior

N, D = 60, 3
LIKELIHOODS = {
    "normal": lambda f: dist.Normal(f.squeeze(-1), 0.7),
    "bernoulli": lambda f: dist.Bernoulli(logits=f.squeeze(-1)),
    "poisson": lambda f: dist.Poisson(f.squeeze(-1).exp()),
    "categorical": lambda f: dist.Categorical(logits=f),
}


def make_model(likelihood: str):
    outputs = 3 if likelihood == "categorical" else 1

    def model(x, y=None, weight=None, mask=None):
        w = pyro.sample("w", dist.Normal(x.new_zeros(D, outputs), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(x.new_zeros(outputs), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=20) as idx:
            scale = nullcontext() if weight is None else poutine.scale(scale=weight[idx])
            masked = nullcontext() if mask is None else poutine.mask(mask=mask[idx])
            with scale, masked:
                f = x[idx] @ w + b
                pyro.sample("obs", LIKELIHOODS[likelihood](f), obs=None if y is None else y[idx])

    return model


def make_data(likelihood: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    f = x @ torch.tensor([0.8, -0.6, 0.3], dtype=torch.float64)
    if likelihood == "normal":
        y = f + 0.7 * torch.randn(N, generator=g, dtype=torch.float64)
    elif likelihood == "bernoulli":
        y = torch.bernoulli(torch.sigmoid(f), generator=g)
    elif likelihood == "poisson":
        y = torch.poisson(f.exp(), generator=g)
    else:
        y = (f > -0.3).long() + (f > 0.3).long()
    return x, y


def weights(kind: str) -> torch.Tensor:
    if kind == "constant":
        return torch.full((N,), 2.0, dtype=torch.float64)
    if kind == "per-point":
        return (torch.arange(N) % 3 + 1).to(torch.float64)  # once, twice, three times (Pyro asks scale > 0)
    return (torch.arange(N) % 3 != 0).to(torch.float64)  # a mask


def point(likelihood: str) -> dict[str, torch.Tensor]:
    outputs = 3 if likelihood == "categorical" else 1
    g = torch.Generator().manual_seed(1)
    return {
        "w": 0.3 * torch.randn(D, outputs, generator=g, dtype=torch.float64),
        "b": 0.1 * torch.randn(outputs, generator=g, dtype=torch.float64),
    }


def laplace(model, args, structure: str, at):
    guide = AutoLinearizedLaplace(model)
    return guide.laplace_approximation(*args, structure=structure, map_latents=at, check_map=False, rank=4, seed=0)


FAST = {("full", "bernoulli"), ("kron", "categorical"), ("diag", "poisson"), ("low_rank", "normal")}
CASES = [
    pytest.param(structure, likelihood, kind, marks=() if (structure, likelihood) in FAST else pytest.mark.slow)
    for structure in ("full", "diag", "kron", "low_rank")
    for likelihood in LIKELIHOODS
    for kind in ("constant", "per-point", "mask")
]


@pytest.mark.parametrize(("structure", "likelihood", "kind"), CASES)
def test_a_weighted_laplace_posterior_is_the_one_of_the_repeated_data(structure, likelihood, kind):
    x, y = make_data(likelihood)
    weight = weights(kind)
    model, at = make_model(likelihood), point(likelihood)
    repeats = weight.long()
    repeated = laplace(model, (x.repeat_interleave(repeats, 0), y.repeat_interleave(repeats, 0)), structure, at)
    weighted = laplace(model, (x, y, None, weight.bool()) if kind == "mask" else (x, y, weight), structure, at)
    plain = laplace(model, (x, y), structure, at)
    torch.testing.assert_close(weighted.precision.to_dense(), repeated.precision.to_dense(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(weighted.fit.log_likelihood, repeated.fit.log_likelihood, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weighted.log_marginal_likelihood(), repeated.log_marginal_likelihood())
    # and the weights were not ignored: the plain model's evidence is another number
    assert abs(float(plain.log_marginal_likelihood() - weighted.log_marginal_likelihood())) > 1e-3


@pytest.mark.parametrize("variant", ["plain", "scaled", "weighted", "mask"])
def test_sample_then_optimise_under_weights_is_the_closed_form(variant):
    model, args = glm("linear-gaussian", variant)
    mean, covariance = linear_gaussian_posterior(variant)
    engine = SampleThenOptimize(model, num_samples=256, seed=0, progress_bar=False).run(*args)
    sd = covariance.diagonal().sqrt()
    # the mean is a solve (to the solver's tolerance, 0.1 sd along any direction; here far tighter)
    assert float(((engine.get_mean()["w"] - mean).abs() / sd).max()) < 0.02
    draws = engine.get_samples()["w"]
    # 256 draws: an sd's relative Monte-Carlo error is about 1 / sqrt(2 * 256) = 0.044, four of them 0.18 (a weight
    # dropped from the curvature puts the sds sqrt(2) = 1.41 times too wide under "scaled")
    assert float((draws.std(0) / sd - 1).abs().max()) < 4 * (2 * 256) ** -0.5


def test_a_negative_weight_is_an_error_naming_the_site():
    fn = dist.Bernoulli(logits=torch.zeros(4))
    with pytest.raises(ModelError, match="'obs'.*poutine.scale"):
        likelihood_of("obs", fn, weight=torch.tensor([1.0, -1.0, 1.0, 1.0]))
