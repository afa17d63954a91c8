"""Gold tier: the linearisation floor (GGN pass, layer plan, GGN-vector products) against brute force."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_scalable.infer import AutoLinearizedLaplace
from pyro_scalable.infer.linearized.ggn import GGNDiagonal, ggn_pass
from pyro_scalable.infer.linearized.layout import ParameterLayout
from tests.infer.linearized.nets import (
    LIKELIHOODS,
    MLP,
    brute_force_jacobian,
    ggn_data,
    ggn_setup,
    hessian_lambda,
    random_latents,
)


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
def test_ggn_pass_diagonal_equals_brute_force(likelihood):
    model, latents, x, y, _, ggn = ggn_setup(likelihood)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="diag", map_latents=latents, check_map=False, chunk_size=16
    )
    fit = ggn_pass(posterior.net, posterior.theta_star, GGNDiagonal())
    assert torch.allclose(fit.curvature, ggn.diagonal(), atol=1e-10 * float(ggn.abs().max()))
    assert torch.allclose(fit.gradient, posterior.fit.gradient) and fit.num_points == x.shape[0]


def test_layout_groups_one_per_site_parameter_or_all():
    layout = ParameterLayout({"a": torch.Size([2, 2]), "b": torch.Size([3])})
    assert layout.groups("scalar")[0].tolist() == [0] * 7 and layout.groups("scalar")[1] == ["all"]
    assert layout.groups("site")[0].tolist() == [0, 0, 0, 0, 1, 1, 1] and layout.groups("site")[1] == ["a", "b"]
    assert layout.groups("diagonal")[0].tolist() == list(range(7))
    with pytest.raises(ValueError, match="groups"):
        layout.groups("layer")


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
def test_matrix_free_ggn_vector_products(likelihood):
    model, latents, x, y, _, ggn = ggn_setup(likelihood)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="diag", map_latents=latents, check_map=False, chunk_size=16
    )
    v = torch.randn(3, ggn.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.allclose(posterior.net.ggn_vp(posterior.theta_star, v), v @ ggn)


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
def test_one_vector_ggn_product_by_forward_mode_equals_brute_force(likelihood):
    """One vector (a CG iteration of the MAP check) takes one forward pass on dual numbers and its backward."""
    model, latents, x, y, _, ggn = ggn_setup(likelihood)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="diag", map_latents=latents, check_map=False, chunk_size=16
    )
    net, v = posterior.net, torch.randn(1, ggn.shape[0], generator=torch.Generator().manual_seed(5), dtype=ggn.dtype)
    assert net.dual is None
    with torch.no_grad():  # as the MAP check calls it
        product = net.ggn_vp(posterior.theta_star, v)
    assert net.dual is True  # the forward-mode path ran
    torch.testing.assert_close(product, v @ ggn, rtol=1e-10, atol=1e-12 * float(ggn.abs().max()))
    net.dual = False  # the batched JVP and VJP give the same product
    torch.testing.assert_close(net.ggn_vp(posterior.theta_star, v), product, rtol=1e-10, atol=0)


def test_empirical_fisher_is_the_sum_of_score_outer_products():
    model, latents, x, y, jacobian, _ = ggn_setup("categorical")
    f, _ = brute_force_jacobian(model, latents, x)
    score = torch.nn.functional.one_hot(y, 3).double() - torch.softmax(f, -1)
    per_example = torch.einsum("nm,nmd->nd", score, jacobian)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="full", curvature="ef", map_latents=latents, check_map=False, chunk_size=16
    )
    assert torch.allclose(posterior.fit.curvature.to_dense(), per_example.T @ per_example)


class _NetOnAllRows(MLP):
    """The net runs on all N inputs and the plate's indices pick its outputs (a common way to write it)."""

    def forward(self, x, y=None):
        f = self.net(x)
        with pyro.plate("data", x.shape[0], subsample_size=self.batch_size) as idx:
            return pyro.sample("y", dist.Categorical(logits=f[idx]), obs=None if y is None else y[idx])


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_layers_run_on_all_rows_stay_on_the_fast_path(structure):
    x, y = ggn_data("categorical")
    model = _NetOnAllRows(LIKELIHOODS["categorical"], "categorical", batch_size=16)
    latents = random_latents(model, x)
    f, jacobian = brute_force_jacobian(model, latents, x)
    ggn = torch.einsum("nmd,nmk,nke->de", jacobian, hessian_lambda("categorical", f), jacobian)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure=structure, map_latents=latents, check_map=False, chunk_size=16
    )
    assert posterior.fit.rest.numel() == 0 and all(p.plate == "data" for p in posterior.fit.layers)
    dense = posterior.fit.curvature.to_dense()
    if structure == "full":
        assert torch.allclose(dense, ggn)
    elif structure == "diag":
        assert torch.allclose(dense.diagonal(), ggn.diagonal())
    x_test = torch.randn(6, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _, j_test = brute_force_jacobian(model, latents, x_test)
    covariance = torch.einsum("nmd,de,nke->nmk", j_test, torch.linalg.inv(posterior.precision.to_dense()), j_test)
    assert torch.allclose(posterior.predict(x_test).covariance, covariance, atol=1e-12, rtol=1e-9)


class _Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.skip = torch.nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        out = self.conv2(torch.relu(self.conv1(x)))
        return torch.relu(out + (x if self.skip is None else self.skip(x)))


class _ResNet(pyro.nn.PyroModule):
    """ResNet-18's CIFAR layout at width 8, float32, N(0, 1/fan_in) priors on every weight."""

    def __init__(self):
        super().__init__()
        blocks, cin = [torch.nn.Conv2d(3, 8, 3, 1, 1, bias=False), torch.nn.ReLU()], 8
        for stage, mult in enumerate((1, 2, 4, 8)):
            for k in range(2):
                blocks.append(_Block(cin, 8 * mult, 2 if stage > 0 and k == 0 else 1))
                cin = 8 * mult
        self.body = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(cin, 10)
        pyro.nn.module.to_pyro_module_(self.body)
        pyro.nn.module.to_pyro_module_(self.head)
        self.init = {name: value.detach().clone() for name, value in self.named_parameters()}  # torch's own init
        for name, value in list(self.named_parameters()):
            *path, attr = name.split(".")
            fan_in = value[0].numel() if value.dim() > 1 else 1
            prior = dist.Normal(0.0, fan_in**-0.5).expand(value.shape).to_event(value.dim())
            setattr(self.get_submodule(".".join(path)), attr, pyro.nn.PyroSample(prior))

    def forward(self, x, y=None):
        plate = pyro.plate("data", x.shape[0], subsample_size=64)
        f = self.head(self.body(x[plate.indices]).mean((-2, -1)))
        with plate as idx:
            return pyro.sample("y", dist.Categorical(logits=f), obs=None if y is None else y[idx])


def test_float32_convolutions_are_recognised_despite_rounding():
    """A float32 layer's assembled gradient differs from autograd's by rounding, which an elementwise comparison
    took for a wrong layer on some convolutions of this network: each then took a forward pass per weight."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 3, 32, 32, generator=gen), torch.randint(10, (256,), generator=gen)
    model = _ResNet()
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="diag", map_latents=model.init, check_map=False, chunk_size=64
    )
    assert posterior.fit.rest.numel() == 0, sorted({posterior.net.layout.site_of(int(i)) for i in posterior.fit.rest})
    assert len(posterior.fit.layers) == 21
