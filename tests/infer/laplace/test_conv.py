"""Gold tier: convolutional layers (K-FAC by unfolding, Grosse & Martens 2016) against brute-force ``jacrev``."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.func import jacrev

from pyro_scalable.infer import AutoLinearizedLaplace
from pyro_scalable.infer.laplace.structures import STRUCTURES

D = torch.float64


def _prior(*shape):
    return dist.Normal(torch.tensor(0.0, dtype=D), 1.0).expand(shape).to_event(len(shape))


class CNN(PyroModule):
    def __init__(self, classes=3):
        super().__init__()
        self.conv = PyroModule[nn.Conv2d](2, 3, kernel_size=3, stride=2, padding=1).double()
        self.conv.weight = PyroSample(_prior(3, 2, 3, 3))
        self.conv.bias = PyroSample(_prior(3))
        self.head = PyroModule[nn.Linear](3 * 3 * 3, classes).double()
        self.head.weight = PyroSample(_prior(classes, 27))
        self.head.bias = PyroSample(_prior(classes))

    def forward(self, x, y=None):
        data = pyro.plate("data", x.shape[0], subsample_size=8)
        idx = data.indices
        logits = self.head(torch.tanh(self.conv(x[idx])).flatten(1))
        with data:
            return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[idx])


def _brute(latents, x):
    names = list(latents)

    def f(flat):
        values, start = {}, 0
        for name in names:
            values[name] = flat[start : start + latents[name].numel()].reshape(latents[name].shape)
            start += latents[name].numel()
        hidden = torch.tanh(F.conv2d(x, values["conv.weight"], values["conv.bias"], stride=2, padding=1))
        return hidden.flatten(1) @ values["head.weight"].T + values["head.bias"]

    flat = torch.cat([latents[n].flatten() for n in names])
    return f(flat), jacrev(f)(flat)


@pytest.fixture
def setup():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, 5, 5, generator=g, dtype=D)
    y = torch.randint(0, 3, (20,), generator=g)
    model = CNN()
    shapes = {"conv.weight": (3, 2, 3, 3), "conv.bias": (3,), "head.weight": (3, 27), "head.bias": (3,)}
    latents = {k: 0.5 * torch.randn(s, generator=g, dtype=D) for k, s in shapes.items()}
    f, jacobian = _brute(latents, x)
    p = torch.softmax(f, -1)
    lam = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    ggn = torch.einsum("nmd,nmk,nke->de", jacobian, lam, jacobian)
    return model, latents, x, y, ggn


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_conv_ggn_equals_brute_force(setup, structure):
    model, latents, x, y, ggn = setup
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure=structure, map_latents=latents, check_map=False, chunk_size=8
    )
    assert [p.conv for p in posterior.fit.layers] == [True, False]  # both layers on the fast path
    dense = posterior.fit.curvature.to_dense()
    if structure == "diag":
        dense, ggn = dense.diagonal(), ggn.diagonal()
    assert torch.allclose(dense, ggn)


def test_conv_kfac_factors_are_the_unfolded_expectations(setup):
    model, latents, x, y, _ = setup
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="kron", map_latents=latents, check_map=False, chunk_size=8
    )
    block = posterior.fit.curvature.blocks[0]
    patches = F.unfold(x, 3, padding=1, stride=2)  # (n, 18, 9)
    patches = torch.cat([patches, torch.ones_like(patches[:, :1])], 1)
    assert torch.allclose(block.input_factor, torch.einsum("nil,njl->ij", patches, patches))
    # the conv block of the dense K-FAC is B ⊗ A in (out, in * kernel + 1) order
    flat = block.index.flatten()
    dense = posterior.fit.curvature.to_dense()[flat[:, None], flat[None, :]]
    assert torch.allclose(dense, torch.kron(block.output_factor, block.input_factor))


@pytest.mark.parametrize("structure", [name for name, structure in STRUCTURES.items() if structure.has_evidence])
def test_conv_linearized_predictive_variance(setup, structure):
    model, latents, x, y, _ = setup
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure=structure, map_latents=latents, check_map=False, chunk_size=8, rank=6
    )
    x_test = torch.randn(4, 2, 5, 5, generator=torch.Generator().manual_seed(1), dtype=D)
    _, j_test = _brute(latents, x_test)
    covariance = torch.einsum("nmd,de,nke->nmk", j_test, torch.linalg.inv(posterior.precision.to_dense()), j_test)
    assert torch.allclose(posterior.predict(x_test).covariance, covariance, atol=1e-12, rtol=1e-9)
