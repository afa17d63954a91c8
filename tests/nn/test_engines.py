"""Every engine runs on a built model unchanged, on tensor and dict batches; the fixed parameters never move.

Smoke-sized runs (their accuracy is the engines' own tests' business): each engine's result answers its calls
(draws, ``uncertainty``, ArviZ, ``as_prior``), and afterwards every parameter and buffer of the network holds the
value it had before.
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_scalable import ModelError
from pyro_scalable.infer import (
    EKF,
    SGHMC,
    SGLD,
    SWAG,
    AutoLinearizedLaplace,
    DiagonalEKF,
    SampleThenOptimize,
    StochasticMCMC,
)
from pyro_scalable.nn import BayesianNetwork
from tests.nn.networks import TokenClassifier, mlp, token_data


def _regression(rows=200):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 3, generator=generator)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(rows, generator=generator)


def _state(net):
    return {name: value.clone() for name, value in net.state_dict().items()}


def _unchanged(net, before):
    return all(torch.equal(value, net.state_dict()[name]) for name, value in before.items())


def _map(model, *data, steps=100):
    pyro.clear_param_store()
    guide = AutoLinearizedLaplace(model, init_loc_fn=model.init_to_pretrained)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*data, batch_size=None)
    return guide


def test_the_fixed_parameters_are_the_modules_own_tensors():
    net = mlp(batch_norm=True)
    model = BayesianNetwork(net, random="last_layer")
    parameters = dict(net.named_parameters())
    assert set(model.fixed) == set(parameters) - {"6.weight", "6.bias"}
    for name, value in model.fixed.items():
        assert value.data_ptr() == parameters[name].data_ptr() and not value.requires_grad


@pytest.mark.parametrize("sampler", [SGHMC, SGLD])
def test_vectorized_chains_on_a_network_with_batch_norm(sampler):
    net = mlp(batch_norm=True)
    before = _state(net)
    x, y = _regression()
    model = BayesianNetwork(net, random=["0", "6"], prior_center="pretrained", batch_size=50)
    mcmc = StochasticMCMC(sampler(model), num_samples=20, num_warmup=20, num_chains=3, seed=0, progress_bar=False)
    mcmc.run(x, y)  # a fallback to one chain after another would warn, and warnings are errors here
    samples = mcmc.get_samples(group_by_chain=True)
    assert samples["0.weight"].shape == (3, 20, 8, 3) and samples["noise_scale"].shape == (3, 20)
    assert mcmc.uncertainty(x[:4]).epistemic.shape == (4,)
    assert set(mcmc.to_inference_data().posterior.data_vars) == {
        "noise_scale",
        "0.weight",
        "0.bias",
        "6.weight",
        "6.bias",
    }
    assert _unchanged(net, before)


def test_laplace_every_structure_and_as_prior():
    net = mlp()
    before = _state(net)
    x, y = _regression()
    model = BayesianNetwork(net, random=nn.Linear, noise_scale=0.1, batch_size=50)
    guide = _map(model, x, y)
    for structure in ("full", "diag", "kron", "low_rank"):
        posterior = guide.laplace_approximation(x, y, structure=structure, check_map=False)
        assert posterior.uncertainty(x[:4]).total.shape == (4,)
    posterior = guide.laplace_approximation(x, y, structure="diag", check_map=False)
    prior_model = posterior.as_prior(model)
    StochasticMCMC(SGHMC(prior_model), num_samples=5, num_warmup=5, seed=0, progress_bar=False).run(x, y)
    assert _unchanged(net, before)


def test_sample_then_optimize_swag_and_the_filters():
    net = mlp()
    before = _state(net)
    x, y = _regression()
    model = BayesianNetwork(net, random="last_layer", noise_scale=0.1, batch_size=50)
    guide = _map(model, x, y)
    engine = SampleThenOptimize(model, num_samples=4, linearize_at=guide, num_epochs=2, seed=0, progress_bar=False)
    assert engine.run(x, y).uncertainty(x[:4]).total.shape == (4,)
    swag = SWAG(model, num_runs=1, num_epochs=3, rank=3, seed=0, check=False, progress_bar=False).run(x, y)
    assert swag.get_samples(10)["4.weight"].shape == (10, 1, 8)
    for filter_ in (EKF, DiagonalEKF):
        assert filter_(model, check_posterior=False).run(x, y).uncertainty(x[:4]).total.shape == (4,)
    assert _unchanged(net, before)


def test_dict_batches_of_a_lora_adapter():
    net = TokenClassifier()
    before = _state(net)
    batch, labels = token_data()
    model = BayesianNetwork(
        net, "categorical", random="lora", prior_center="pretrained", prior_scale=0.3, batch_size=32
    )
    assert model.random_names == ["head.lora_A", "head.lora_B"]
    mcmc = StochasticMCMC(SGHMC(model), num_samples=10, num_warmup=10, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(batch, labels)
    head = {key: value[:5] for key, value in batch.items()}
    assert mcmc.uncertainty(head).measure == "entropy"
    guide = _map(model, batch, labels, steps=50)
    assert guide.laplace_approximation(batch, labels, structure="kron", check_map=False).predict(head).mean.shape == (
        5,
        3,
    )
    assert _unchanged(net, before)


def test_a_dict_whose_tensors_disagree_on_their_rows_is_named():
    batch, labels = token_data()
    model = BayesianNetwork(TokenClassifier(), "categorical", random="lora")
    with pytest.raises(ModelError, match="share their first dimension"):
        model({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"][:10]}, labels)
