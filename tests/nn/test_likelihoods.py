"""The likelihoods: each row one term, whatever the output's shape; a user's own law; the errors."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

from pyro_scalable.nn import BayesianNetwork


def _at_module(model, *args):
    """The model's trace with its random sites at the module's own values (then the output is the module's)."""
    return pyro.poutine.trace(pyro.poutine.condition(model, data=model.pretrained)).get_trace(*args)


def test_a_user_likelihood_and_several_outputs_per_row():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    x, counts = torch.randn(30, 3), torch.poisson(torch.ones(30, 2))
    model = BayesianNetwork(net, lambda f: dist.Poisson(f.exp()), batch_size=None)
    trace = _at_module(model, x, counts)
    assert trace.nodes["y"]["fn"].batch_shape == (30,) and trace.nodes["y"]["fn"].event_shape == (2,)
    expected = dist.Poisson(net(x).exp()).log_prob(counts).sum()
    torch.testing.assert_close(trace.nodes["y"]["fn"].log_prob(counts).sum(), expected)


def test_a_sequence_of_logits_is_one_event_per_row_and_scaled_by_n_over_b():
    torch.manual_seed(0)
    net = nn.Linear(4, 5)  # (rows, tokens, 4) -> (rows, tokens, 5): a token classifier
    x, y = torch.randn(40, 7, 4), torch.randint(0, 5, (40, 7))
    model = BayesianNetwork(net, "categorical", random="bias", batch_size=10)
    trace = _at_module(model, x, y)
    trace.compute_log_prob()
    idx = trace.nodes["data"]["value"]
    expected = dist.Categorical(logits=net(x[idx])).log_prob(y[idx]).sum()
    assert trace.nodes["y"]["scale"] == 4.0 and trace.nodes["y"]["log_prob"].shape == (10,)  # N/B = 40/10
    torch.testing.assert_close(trace.nodes["y"]["log_prob_sum"], 4.0 * expected)


def test_multi_output_regression_with_a_fixed_noise():
    net = nn.Linear(3, 2)
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    model = BayesianNetwork(net, "normal", noise_scale=0.5, batch_size=None)
    trace = _at_module(model, x, y)
    expected = dist.Normal(net(x), 0.5).log_prob(y).sum()
    torch.testing.assert_close(trace.nodes["y"]["fn"].log_prob(y).sum(), expected)
    assert "noise_scale" not in trace.nodes


def test_a_likelihood_that_is_not_a_pyro_law_or_not_by_row_is_named():
    x, y = torch.randn(20, 3), torch.randn(20)
    not_pyro = BayesianNetwork(nn.Linear(3, 1), lambda f: torch.distributions.Normal(f, 1.0), batch_size=None)
    with pytest.raises(TypeError, match="must return a Pyro distribution"):
        not_pyro(x, y)
    summed = BayesianNetwork(nn.Linear(3, 1), lambda f: dist.Normal(f.sum(), 1.0), batch_size=None)
    with pytest.raises(ValueError, match="does not start with the minibatch's 20 rows"):
        summed(x, y)
