r"""The linearised (GLM) predictive: :math:`f(x) \sim \mathcal N(f_* + J(\bar\theta - \theta_*),\ J H^{-1} J^\top)`.

No per-example Jacobian over all weights is formed. For a recorded layer with inputs :math:`\tilde a` and
:math:`B = \partial f/\partial z` (one backward pass per output, for every test point at once):

* K-FAC block :math:`H_\ell = (I\otimes D^{1/2})(Q_B\otimes Q_A)E(Q_B\otimes Q_A)^\top(I\otimes D^{1/2})`:
  :math:`[J H_\ell^{-1} J^\top]_{cc'} = \sum_k U_{ck} U_{c'k} w_k`, with :math:`U = B Q_B` and
  :math:`w_k = \sum_j (Q_A^\top D^{-1/2}\tilde a)_j^2 / E_{kj}`;
* diagonal block with inverse :math:`h_{kj}`: :math:`\sum_k B_{ck}B_{c'k} w_k`, :math:`w_k = \sum_j h_{kj}\tilde a_j^2`;
* sampled: the Monte-Carlo estimate from the stored samples (:mod:`~pyro_scalable.infer.laplace.sampled`);
* low rank: :math:`H^{-1} = P^{-1} - V V^\top`, so :math:`J H^{-1}J^\top = J P^{-1} J^\top - (JV)(JV)^\top` with
  :math:`JV` from :math:`k` Jacobian-vector products.

Other parameters use Jacobian-vector products with basis vectors; ``full`` assembles the rows (it is only
feasible for small :math:`d` anyway) and solves with the Cholesky factor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch
from pyro_scalable.infer.laplace.curvature import (
    _DiagPrecision,
    _FullPrecision,
    _KronPrecision,
    _LowRankPrecision,
)
from pyro_scalable.infer.laplace.ggn import (
    LayerPlan,
    _inputs,
    _layer_grad,
    _rest_jacobian,
    per_example,
    pullback,
)
from pyro_scalable.infer.laplace.likelihoods import Likelihood
from pyro_scalable.infer.laplace.network import NetworkFunction
from pyro_scalable.infer.laplace.sampled import SampledPrecision

__all__ = ["functional_covariance"]


def functional_covariance(
    net: NetworkFunction, theta: Tensor, precision, plans: list[LayerPlan], rest: Tensor, batch: Batch
) -> tuple[Tensor, Tensor, Likelihood]:
    """``f(x, theta)``, ``J H^{-1} J^T`` and the likelihood on ``batch``: ``(points, outputs)``, ``(.., outputs)``."""
    if isinstance(precision, SampledPrecision):
        f, covariance = precision.functional_covariance(net, theta.detach(), batch)
        return f, covariance, net.outputs(theta.detach(), batch).likelihood
    leaf = theta.detach().requires_grad_(True)
    out = net.outputs(leaf, batch, layers=True)
    f = out.f
    points, width = f.shape
    layers = [out.raw.layers[p.position] for p in plans]
    outputs = [layer.outputs for layer in layers]
    inputs = [_inputs(p.rows(layer.inputs, batch), p) for layer, p in zip(layers, plans)]
    # B[k]: (points, outputs, out_k[, locations]), the derivative of every output w.r.t. layer k's pre-activation
    per_output: list[list[Tensor]] = [[] for _ in plans]
    if plans:
        for c in range(width):
            cotangent = torch.zeros_like(f)
            cotangent[:, c] = 1.0
            grads = pullback(f, outputs, cotangent)
            for k, (g, plan) in enumerate(zip(grads, plans)):
                per_output[k].append(_layer_grad(plan.rows(g, batch), plan))
    derivatives = [torch.stack(g, dim=1) for g in per_output]
    rest_jacobian = _rest_jacobian(net, theta.detach(), rest, batch) if rest.numel() else None
    f = f.detach()
    if isinstance(precision, _FullPrecision):
        rows = f.new_zeros(points, width, net.layout.num_params)
        for plan, b, a in zip(plans, derivatives, inputs):
            rows[:, :, plan.index.flatten()] = _per_output(b, a, plan).flatten(2)
        if rest_jacobian is not None:
            rows[:, :, rest] = rest_jacobian
        return f, rows @ precision.solve(rows).mT, out.likelihood
    covariance = f.new_zeros(points, width, width)
    if isinstance(precision, _KronPrecision):
        for block, b, a, plan in zip(precision.blocks, derivatives, inputs, plans):
            if plan.conv:
                jacobian = _per_output(b, a, plan) / block.root_prior  # (points, outputs, out, in')
                rotated = block.block.output_eigenvectors.T @ jacobian @ block.input_vectors
                covariance += torch.einsum("pmkj,pnkj,kj->pmn", rotated, rotated, block.eigenvalues.reciprocal())
                continue
            rotated = b @ block.block.output_eigenvectors
            inner = ((a / block.root_prior) @ block.input_vectors) ** 2
            weights = inner @ block.eigenvalues.reciprocal().T
            covariance += torch.einsum("pmk,pnk,pk->pmn", rotated, rotated, weights)
        rest_inverse = precision.rest.reciprocal()
    else:
        inverse = (
            precision.diagonal.reciprocal()
            if isinstance(precision, _DiagPrecision)
            else precision.prior_precision.reciprocal()
        )
        for plan, b, a in zip(plans, derivatives, inputs):
            if plan.conv:
                jacobian = _per_output(b, a, plan)
                covariance += torch.einsum("pmkj,pnkj,kj->pmn", jacobian, jacobian, inverse[plan.index])
                continue
            weights = (a**2) @ inverse[plan.index].T
            covariance += torch.einsum("pmk,pnk,pk->pmn", b, b, weights)
        rest_inverse = inverse[rest]
    if rest_jacobian is not None:
        covariance += torch.einsum("pmr,pnr,r->pmn", rest_jacobian, rest_jacobian, rest_inverse)
    if isinstance(precision, _LowRankPrecision):
        shrink = (precision.squares / (1 + precision.squares)).sqrt()
        factors = (precision.basis * shrink / precision.root_prior.unsqueeze(-1)).T.contiguous()
        _, products = net.jvp(theta.detach(), factors, batch)  # (k, points, outputs)
        covariance -= torch.einsum("kpm,kpn->pmn", products, products)
    return f, covariance, out.likelihood


def _per_output(derivative: Tensor, inputs: Tensor, plan: LayerPlan) -> Tensor:
    # (points, outputs, out[, L]) and (points, in'[, L]) -> (points, outputs, out, in')
    return per_example(derivative.movedim(1, 0), inputs, plan).movedim(0, 1)
