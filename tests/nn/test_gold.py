"""Gold: the built model's log density equals the same network written by hand as a ``PyroModule``.

The hand-written models follow the tutorials: ``PyroSample`` priors on a ``PyroModule[nn.Sequential]`` (whose sites
are named ``"0.weight"``, ..., as ``BayesianNetwork`` names them), the data plate created first and the network run
on its indices, the likelihood inside it. Both are traced at the same latents and the same minibatch
(``poutine.replay``) in float64, and their log densities (N/B scaling included) agree to rounding.
"""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroSample

from pyro_scalable import ModelError
from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.nn import BayesianNetwork
from tests.nn.networks import mlp


def _hand_written(net, scales, centers, likelihood, noise=None):
    """``net`` as a PyroModule: each parameter named in ``scales`` a PyroSample, the others fixed."""
    body = copy.deepcopy(net)
    pyro.nn.module.to_pyro_module_(body)
    for name, value in list(body.named_parameters()):  # the fixed parameters: buffers, not pyro.param sites
        if name not in scales:
            path, _, leaf = name.rpartition(".")
            layer = body.get_submodule(path)
            delattr(layer, leaf)
            layer.register_buffer(leaf, value.detach())
    for name, scale in scales.items():
        path, _, leaf = name.rpartition(".")
        layer = body.get_submodule(path)
        shape = getattr(layer, leaf).shape
        delattr(layer, leaf)
        setattr(layer, leaf, PyroSample(dist.Normal(centers[name], scale).expand(shape).to_event(len(shape))))

    def model(x, y=None, batch_size=None):
        sigma = noise
        if likelihood == "normal" and noise is None:
            sigma = pyro.sample("noise_scale", dist.HalfNormal(torch.tensor(1.0, dtype=x.dtype)))
        data = pyro.plate("data", x.shape[0], subsample_size=batch_size)
        f = body(x[data.indices])
        with data:
            if likelihood == "normal":
                law = dist.Normal(f.squeeze(-1), sigma)
            elif likelihood == "bernoulli":
                law = dist.Bernoulli(logits=f.squeeze(-1))
            else:
                law = dist.Categorical(logits=f)
            return pyro.sample("y", law, obs=y[data.indices])

    return model


def _log_density(model, *args, **kwargs):
    return pyro.poutine.trace(model).get_trace(*args, **kwargs).log_prob_sum()


@pytest.mark.parametrize(
    "likelihood, outputs, random, prior_scale, prior_center, noise",
    [
        ("normal", 1, "all", 0.7, "zero", None),
        ("normal", 1, "last_layer", "fan_in", "pretrained", 0.3),
        ("bernoulli", 1, ["0", "4.bias"], {"0": 2.0, "*": 0.5}, "zero", None),
        ("categorical", 3, "*.weight", 1.5, "pretrained", None),
    ],
)
def test_log_density_equals_the_hand_written_pyro_module(likelihood, outputs, random, prior_scale, prior_center, noise):
    torch.set_default_dtype(torch.float64)
    try:
        net = mlp((3, 8, 8, outputs), seed=1)
        x = torch.randn(40, 3)
        y = {"normal": torch.randn(40), "bernoulli": torch.bernoulli(torch.full((40,), 0.5))}.get(
            likelihood, torch.randint(0, 3, (40,))
        )
        built = BayesianNetwork(
            net,
            likelihood,
            random=random,
            prior_scale=prior_scale,
            prior_center=prior_center,
            noise_scale=noise,
            batch_size=16,
        )
        parameters = dict(net.named_parameters())
        centers = {
            name: parameters[name].detach().clone() if prior_center == "pretrained" else torch.tensor(0.0)
            for name in built.random_names
        }
        hand = _hand_written(net, built.prior_scales, centers, likelihood, noise)
        for seed in range(3):  # three draws of the latents and of the minibatch
            pyro.set_rng_seed(seed)
            trace = pyro.poutine.trace(built).get_trace(x, y)
            replayed = pyro.poutine.trace(pyro.poutine.replay(hand, trace=trace)).get_trace(x, y, batch_size=16)
            assert trace.nodes["data"]["value"].shape == (16,)
            torch.testing.assert_close(replayed.log_prob_sum(), trace.log_prob_sum(), rtol=1e-12, atol=1e-10)
            latents = [n for n, s in trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]]
            assert latents[-1] == "data" and set(latents[:-1]) == set(built.random_names) | (
                {"noise_scale"} if likelihood == "normal" and noise is None else set()
            )
        if prior_scale == "fan_in":
            assert built.prior_scales == pytest.approx({"4.weight": 8**-0.5, "4.bias": 1.0}, rel=1e-15)
    finally:
        torch.set_default_dtype(torch.float32)


def test_batch_norm_reads_its_running_statistics():
    net = mlp(batch_norm=True)
    net.train()
    built = BayesianNetwork(net, "normal", random="last_layer", noise_scale=1.0, batch_size=None)
    assert not net.training
    x = torch.randn(10, 3)
    at_module = pyro.poutine.condition(built, data=built.pretrained)
    trace = pyro.poutine.trace(at_module).get_trace(x, torch.zeros(10))
    expected = dist.Normal(net(x).squeeze(-1), 1.0).log_prob(torch.zeros(10)).sum()
    torch.testing.assert_close(trace.nodes["y"]["fn"].log_prob(torch.zeros(10)).sum(), expected)
    net.train()
    with pytest.raises(ModelError, match="training mode"):
        built(x, torch.zeros(10))


def test_sghmc_draws_equal_the_hand_written_models_draws():
    net = mlp(seed=2)
    x, y = torch.randn(64, 3), torch.randn(64)
    built = BayesianNetwork(net, "normal", random="last_layer", noise_scale=0.5, batch_size=16)
    parameters = dict(net.named_parameters())
    hand = _hand_written(net, built.prior_scales, dict.fromkeys(built.random_names, torch.tensor(0.0)), "normal", 0.5)

    def draws(model, **kwargs):
        kernel = SGHMC(model, step_size=1e-3, friction=1.0, init_strategy=built.init_to_pretrained)
        return StochasticMCMC(kernel, num_samples=20, num_chains=2, seed=0, progress_bar=False).run(x, y, **kwargs)

    ours, theirs = draws(built).get_samples(), draws(hand, batch_size=16).get_samples()
    assert ours.keys() == theirs.keys() == {"4.weight", "4.bias"}
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in parameters.values())
