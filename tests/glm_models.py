"""GLMs on 2,000 rows, plain and under ``poutine.scale``/``poutine.mask``, for the linearised engines' gold tests.

The linearised engines (Laplace, sample-then-optimise, the EKF) are exact for a linear-Gaussian model and
approximate a GLM's posterior by a Gaussian at its mode; with 2,000 rows and a few coefficients the posterior is close
to Gaussian (its mean within 0.1 sd of its mode), so a correct engine is within the gold tolerance of the reference
and a wrong one (a Gaussian at the wrong point, a likelihood's weight dropped) is far outside it. The references are
long full-data runs of Pyro's NUTS (``python scripts/glm_reference.py`` writes ``tests/glm_reference.json``), which
honours ``poutine.scale`` and ``poutine.mask`` by construction; the linear-Gaussian model's is its closed form
(:func:`linear_gaussian_posterior`).

Every model takes ``(x, y, weight)``: ``weight`` is ``None`` (plain), a float (``poutine.scale(weight)`` on the
likelihood) or a per-row tensor (``poutine.scale(weight[idx])``); :data:`VARIANTS` names them, and ``"mask"`` masks
out the rows whose weight tensor is zero (``poutine.mask``).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

__all__ = [
    "GLMS",
    "MEAN_TOLERANCE",
    "N",
    "SD_TOLERANCE",
    "VARIANTS",
    "errors",
    "glm",
    "linear_gaussian_posterior",
    "reference",
]

N, BATCH = 2000, 200
NOISE = 0.5  # the linear-Gaussian model's known noise sd
MEAN_TOLERANCE = 0.2  # |mean - reference mean| in reference sds
SD_TOLERANCE = 0.1  # |sd / reference sd - 1|
REFERENCE = Path(__file__).with_name("glm_reference.json")


def _data(likelihood: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    if likelihood == "bernoulli":
        y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -2.0, 0.5], dtype=x.dtype) - 1.0), generator=g)
    elif likelihood == "poisson":
        y = torch.poisson((x @ torch.tensor([0.75, -1.0, 0.25], dtype=x.dtype) + 0.5).exp(), generator=g)
    elif likelihood == "categorical":
        logits = x @ torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.5, -1.5], [0.5, 0.0, -0.5]], dtype=x.dtype)
        y = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
    else:
        y = x @ torch.tensor([1.5, -2.0, 0.5], dtype=x.dtype) + NOISE * torch.randn(N, generator=g, dtype=x.dtype)
    return x.to(dtype), (y if likelihood == "categorical" else y.to(dtype))


def _weights(variant: str, dtype: torch.dtype):
    if variant == "plain":
        return None
    if variant == "scaled":
        return 2.0
    g = torch.Generator().manual_seed(12)
    weight = 0.25 + 1.75 * torch.rand(N, generator=g, dtype=torch.float64)  # per-row weights in [0.25, 2]
    if variant == "mask":
        weight = (torch.rand(N, generator=g, dtype=torch.float64) > 0.5).to(torch.float64)
    return weight.to(dtype)


def _likelihood_context(weight, idx):
    if weight is None:
        return nullcontext()
    if isinstance(weight, float):
        return poutine.scale(scale=weight)
    return poutine.scale(scale=weight[idx])


def logistic(x, y, weight=None, mask=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(x.new_zeros(()), 5.0))
    with pyro.plate("data", x.shape[0], subsample_size=BATCH) as idx, _likelihood_context(weight, idx):
        with poutine.mask(mask=mask[idx]) if mask is not None else nullcontext():
            pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w + b), obs=None if y is None else y[idx])


def poisson(x, y, weight=None, mask=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(x.new_zeros(()), 5.0))
    with pyro.plate("data", x.shape[0], subsample_size=BATCH) as idx, _likelihood_context(weight, idx):
        with poutine.mask(mask=mask[idx]) if mask is not None else nullcontext():
            pyro.sample("obs", dist.Poisson((x[idx] @ w + b).exp()), obs=None if y is None else y[idx])


def categorical(x, y, weight=None, mask=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(3, 3), 1.0).to_event(2))
    with pyro.plate("data", x.shape[0], subsample_size=BATCH) as idx, _likelihood_context(weight, idx):
        with poutine.mask(mask=mask[idx]) if mask is not None else nullcontext():
            pyro.sample("obs", dist.Categorical(logits=x[idx] @ w), obs=None if y is None else y[idx])


def linear_gaussian(x, y, weight=None, mask=None):
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=BATCH) as idx, _likelihood_context(weight, idx):
        with poutine.mask(mask=mask[idx]) if mask is not None else nullcontext():
            pyro.sample("obs", dist.Normal(x[idx] @ w, NOISE), obs=None if y is None else y[idx])


GLMS = {
    "logistic": (logistic, "bernoulli"),
    "poisson": (poisson, "poisson"),
    "categorical": (categorical, "categorical"),
    "linear-gaussian": (linear_gaussian, "normal"),
}
VARIANTS = ("plain", "scaled", "weighted", "mask")


def glm(name: str, variant: str = "plain", dtype: torch.dtype = torch.float64):
    """The model ``name`` and its arguments ``(x, y, weight, mask)`` under ``variant`` (one of :data:`VARIANTS`)."""
    model, likelihood = GLMS[name]
    x, y = _data(likelihood, dtype)
    weight = _weights(variant, dtype)
    if variant == "mask":
        return model, (x, y, None, weight.bool())
    return model, (x, y, weight, None)


def linear_gaussian_posterior(variant: str = "plain", dtype: torch.dtype = torch.float64):
    """The linear-Gaussian model's exact posterior mean and covariance under ``variant``."""
    _, (x, y, weight, mask) = glm("linear-gaussian", variant, dtype)
    w = torch.ones(N, dtype=dtype) if weight is None else torch.broadcast_to(torch.as_tensor(weight, dtype=dtype), (N,))
    if mask is not None:
        w = w * mask.to(dtype)
    precision = (x.T * w) @ x / NOISE**2 + torch.eye(3, dtype=dtype)
    covariance = torch.linalg.inv(precision)
    return covariance @ ((x.T * w) @ y / NOISE**2), covariance


def reference(name: str, variant: str = "plain") -> dict[str, dict[str, torch.Tensor]]:
    """Per site: the reference posterior's ``mean`` and ``sd`` (shaped like the site) for ``name`` under ``variant``."""
    if name == "linear-gaussian":
        mean, covariance = linear_gaussian_posterior(variant)
        return {"w": {"mean": mean, "sd": covariance.diagonal().sqrt()}}
    entry = json.loads(REFERENCE.read_text())["models"][f"{name}/{variant}"]
    return {
        site: {k: torch.tensor(s[k], dtype=torch.float64).reshape(s["shape"]) for k in ("mean", "sd")}
        for site, s in entry["sites"].items()
    }


def errors(mean: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], ref: dict) -> tuple[float, float]:
    """The largest ``|mean error| / reference sd`` and ``|sd / reference sd - 1|`` over every element of every site."""
    mean_error = max(float(((mean[k].double() - r["mean"]).abs() / r["sd"]).max()) for k, r in ref.items())
    sd_error = max(float((sd[k].double() / r["sd"] - 1).abs().max()) for k, r in ref.items())
    return mean_error, sd_error
