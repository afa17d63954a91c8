"""SWAG's linearised predictive: exact for a model linear in its weights, J Σ Jᵀ by brute force for a network.

Gold: on a linear regression the linearised predictive is the exact push-forward of SWAG's Gaussian, mean x̃ θ̄ and
variance x̃ Σ x̃ᵀ (+ σ² for y), with Σ the dense covariance; on a tanh network its covariance equals J Σ Jᵀ with J
from ``torch.func.jacrev`` of the network written out by hand at the SWA mean.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.func import jacrev

from pyro_scalable.infer import SWAG

from .test_swag import _Net, _net_data

F64 = torch.float64


def _regression(dtype=F64):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(400, 3, generator=generator, dtype=dtype)
    y = x @ torch.tensor([1.0, -0.5, 0.2], dtype=dtype) + 0.3 + 0.5 * torch.randn(400, generator=generator, dtype=dtype)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=x.dtype), 1.0))
        with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w + b, 0.5), obs=None if y is None else y[idx])

    return model, x, y


@pytest.mark.parametrize("covariance", ["low_rank", "diagonal"])
def test_linear_model_predictive_is_the_exact_push_forward(covariance):
    model, x, y = _regression()
    posterior = SWAG(model, num_epochs=20, rank=6, covariance=covariance, seed=0, progress_bar=False).run(x, y)
    x_test = torch.linspace(-2, 2, 21, dtype=F64)[:, None] * torch.tensor([1.0, 0.5, -1.0], dtype=F64)
    prediction = posterior.predict(x_test)
    design = torch.cat([x_test, torch.ones(21, 1, dtype=F64)], 1)  # the layout's order: w, then b
    assert posterior.sites == ["w", "b"]
    mean = posterior.mean[0]
    sigma = posterior.covariance_matrix(0)
    torch.testing.assert_close(prediction.mean[:, 0], design @ mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(prediction.covariance[:, 0, 0], (design @ sigma * design).sum(1), rtol=1e-9, atol=1e-12)
    law = prediction.distribution
    torch.testing.assert_close(law.variance.reshape(-1), (design @ sigma * design).sum(1) + 0.25, rtol=1e-9, atol=0)
    # no inputs: the training data
    assert posterior.predict().mean.shape == (400, 1)


def _by_hand(flat, layout, x):
    values = layout.unflatten(flat)
    hidden = torch.tanh(x @ values["hidden.weight"].T + values["hidden.bias"])
    return (hidden @ values["out.weight"].T + values["out.bias"]).squeeze(-1)


@pytest.mark.parametrize("covariance", ["low_rank", "diagonal"])
def test_network_covariance_is_j_sigma_jt(covariance):
    """A float32 PyroModule with a latent noise scale (held at its SWA-mean value): J Σ Jᵀ over the weights."""
    pyro.clear_param_store()
    net = _Net()
    x, y = _net_data()
    posterior = SWAG(net, num_epochs=8, rank=5, covariance=covariance, seed=0, progress_bar=False).run(x, y)
    x_test = x[:13]
    prediction = posterior.predict(x_test)
    layout, mean = posterior.layout, posterior.mean[0]
    weights = [n for n in layout.names if n != "scale"]
    index = torch.cat([torch.arange(layout.slots[n].start, layout.slots[n].stop) for n in weights])
    jacobian = jacrev(lambda flat: _by_hand(flat, layout, x_test))(mean)[:, index].double()
    sigma = posterior.covariance_matrix(0).double()[index][:, index]
    expected = ((jacobian @ sigma) * jacobian).sum(1)
    torch.testing.assert_close(prediction.covariance[:, 0, 0].double(), expected, rtol=2e-4, atol=1e-7)
    torch.testing.assert_close(prediction.mean[:, 0], _by_hand(mean, layout, x_test), rtol=1e-5, atol=1e-6)
    assert prediction.mean.dtype == torch.float32
    # y's law adds the noise at its SWA-mean value
    scale = posterior.median()["scale"]
    torch.testing.assert_close(
        prediction.distribution.variance.reshape(-1), prediction.covariance[:, 0, 0] + scale**2, rtol=1e-5, atol=1e-7
    )


def test_classification_and_multiswag_runs():
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(300, 2, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 1] > 1).long()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        with pyro.plate("data", x.shape[0], subsample_size=30) as idx:
            pyro.sample("y", dist.Categorical(logits=x[idx] @ w), obs=None if y is None else y[idx])

    posterior = SWAG(model, num_epochs=6, rank=4, num_runs=2, seed=0, progress_bar=False).run(x, y)
    with pytest.raises(ValueError, match="pass run="):
        posterior.predict(x[:5])
    for run in (0, 1):
        prediction = posterior.predict(x[:5], run=run)
        w = posterior.layout.unflatten(posterior.mean[run])["w"]
        torch.testing.assert_close(prediction.mean, x[:5] @ w)
        probs = prediction.distribution.probs
        assert probs.shape == (5, 3) and torch.allclose(probs.sum(-1), torch.ones(5))
    mc = posterior.predict(x[:5], run=0, link_approx="mc", num_samples=4000, seed=1).distribution.probs
    torch.testing.assert_close(
        mc, posterior.predict(x[:5], run=0, link_approx="mc", num_samples=4000, seed=1).distribution.probs
    )
    with pytest.raises(ValueError, match="run must be below"):
        posterior.predict(x[:5], run=2)
