"""Small Pyro models with brute-force references for the linearised and Laplace tests (float64)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.func import functional_call, jacrev


def _prior(shape, scale):
    return dist.Normal(torch.tensor(0.0, dtype=torch.float64), scale).expand(shape).to_event(len(shape))


class MLP(PyroModule):
    """A PyroModule MLP with Normal priors; ``likelihood`` picks the observed family, ``activation`` the hidden one."""

    def __init__(
        self, sizes=(3, 6, 2), likelihood="normal", noise=0.3, prior_scale=1.0, batch_size=None, activation=torch.tanh
    ):
        super().__init__()
        layers = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layer = PyroModule[nn.Linear](fan_in, fan_out).double()
            layer.weight = PyroSample(_prior((fan_out, fan_in), prior_scale))
            layer.bias = PyroSample(_prior((fan_out,), prior_scale))
            layers.append(layer)
        self.layers = PyroModule[nn.ModuleList](layers)
        self.likelihood, self.noise, self.batch_size = likelihood, noise, batch_size
        self.activation = activation

    def net(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = self.activation(x)
        return x

    def forward(self, x, y=None):
        data = pyro.plate("data", x.shape[0], subsample_size=self.batch_size)
        idx = data.indices
        f = self.net(x[idx])  # outside the plate: the weights are global latents
        with data:
            obs = None if y is None else y[idx]
            idx = slice(None)
            if self.likelihood == "normal":
                return pyro.sample("y", dist.Normal(f[idx], self.noise).to_event(1), obs=obs)
            if self.likelihood == "categorical":
                return pyro.sample("y", dist.Categorical(logits=f[idx]), obs=obs)
            if self.likelihood == "bernoulli":
                return pyro.sample("y", dist.Bernoulli(logits=f[idx].squeeze(-1)), obs=obs)
            if self.likelihood == "poisson":
                return pyro.sample("y", dist.Poisson(f[idx].squeeze(-1).exp()), obs=obs)
            raise ValueError(self.likelihood)


def random_latents(model: MLP, x, seed=0):
    g = torch.Generator().manual_seed(seed)
    trace = pyro.poutine.trace(model).get_trace(x)
    return {
        name: 0.7 * torch.randn(site["value"].shape, generator=g, dtype=torch.float64)
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not name.endswith("data") and name != "y"
    }


def brute_force_jacobian(model: MLP, latents: dict, x):
    """Per-example Jacobian of the outputs w.r.t. the latents flattened in order, ``(n, m, d)``."""
    names = list(latents)

    def f(flat):
        values, start = {}, 0
        for name in names:
            size = latents[name].numel()
            values[name] = flat[start : start + size].reshape(latents[name].shape)
            start += size
        out = x
        for k in range(len(model.layers)):
            out = out @ values[f"layers.{k}.weight"].T + values[f"layers.{k}.bias"]
            if k < len(model.layers) - 1:
                out = torch.tanh(out)
        return out

    flat = torch.cat([latents[n].flatten() for n in names])
    return f(flat), jacrev(f)(flat)


def hessian_lambda(likelihood: str, f, noise=0.3):
    """Per-example Λ_i, ``(n, m, m)``."""
    if likelihood == "normal":
        return torch.eye(f.shape[-1], dtype=f.dtype).expand(f.shape[0], -1, -1) / noise**2
    if likelihood == "categorical":
        p = torch.softmax(f, -1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    if likelihood == "bernoulli":
        p = torch.sigmoid(f)
        return torch.diag_embed(p * (1 - p))
    if likelihood == "poisson":
        return torch.diag_embed(f.exp())
    raise ValueError(likelihood)


del functional_call


LIKELIHOODS = {"normal": (3, 5, 2), "categorical": (3, 5, 3), "bernoulli": (3, 5, 1), "poisson": (3, 4, 1)}


def ggn_data(likelihood, n=40, seed=0):
    """Inputs and targets for an MLP with the ``likelihood`` head (see ``LIKELIHOODS``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    width = LIKELIHOODS[likelihood][-1]
    y = {
        "normal": lambda: torch.randn(n, width, generator=g, dtype=torch.float64),
        "categorical": lambda: torch.randint(0, width, (n,), generator=g),
        "bernoulli": lambda: torch.bernoulli(torch.full((n,), 0.5, dtype=torch.float64), generator=g),
        "poisson": lambda: torch.poisson(torch.full((n,), 2.0, dtype=torch.float64), generator=g),
    }[likelihood]()
    return x, y


def ggn_setup(likelihood, batch_size=16):
    """An MLP at random latents, its data, the brute-force Jacobian and GGN."""
    x, y = ggn_data(likelihood)
    model = MLP(LIKELIHOODS[likelihood], likelihood, batch_size=batch_size)
    latents = random_latents(model, x)
    f, jacobian = brute_force_jacobian(model, latents, x)
    ggn = torch.einsum("nmd,nmk,nke->de", jacobian, hessian_lambda(likelihood, f), jacobian)
    return model, latents, x, y, jacobian, ggn
