r"""One pass over the full data at the MAP: the GGN (or empirical Fisher) in a chosen structure.

With :math:`\Lambda_i = L_i L_i^\top` (see ``likelihoods``), :math:`G = \sum_i \sum_c r_{ic} r_{ic}^\top` where
:math:`r_{ic} = J_i^\top L_i e_c` is the gradient of :math:`L_{i,:c}^\top f(x_i, \theta)`; the empirical Fisher
uses one column, the score :math:`\partial \log p(y_i\mid f_i)/\partial f_i`. For a recorded layer
:math:`z_i = W a_i + b` (bias folded in: :math:`\tilde a_i = (a_i, 1)`), :math:`r_{ic}` restricted to the layer is
:math:`g_{ic} \otimes \tilde a_i` with :math:`g_{ic} = \partial (L_{i,:c}^\top f_i)/\partial z_i`, and one
backward pass per column gives :math:`g_{ic}` for every example at once. From these:

* ``diag``: :math:`\sum_{i,c} g_{ic}^2 \otimes \tilde a_i^2` — exact, no per-example Jacobian;
* ``kron``: :math:`B = \frac1N\sum_{i,c} g_{ic} g_{ic}^\top`, :math:`A = \sum_i \tilde a_i \tilde a_i^\top`
  (K-FAC; exact when :math:`\sum_c g_{ic}g_{ic}^\top` is the same for every example, e.g. a one-layer net with
  a Gaussian likelihood). A convolution is the same affine map applied at :math:`L` locations to unfolded
  patches; its factors sum over locations too, with :math:`B` divided by :math:`NL` (KFC, Grosse & Martens
  2016), and its per-example rows are :math:`\sum_l g_{icl}\otimes\tilde a_{il}`;
* ``full``: the rows :math:`r_{ic}` assembled per chunk and accumulated as :math:`R^\top R`;
* ``low_rank``: the top eigenpairs of :math:`G` by a randomised eigendecomposition (Halko et al. 2011) built
  from matrix-free GGN-vector products :math:`J^\top \Lambda J v` (``torch.func`` ``jvp`` then ``vjp``).

Parameters outside recorded layers (a global offset, an embedding) get their rows from Jacobian-vector products
with basis vectors, which is exact and cheap for the few scalars such sites usually hold. Each recorded layer is
checked once against autograd; one that fails (a weight used twice, say) is treated the same way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pyro_scalable.infer.laplace.curvature import (
    Curvature,
    DiagCurvature,
    FullCurvature,
    KronBlock,
    KronCurvature,
    LowRankCurvature,
)
from pyro_scalable.infer.laplace.network import NetworkFunction

__all__ = ["DataFit", "LayerPlan", "fit_curvature", "layer_plan"]

Structure = Literal["full", "diag", "kron", "low_rank"]
_REST_WARNING = 2048


@dataclass
class LayerPlan:
    """A recorded layer (its position among the recorded calls) and its flat indices, ``(out, in [+1])``."""

    position: int
    weight: str
    bias: str | None
    index: Tensor
    conv: bool = False
    plate: str | None = None  # set when the layer runs on all N rows and the model indexes its output afterwards

    def rows(self, tensor: Tensor, batch) -> Tensor:
        """The rows of a layer tensor that belong to the points of ``batch``."""
        return tensor if self.plate is None else tensor[batch.indices[self.plate]]


@dataclass
class DataFit:
    r"""What the posterior needs from the data at :math:`\theta_*`."""

    curvature: Curvature
    log_likelihood: Tensor  # log p(D | theta*)
    gradient: Tensor  # grad_theta log p(D | theta*), flat
    num_points: int
    layers: list[LayerPlan]
    rest: Tensor  # flat indices outside recorded layers
    sum_squares: Tensor | None = None  # Normal: sum of squared residuals (observed, unmasked)
    num_observations: Tensor | None = None  # Normal: number of observed scalars


def layer_plan(net: NetworkFunction, theta: Tensor) -> tuple[list[LayerPlan], Tensor]:
    """Which recorded layers give exact per-example rows, and the flat indices left to the basis products."""
    batch = next(net.batches())
    theta = theta.detach().requires_grad_(True)
    out = net.outputs(theta, batch, layers=True)
    counts: dict[str, int] = {}
    for layer in out.raw.layers:
        for name in (layer.weight, layer.bias):
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
    plans: list[LayerPlan] = []
    points = out.f.shape[0]
    # A model may run its net on all N inputs and index the output with the plate's indices afterwards: the
    # layer's rows are then the data points, picked by the chunk's indices.
    plate = next(iter(net.bridge.plates), None)
    full_rows = out.raw.plate_sizes.get(plate) if plate is not None and plate in batch.indices else None
    for position, layer in enumerate(out.raw.layers):
        rows = layer.inputs.shape[0]
        if layer.weight not in net.layout.slots or counts[layer.weight] > 1:
            continue
        if rows != layer.outputs.shape[0] or rows not in (points, full_rows):
            continue
        indexed = plate if rows != points else None
        weight = net.layout.index(layer.weight, theta.device)
        weight = weight.T if layer.layout == "in_out" and weight.dim() == 2 else weight
        weight = weight.reshape(1, -1) if weight.dim() == 1 else weight.reshape(weight.shape[0], -1)
        bias = layer.bias if layer.bias in net.layout.slots and counts.get(layer.bias, 0) == 1 else None
        index = weight if bias is None else torch.cat([weight, net.layout.index(bias, theta.device).reshape(-1, 1)], 1)
        plans.append(LayerPlan(position, layer.weight, bias, index, layer.layout == "conv", indexed))
    plans = _verified(plans, out, theta, batch)
    covered = torch.zeros(net.layout.num_params, dtype=torch.bool, device=theta.device)
    for plan in plans:
        covered[plan.index.flatten()] = True
    return plans, torch.nonzero(~covered).flatten()


def _verified(plans: list[LayerPlan], out, theta: Tensor, batch) -> list[LayerPlan]:
    if not plans:
        return plans
    generator = torch.Generator(device=theta.device).manual_seed(0)
    cotangent = torch.randn(out.f.shape, generator=generator, dtype=out.f.dtype, device=out.f.device)
    outputs = [out.raw.layers[p.position].outputs for p in plans]
    grads = pullback(out.f, [theta] + outputs, cotangent)
    kept = []
    for plan, grad in zip(plans, grads[1:]):
        inputs = _inputs(plan.rows(out.raw.layers[plan.position].inputs, batch), plan)
        grad = _layer_grad(plan.rows(grad, batch), plan)
        # the sum over examples of g_i ⊗ ã_i, without forming the per-example products
        assembled = torch.einsum("nol,nil->oi", grad, inputs) if plan.conv else grad.T @ inputs
        reference = grads[0][plan.index]
        if torch.allclose(assembled, reference, rtol=1e-4, atol=1e-6 * float(reference.abs().max()) + 1e-12):
            kept.append(plan)
    return kept


def pullback(output: Tensor, inputs: list[Tensor], cotangent: Tensor) -> tuple[Tensor, ...]:
    """``cotangentᵀ ∂output/∂inputs`` by reverse mode, keeping the graph for the next column."""
    # Differentiating a scalar: torch.autograd.grad with explicit grad_outputs imports sympy on its first call
    # in a process (about 1.5 s and 300 MB), a one-off that the inner product avoids.
    return torch.autograd.grad((output * cotangent).sum(), inputs, retain_graph=True)


def _layer_grad(grad: Tensor, plan: LayerPlan) -> Tensor:
    """The gradient at a layer's output as ``(points, out)``, or ``(points, out, locations)`` for a convolution."""
    if plan.conv:
        return grad.flatten(2)
    return grad.unsqueeze(-1) if grad.dim() == 1 else grad


