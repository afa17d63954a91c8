r"""Gold tier: the log-likelihood's gradient that the GGN pass takes (for the MAP check), against plain autograd.

The pass differentiates each chunk's log-likelihood to the flat leaf its layers were recorded from, beside the
pullbacks of the roots of :math:`\Lambda`; :func:`data_gradient` runs the network afresh on each chunk. They must
agree to rounding on every kind of layer the pass knows: dense (tanh, relu), convolutional, run on all rows and
indexed by the plate, parameters outside recorded layers (``rest``), and a Normal whose scale is among the Laplace
sites (a gradient that does not go through f; its :math:`\Lambda^{1/2}` depended on the leaf, and the diag pass
failed on the in-place square of the pulled-back columns).
"""

from __future__ import annotations

from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroSample

from pyro_scalable.infer import AutoLinearizedLaplace
from pyro_scalable.infer.laplace.structures import STRUCTURES
from pyro_scalable.infer.linearized.ggn import GGNDiagonal, data_gradient, ggn_pass
from tests.infer.laplace.test_conv import CNN
from tests.infer.linearized.nets import LIKELIHOODS, MLP, ggn_data, random_latents


class _OnAllRows(MLP):
    """The net runs on all N inputs and the plate's indices pick its outputs: plate-indexed layers."""

    def forward(self, x, y=None):
        f = self.net(x)
        with pyro.plate("data", x.shape[0], subsample_size=self.batch_size) as idx:
            return pyro.sample("y", dist.Categorical(logits=f[idx]), obs=None if y is None else y[idx])


class _Offset(MLP):
    """A global offset on the logits: a parameter outside every recorded layer (its rows from ``rest_jacobian``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offset = PyroSample(dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0).expand((3,)).to_event(1))

    def net(self, x):
        return super().net(x) + self.offset


class _Noise(MLP):
    """A Normal whose scale is a latent site that the Laplace sites include: its gradient does not go through f."""

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        data = pyro.plate("data", x.shape[0], subsample_size=self.batch_size)
        f = self.net(x[data.indices])
        with data:
            return pyro.sample("y", dist.Normal(f, sigma).to_event(1), obs=None if y is None else y[data.indices])


def _mlp(kind):
    def build():
        likelihood = kind.partition("-")[2] or kind
        activation = torch.relu if kind.startswith("relu") else torch.tanh
        model = MLP(LIKELIHOODS[likelihood], likelihood, batch_size=16, activation=activation)
        x, y = ggn_data(likelihood)
        return model, x, y, None

    return build


def _special(cls, likelihood, sizes):
    def build():
        x, y = ggn_data(likelihood)
        model = cls(sizes, likelihood, batch_size=16)
        return (
            model,
            x,
            y,
            (["layers.0.weight", "layers.0.bias", "layers.1.weight", "sigma"] if cls is _Noise else None),
        )

    return build


def _cnn():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, 5, 5, generator=g, dtype=torch.float64)
    return CNN(), x, torch.randint(0, 3, (20,), generator=g), None


MODELS = {
    **{f"tanh-{name}": _mlp(name) for name in LIKELIHOODS},
    "relu-categorical": _mlp("relu-categorical"),
    "relu-normal": _mlp("relu-normal"),
    "conv": _cnn,
    "plate-indexed": _special(_OnAllRows, "categorical", LIKELIHOODS["categorical"]),
    "rest": _special(_Offset, "categorical", LIKELIHOODS["categorical"]),
    "noise-site": _special(_Noise, "normal", LIKELIHOODS["normal"]),
}


def _posterior(name, **kwargs):
    model, x, y, sites = MODELS[name]()
    latents = random_latents(model, x, seed=1)
    guide = AutoLinearizedLaplace(model)
    options = dict(map_latents=latents, check_map=False, chunk_size=8, sites=sites)
    return guide.laplace_approximation(x, y, **(options | kwargs))


def _accumulator(structure: str):
    return (
        GGNDiagonal()
        if structure == "diag"
        else STRUCTURES[structure].accumulator(SimpleNamespace(rank=2, generator=torch.Generator().manual_seed(0)))
    )


def _close(gradient, reference):
    torch.testing.assert_close(gradient, reference, rtol=1e-12, atol=1e-12 * float(reference.abs().max()))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_the_pass_gradient_equals_autograds(name, structure):
    posterior = _posterior(name, structure="diag")
    rest = {"rest": 3, "noise-site": 1}.get(name, 0)  # the offset; sigma (its Jacobian column is zero)
    assert posterior.fit.rest.numel() == rest and posterior.fit.layers
    net, theta = posterior.net, posterior.theta_star
    reference = data_gradient(net, theta)
    assert float(reference.abs().min()) > 0 or name == "relu-categorical"  # every entry checked (relu: dead units)
    _close(ggn_pass(net, theta, _accumulator(structure)).gradient, reference)


@pytest.mark.parametrize("name", ["tanh-categorical", "conv", "rest"])
def test_the_empirical_fisher_pass_gradient_equals_autograds(name):
    posterior = _posterior(name, structure="diag")
    net, theta = posterior.net, posterior.theta_star
    _close(ggn_pass(net, theta, GGNDiagonal(), curvature="ef").gradient, data_gradient(net, theta))


@pytest.mark.parametrize("name", ["tanh-normal", "rest", "noise-site"])
def test_the_matrix_free_pass_gradient_equals_autograds(name):
    posterior = _posterior(name, structure="diag")
    net, theta = posterior.net, posterior.theta_star
    _close(ggn_pass(net, theta, _accumulator("low_rank")).gradient, data_gradient(net, theta))
