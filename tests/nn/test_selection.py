"""Which parameters ``random=`` selects, and the errors that name the choices."""

from __future__ import annotations

import pytest
from torch import nn

from pyro_scalable.nn import BayesianNetwork, LastLayers, select_parameters
from tests.nn.networks import TokenClassifier, mlp


def test_all_and_last_layers_in_the_networks_order():
    net = mlp()
    assert select_parameters(net, "all") == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert select_parameters(net, "last_layer") == ["4.weight", "4.bias"]
    assert select_parameters(net, LastLayers(2)) == ["2.weight", "2.bias", "4.weight", "4.bias"]


def test_names_patterns_layer_paths_types_lists_and_callables():
    net = mlp(batch_norm=True)
    assert select_parameters(net, "0.weight") == ["0.weight"]
    assert select_parameters(net, "*.bias") == ["0.bias", "1.bias", "3.bias", "4.bias", "6.bias"]
    assert select_parameters(net, "3") == ["3.weight", "3.bias"]
    assert select_parameters(net, nn.BatchNorm1d) == ["1.weight", "1.bias", "4.weight", "4.bias"]
    assert select_parameters(net, ["0", LastLayers(1)]) == ["0.weight", "0.bias", "6.weight", "6.bias"]
    assert select_parameters(net, lambda name, p: p.dim() == 2) == ["0.weight", "3.weight", "6.weight"]


def test_lora_selects_the_adapters_only():
    assert select_parameters(TokenClassifier(), "lora") == ["head.lora_A", "head.lora_B"]


@pytest.mark.parametrize(
    "random, says",
    [
        ("fc9", "random='fc9' matches no parameter"),
        (["0.weight", "nope"], "random='nope' matches no parameter"),
        ([], "random=[] selects no parameter"),
        ("lora", "no parameter name holds 'lora_'"),
        (nn.Conv2d, "random=Conv2d matches no module"),
        (lambda name, p: False, "selects no parameter"),
    ],
)
def test_selecting_nothing_is_an_error_naming_the_choices(random, says):
    with pytest.raises(ValueError, match="the network's parameters are 0.weight, 0.bias") as error:
        BayesianNetwork(mlp(), random=random)
    assert says in str(error.value)
    assert "LastLayers(k)" in str(error.value) and "its layers 0, 2, 4" in str(error.value)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="LastLayers"):
        LastLayers(0)
    with pytest.raises(TypeError, match="random must be"):
        select_parameters(mlp(), 3)
    with pytest.raises(ValueError, match="likelihood must be one of 'normal', 'bernoulli', 'categorical'"):
        BayesianNetwork(mlp(), "poisson")
    with pytest.raises(ValueError, match="prior_center must be one of"):
        BayesianNetwork(mlp(), prior_center="mean")
    with pytest.raises(ValueError, match="prior_scale has no key for the random parameter '0.weight'"):
        BayesianNetwork(mlp(), prior_scale={"4": 1.0})
    with pytest.raises(ValueError, match="has no parameters"):
        BayesianNetwork(nn.Tanh())
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        BayesianNetwork(lambda x: x)
