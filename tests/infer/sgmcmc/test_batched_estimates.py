"""Every chain's noise estimate and curvature at once, by plain autograd (``infer/gradients/batched.py``).

The gold: each chain's own, by ``torch.func`` transforms and the formulas written out here: the group gradients
:math:`h_g` of ``vmap(grad_and_value)``, their mean, and :math:`(1 - B/N)\\, m\\, \\mathrm{var}_G(h_g) / B`; the
Hessian-vector product as ``vjp`` of ``grad``. In float64, to rounding, for the bridge's log posterior, the control
variate and the control variate in warm-up's dense metric, with the prior's terms apart or not, for per-chain and
shared minibatches.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, grad_and_value, vjp, vmap

from pyro_scalable.bridge.model import Batch, ModelBridge
from pyro_scalable.infer.full_data import full_data_gradient
from pyro_scalable.infer.gradients import AffineMap, ControlledDensity, WhitenedDensity
from pyro_scalable.infer.gradients import estimate as estimate_module
from pyro_scalable.infer.gradients.batched import batched_hvp
from pyro_scalable.infer.gradients.estimate import chain_indices, chains_estimate
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.sgmcmc.curvature import hessian_product

from .test_control_variates import point, scaled_regression, small_data

NUM_DATA, CHAINS = 200, 3
EXACT = {"rtol": 1e-10, "atol": 1e-10}


def density(wrapper: str, bridge: ModelBridge):
    fn = bridge.log_posterior_fn
    if wrapper == "plain":
        return fn
    centre = point([0.6, -1.1], 0.6)
    fn = ControlledDensity(fn, full_data_gradient(bridge, centre))
    if wrapper == "controlled, dense metric":
        scale = torch.linalg.cholesky(torch.eye(3, dtype=torch.float64) + 0.3)
        affine = AffineMap(torch.tensor([0.4, -0.9, 0.1], dtype=torch.float64), scale)
        fn = WhitenedDensity(fn, ParameterLayout({k: v.shape for k, v in centre.items()}), affine)
    return fn


def chains_and_batch(size: int, shared: bool, bridge: ModelBridge):
    g = torch.Generator().manual_seed(5)
    latents = {"w": torch.randn(CHAINS, 2, generator=g, dtype=torch.float64), "scale": torch.randn(CHAINS, generator=g)}
    latents["scale"] = latents["scale"].double() * 0.3
    draws = [torch.randperm(NUM_DATA, generator=g)[:size] for _ in range(1 if shared else CHAINS)]
    indices = draws[0] if shared else torch.stack(draws)
    return latents, Batch({"data": indices}, bridge.args, {})


def own_noise_estimate(fn, latents: dict, batch: Batch):
    """One chain's gradient, value and noise diagonal by ``vmap(grad_and_value)`` over its groups of examples."""
    examples, in_dims, population, group = fn.examples(batch)
    per_grads, per_values = vmap(grad_and_value(fn), in_dims=(None, in_dims))(latents, examples)
    size = per_values.shape[0] * group
    shrink = (1.0 - size / population) * group / size
    means = {name: g.mean(0) for name, g in per_grads.items()}
    noise = {name: g.var(0, correction=1) * shrink for name, g in per_grads.items()}
    return means, per_values.mean(), noise, size


@pytest.mark.parametrize("apart", [False, True], ids=["whole per group", "prior's terms apart"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-chain minibatches", "one shared minibatch"])
@pytest.mark.parametrize("size", [10, 64])  # single examples; groups of two
@pytest.mark.parametrize("wrapper", ["plain", "controlled", "controlled, dense metric"])
def test_every_chains_noise_estimate_at_once_is_each_chains_own(wrapper, size, shared, apart, monkeypatch):
    if apart:  # the split, here on 3 coordinates (the default: from 10,000)
        monkeypatch.setattr(estimate_module, "SHARED_FROM", 0)
    bridge = ModelBridge(scaled_regression, small_data(NUM_DATA))
    fn = density(wrapper, bridge)
    latents, batch = chains_and_batch(size, shared, bridge)
    batched = chains_estimate(fn, latents, batch, noise=True)
    for c in range(CHAINS):
        own = {name: x[c] for name, x in latents.items()}
        grads, value, noise, count = own_noise_estimate(fn, own, Batch(chain_indices(batch.indices, c), *batch[1:]))
        torch.testing.assert_close(batched.log_posterior[c], value, **EXACT)
        for name in own:
            torch.testing.assert_close(batched.grads[name][c], grads[name], **EXACT)
            torch.testing.assert_close(batched.noise_variance[name][c], noise[name], **EXACT)
            assert float(noise[name].min()) > 0  # a noise there is to estimate (not zero on both sides)
        assert float(batched.num_examples[c]) == count
    assert not bool(batched.diverging.any())


@pytest.mark.parametrize("shared", [False, True], ids=["per-chain minibatches", "one shared minibatch"])
@pytest.mark.parametrize("wrapper", ["plain", "controlled", "controlled, dense metric"])
def test_every_chains_hessian_vector_product_at_once_is_each_chains_own(wrapper, shared):
    """Two backward passes over all chains against ``vjp`` of ``grad`` per chain; then warm-up's power iteration in a
    per-chain metric (a scalar for one site, a vector for the other), normalised per chain."""
    bridge = ModelBridge(scaled_regression, small_data(NUM_DATA))
    fn = density(wrapper, bridge)
    latents, batch = chains_and_batch(10, shared, bridge)
    g = torch.Generator().manual_seed(6)
    tangents = {name: torch.randn(x.shape, generator=g, dtype=torch.float64) for name, x in latents.items()}
    metric = {
        "w": torch.rand(CHAINS, 2, generator=g, dtype=torch.float64) + 0.5,
        "scale": torch.rand(CHAINS, generator=g, dtype=torch.float64) + 0.5,
    }
    products = batched_hvp(fn, latents, batch, tangents)
    powered = hessian_product(fn, latents, batch, tangents, metric, iterations=3, chains=True)
    for c in range(CHAINS):
        own = {name: x[c] for name, x in latents.items()}
        own_batch = Batch(chain_indices(batch.indices, c), *batch[1:])
        (gold,) = vjp(grad(lambda z, b=own_batch: fn(z, b)), own)[1]({name: v[c] for name, v in tangents.items()})
        own_powered = hessian_product(
            fn,
            own,
            own_batch,
            {name: v[c] for name, v in tangents.items()},
            {name: m[c] for name, m in metric.items()},
            iterations=3,
        )
        for name in own:
            torch.testing.assert_close(products[name][c], gold[name], **EXACT)
            torch.testing.assert_close(powered[name][c], own_powered[name], **EXACT)
        assert float(gold["w"].abs().max()) > 1e-3  # a curvature there is to measure
