"""Gold tier: the pieces of the one GGN pass that the diag and kron fits use, against brute force."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from pyro_scalable.infer import AutoLinearizedLaplace
from pyro_scalable.infer.linearized.jacobians import BatchedBackward, pullback, pullbacks
from tests.infer.linearized.nets import MLP, brute_force_jacobian, hessian_lambda, random_latents


def _wide_problem(n=40, width=300):
    # an input wider than the Gram split of the kron factors (256): the input factor is summed by its lower blocks
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, width, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    model = MLP((width, 4, 3), "categorical", batch_size=16)
    return model, random_latents(model, x), x, y


def test_kron_factors_of_a_wide_layer_equal_their_sums_over_the_data():
    model, latents, x, y = _wide_problem()
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="kron", map_latents=latents, check_map=False, chunk_size=16
    )
    first, last = posterior.fit.curvature.blocks
    inputs = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    torch.testing.assert_close(first.input_factor, inputs.T @ inputs, rtol=1e-12, atol=1e-12)
    # the last layer's outputs are f: its g_ic are the columns of Λ_i^{1/2}, so B = (1/N) Σ_i Λ_i
    f, _ = brute_force_jacobian(model, latents, x)
    torch.testing.assert_close(last.output_factor, hessian_lambda("categorical", f).mean(0), rtol=1e-12, atol=1e-14)


def test_diag_of_a_wide_layer_equals_the_brute_force_ggn_diagonal():
    model, latents, x, y = _wide_problem()
    f, jacobian = brute_force_jacobian(model, latents, x)
    ggn = torch.einsum("nmd,nmk,nkd->d", jacobian, hessian_lambda("categorical", f), jacobian)
    posterior = AutoLinearizedLaplace(model).laplace_approximation(
        x, y, structure="diag", map_latents=latents, check_map=False, chunk_size=16
    )
    torch.testing.assert_close(posterior.fit.curvature.diagonal, ggn, rtol=1e-10, atol=1e-12 * float(ggn.max()))


def test_a_fit_that_does_not_read_the_gradient_leaves_it_to_its_first_use_with_the_same_value():
    model, latents, x, y = _wide_problem(width=5)
    common = dict(map_latents=latents, chunk_size=16)
    guide = AutoLinearizedLaplace(model)
    with pytest.warns(UserWarning):  # random latents are not a MAP: the check (which reads the gradient) says so
        checked = guide.laplace_approximation(x, y, structure="diag", check_map=True, **common)
    unchecked = guide.laplace_approximation(x, y, structure="diag", check_map=False, **common)
    assert not callable(checked.fit._gradient) and callable(unchecked.fit._gradient)  # in the pass / not yet
    torch.testing.assert_close(unchecked.log_marginal_likelihood(), checked.log_marginal_likelihood(), rtol=0, atol=0)
    assert callable(unchecked.fit._gradient)  # the evidence of a diagonal H does not read it
    torch.testing.assert_close(unchecked.fit.gradient, checked.fit.gradient, rtol=1e-12, atol=0)
    assert unchecked.newton_gain() == pytest.approx(checked.newton_gain(), rel=1e-12)


def _graph(kind: str):
    g = torch.Generator().manual_seed(0)
    if kind == "conv":
        x = torch.randn(6, 2, 8, 8, generator=g, dtype=torch.float64)
        w = torch.randn(4, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
        z = F.conv2d(x, w, padding=1)
        f = F.max_pool2d(torch.relu(z), 2).flatten(1) @ torch.randn(64, 3, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        w = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
        z = x @ w
        f = getattr(torch, kind)(z) @ torch.randn(7, 3, generator=g, dtype=torch.float64)
    return f, z, torch.randn((4,) + f.shape, generator=g, dtype=torch.float64)


# ReLU's backward has a batching rule; tanh's, a convolution's and a max-pooling's have none (the batched path
# would loop over the cotangents inside them)
@pytest.mark.parametrize(("kind", "batches"), [("relu", True), ("tanh", False), ("conv", False)])
def test_batched_pullbacks_equal_one_backward_per_cotangent_and_fall_back_without_batching_rules(kind, batches):
    f, z, cotangents = _graph(kind)
    batched = BatchedBackward()
    (stacked,) = pullbacks(f, [z], cotangents, batched)
    expected = torch.stack([pullback(f, [z], u)[0] for u in cotangents])
    torch.testing.assert_close(stacked, expected, rtol=1e-12, atol=1e-12)
    assert batched.enabled is batches
    (again,) = pullbacks(f, [z], cotangents, batched)  # the decision is kept for the pass
    torch.testing.assert_close(again, expected, rtol=1e-12, atol=1e-12)


class _Warns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        warnings.warn("raised in the backward", RuntimeWarning, stacklevel=1)
        return 2 * grad


def test_the_first_batched_backward_passes_on_warnings_other_than_torchs_fallback_notice():
    z = torch.randn(4, 3, dtype=torch.float64, requires_grad=True) * 1.0
    with pytest.warns(RuntimeWarning, match="raised in the backward"):
        (stacked,) = pullbacks(_Warns.apply(z), [z], torch.ones(2, 4, 3, dtype=torch.float64), BatchedBackward())
    torch.testing.assert_close(stacked, torch.full((2, 4, 3), 2.0, dtype=torch.float64))