def _inputs(inputs: Tensor, plan: LayerPlan) -> Tensor:
    """A layer's inputs with a constant 1 appended for the folded bias: ``(points, in')`` or ``(points, in', L)``."""
    inputs = inputs.detach()
    if plan.bias is None:
        return inputs
    return torch.cat([inputs, torch.ones_like(inputs[:, :1])], dim=1)


def per_example(grad: Tensor, inputs: Tensor, plan: LayerPlan) -> Tensor:
    """Per-example gradient of the layer's weight matrix (bias folded), ``(..., points, out, in')``."""
    if plan.conv:
        return torch.einsum("...nol,nil->...noi", grad, inputs)
    return grad.unsqueeze(-1) * inputs.unsqueeze(-2)


def fit_curvature(
    net: NetworkFunction,
    theta: Tensor,
    structure: Structure,
    *,
    curvature: Literal["ggn", "ef"] = "ggn",
    rank: int = 50,
    oversampling: int = 10,
    power_iterations: int = 2,
    generator: torch.Generator | None = None,
) -> DataFit:
    """Compute :math:`G` in ``structure`` and the log-likelihood, its gradient and residuals over the full data."""
    plans, rest = layer_plan(net, theta)
    if structure != "low_rank" and rest.numel() > _REST_WARNING:
        names = sorted({net.layout.site_of(int(i)) for i in rest[:: max(rest.numel() // 50, 1)]})
        warnings.warn(
            f"{rest.numel()} parameters (sites {names}) are not weights of a linear or convolutional layer the "
            "engine recognises (F.linear / nn.Linear, x @ W [+ b], F.conv1d/2d), so their per-example Jacobian "
            "takes one forward-mode pass per parameter. Write those layers in one of these forms, or use "
            "structure='low_rank' (matrix-free).",
            stacklevel=3,
        )
    d = net.layout.num_params
    zeros = theta.new_zeros
    full = zeros(d, d) if structure == "full" else None
    diagonal = zeros(d) if structure == "diag" else None
    layer_diagonals = [zeros(p.index.shape) for p in plans] if structure == "diag" else []
    rest_diagonal = zeros(rest.numel()) if structure == "kron" else None
    input_factors = [zeros(p.index.shape[1], p.index.shape[1]) for p in plans] if structure == "kron" else []
    output_factors = [zeros(p.index.shape[0], p.index.shape[0]) for p in plans] if structure == "kron" else []
    locations = [1] * len(plans)
    log_likelihood, gradient = theta.new_zeros(()), zeros(d)
    sum_squares, num_observations, num_points = theta.new_zeros(()), theta.new_zeros(()), 0
    roots_cache: list[Tensor] = []
    for batch in net.batches():
        leaf = theta.detach().requires_grad_(True)
        out = net.outputs(leaf, batch, layers=True)
        f, likelihood = out.f, out.likelihood
        num_points += f.shape[0]
        log_prob = likelihood.log_prob(f, out.value)
        grad_theta, grad_f = torch.autograd.grad(log_prob, [leaf, f], retain_graph=True)
        log_likelihood = log_likelihood + log_prob.detach()
        gradient = gradient + grad_theta
        if likelihood.name == "Normal" and not likelihood.heteroscedastic:
            keep = likelihood._mask_outputs(f) if likelihood.mask is not None else torch.ones_like(f)
            residual = likelihood._flatten(out.value) - f.detach()
            sum_squares = sum_squares + (keep * residual**2).sum()
            num_observations = num_observations + keep.sum()
        if curvature == "ggn":
            roots = likelihood.hessian_sqrt(f.detach())
        else:
            roots = grad_f.detach().unsqueeze(-1)
        if structure == "low_rank":
            roots_cache.append(roots)
            continue
        layers = out.raw.layers
        outputs = [layers[p.position].outputs for p in plans]
        inputs = [_inputs(p.rows(layers[p.position].inputs, batch), p) for p in plans]
        rest_jacobian = _rest_jacobian(net, leaf.detach(), rest, batch) if rest.numel() else None
        for k, a in enumerate(inputs):
            if structure == "kron":
                input_factors[k] += torch.einsum("nil,njl->ij", a, a) if a.dim() == 3 else a.T @ a
                locations[k] = a.shape[-1] if a.dim() == 3 else 1
        squared_inputs = [a**2 if structure == "diag" else None for a in inputs]
        squared_grads: list[Tensor | float] = [0.0] * len(plans)
        for c in range(roots.shape[-1]):
            column = roots[..., c]
            grads = pullback(f, outputs, column) if outputs else []
            grads = [_layer_grad(p.rows(g, batch), p) for g, p in zip(grads, plans)]
            rest_rows = torch.einsum("pm,pmr->pr", column, rest_jacobian) if rest_jacobian is not None else None
            if structure == "kron":
                for k, g in enumerate(grads):
                    output_factors[k] += torch.einsum("nol,npl->op", g, g) if g.dim() == 3 else g.T @ g
                if rest_rows is not None:
                    rest_diagonal += (rest_rows**2).sum(0)
            elif structure == "diag":
                for k, (plan, g, a) in enumerate(zip(plans, grads, inputs)):
                    if plan.conv:
                        layer_diagonals[k] += (per_example(g, a, plan) ** 2).sum(0)
                    else:
                        squared_grads[k] = squared_grads[k] + g**2  # summed over columns, one product per chunk
                if rest_rows is not None:
                    diagonal[rest] += (rest_rows**2).sum(0)
            else:
                rows = f.new_zeros(f.shape[0], d)
                for plan, g, a in zip(plans, grads, inputs):
                    rows[:, plan.index.flatten()] = per_example(g, a, plan).flatten(1)
                if rest_rows is not None:
                    rows[:, rest] = rest_rows
                full += rows.T @ rows
        if structure == "diag":
            for k, plan in enumerate(plans):
                if not plan.conv:
                    layer_diagonals[k] += squared_grads[k].T @ squared_inputs[k]
    if structure == "full":
        result: Curvature = FullCurvature(full)
    elif structure == "diag":
        for plan, values in zip(plans, layer_diagonals):
            diagonal[plan.index] = values
        result = DiagCurvature(diagonal)
    elif structure == "kron":
        blocks = [
            KronBlock(p.index, b / (num_points * size), a)
            for p, b, a, size in zip(plans, output_factors, input_factors, locations)
        ]
        result = KronCurvature(blocks, rest, rest_diagonal, d)
    else:
        result = _low_rank(net, theta.detach(), roots_cache, rank, oversampling, power_iterations, generator)
    normal = sum_squares if num_observations > 0 else None
    return DataFit(
        result,
        log_likelihood,
        gradient.detach(),
        num_points,
        plans,
        rest,
        normal,
        num_observations if normal is not None else None,
    )


def _rest_jacobian(net: NetworkFunction, theta: Tensor, rest: Tensor, batch, group: int = 64) -> Tensor:
    """Per-example Jacobian columns for the flat indices ``rest``: ``(points, outputs, len(rest))``."""
    columns = []
    for start in range(0, rest.numel(), group):
        index = rest[start : start + group]
        tangents = theta.new_zeros(index.numel(), theta.numel())
        tangents[torch.arange(index.numel(), device=theta.device), index] = 1.0
        _, products = net.jvp(theta, tangents, batch)
        columns.append(products.detach())
    return torch.cat(columns).permute(1, 2, 0)


def _low_rank(net, theta, roots, rank, oversampling, power_iterations, generator) -> LowRankCurvature:
    d = theta.numel()
    width = min(d, rank + oversampling)
    probe = torch.randn(width, d, generator=generator, dtype=theta.dtype, device=theta.device)
    basis = torch.linalg.qr(net.ggn_vp(theta, probe, roots).T).Q
    for _ in range(power_iterations):
        basis = torch.linalg.qr(net.ggn_vp(theta, basis.T.contiguous(), roots).T).Q
    projected = basis.T @ net.ggn_vp(theta, basis.T.contiguous(), roots).T
    values, vectors = torch.linalg.eigh((projected + projected.T) / 2)
    order = values.argsort(descending=True)[: min(rank, width)]
    return LowRankCurvature(basis @ vectors[:, order], values[order])
