r"""Per-example Jacobian rows of a network, without forming the Jacobian over all weights.

Write :math:`r_{ic} = J_i^\top u_{ic}` for a cotangent :math:`u_{ic}` of the outputs of example :math:`i` (a column
of :math:`\Lambda_i^{1/2}` in the GGN pass, a unit vector :math:`e_c` in the predictive). For a recorded layer
:math:`z_i = W a_i + b` (bias folded in: :math:`\tilde a_i = (a_i, 1)`), :math:`r_{ic}` restricted to the layer is
:math:`g_{ic} \otimes \tilde a_i` with :math:`g_{ic} = \partial (u_{ic}^\top f_i)/\partial z_i`, and one backward
pass per column gives :math:`g_{ic}` for every example at once. A convolution is the same affine map applied at
:math:`L` locations to unfolded patches; its per-example rows are :math:`\sum_l g_{icl}\otimes\tilde a_{il}`.

Parameters outside recorded layers (a global offset, an embedding) get their rows from Jacobian-vector products
with basis vectors, which is exact and cheap for the few scalars such sites usually hold. Each recorded layer is
checked once against autograd; one that fails (a weight used twice, say) is treated the same way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch
from pyro_scalable.infer.linearized.likelihoods import Likelihood
from pyro_scalable.infer.linearized.network import NetworkFunction

__all__ = [
    "BatchedBackward",
    "LayerPlan",
    "OutputJacobian",
    "assemble_rows",
    "layer_grad",
    "layer_inputs",
    "layer_plan",
    "per_example",
    "plan_from",
    "pullback",
    "pullbacks",
    "rest_jacobian",
]


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


def layer_plan(net: NetworkFunction, theta: Tensor) -> tuple[list[LayerPlan], Tensor]:
    """Which recorded layers give exact per-example rows, and the flat indices left to the basis products."""
    batch = next(net.batches())
    theta = theta.detach().requires_grad_(True)
    return plan_from(net, theta, batch, net.outputs(theta, batch, layers=True))


def plan_from(net: NetworkFunction, theta: Tensor, batch: Batch, out) -> tuple[list[LayerPlan], Tensor]:
    """:func:`layer_plan` from a forward pass already taken: ``out`` (layers recorded) at the leaf ``theta``.

    The graph of ``out`` is kept (a pass goes on to use it for its first chunk).
    """
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


def _verify_rtol(reference: Tensor) -> float:
    """How far a recorded layer's assembled gradient may be from autograd's, relative, and still be the layer's.

    sqrt(eps) of the dtype (float32 3.5e-4, float64 1.5e-8: well above the 2e-7 to 3e-6 that rounding leaves on the
    float32 layers of a CIFAR-sized ResNet), and 1e-2 for float32 on a GPU where TF32 is allowed (cuDNN's convolutions
    by default): TF32's 10-bit mantissa gives about 5e-4 per product. A layer that is not what it seems is off by
    O(1).
    """
    rtol = torch.finfo(reference.dtype).eps ** 0.5
    tf32 = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
    if reference.is_cuda and reference.dtype == torch.float32 and tf32:
        rtol = max(rtol, 1e-2)
    return rtol


def _verified(plans: list[LayerPlan], out, theta: Tensor, batch) -> list[LayerPlan]:
    if not plans:
        return plans
    generator = torch.Generator(device=theta.device).manual_seed(0)
    cotangent = torch.randn(out.f.shape, generator=generator, dtype=out.f.dtype, device=out.f.device)
    outputs = [out.raw.layers[p.position].outputs for p in plans]
    grads = pullback(out.f, [theta] + outputs, cotangent)
    kept = []
    for plan, grad in zip(plans, grads[1:]):
        inputs = plan.rows(out.raw.layers[plan.position].inputs, batch).detach()
        grad = layer_grad(plan.rows(grad, batch), plan)
        # the sum over examples of g_i ⊗ ã_i, without forming the per-example products (nor, for a dense layer,
        # the copy of the inputs with a column of ones: the bias column is the sum of the g_i)
        if plan.conv:
            assembled = torch.einsum("nol,nil->oi", grad, layer_inputs(inputs, plan))
        else:
            assembled = grad.T @ inputs
            if plan.bias is not None:
                assembled = torch.cat([assembled, grad.sum(0).unsqueeze(1)], 1)
        reference = grads[0][plan.index]
        # A layer that is not what it seems (a weight used twice) is off by O(1); rounding, by a few eps of the
        # dtype times the depth of the sums. An elementwise test fails float32 layers on their near-zero entries.
        if (assembled - reference).norm() <= _verify_rtol(reference) * reference.norm() + 1e-30:
            kept.append(plan)
    return kept


def pullback(output: Tensor, inputs: list[Tensor], cotangent: Tensor) -> tuple[Tensor, ...]:
    """``cotangentᵀ ∂output/∂inputs`` by reverse mode, keeping the graph for the next column."""
    # Differentiating a scalar: torch.autograd.grad with explicit grad_outputs imports sympy on its first call
    # in a process, a one-off cost in time and memory that the inner product avoids.
    return torch.autograd.grad((output * cotangent).sum(), inputs, retain_graph=True)


class BatchedBackward:
    """Whether :func:`pullbacks` runs one batched backward: decided on its first use, kept for a pass.

    The batched backward is autograd's own ``is_grads_batched`` path (called without its argument checks, whose
    first call imports sympy). Where an operation of the backward graph has no batching rule (a convolution's or a
    pooling's backward) that path loops over the cotangents inside every such operation, slower than one backward
    per cotangent: the first call listens for torch's fallback warnings and, on any, turns the batching off.
    """

    def __init__(self):
        self.enabled: bool | None = None  # None: not tried yet

    def __call__(self, output: Tensor, inputs: tuple[Tensor, ...], cotangents: Tensor) -> tuple[Tensor, ...] | None:
        if self.enabled is False:
            return None
        try:
            from torch._vmap_internals import _vmap
            from torch.autograd.graph import _engine_run_backward
        except ImportError:
            self.enabled = False
            return None

        def backward(cotangent: Tensor):
            return _engine_run_backward((output,), (cotangent,), True, False, inputs, False, accumulate_grad=False)

        if self.enabled:
            return tuple(_vmap(backward, 0, 0)(cotangents))
        shown = torch._C._debug_only_are_vmap_fallback_warnings_enabled()
        torch._C._debug_only_display_vmap_fallback_warnings(True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = tuple(_vmap(backward, 0, 0)(cotangents))
        except RuntimeError:
            self.enabled = False
            return None
        finally:
            torch._C._debug_only_display_vmap_fallback_warnings(shown)
        fallbacks = ["batching rule" in str(w.message) for w in caught]
        self.enabled = not any(fallbacks)
        for warning, fallback in zip(caught, fallbacks):  # any other warning of the backward goes on to the caller
            if not fallback:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return result


def pullbacks(
    output: Tensor, inputs: list[Tensor], cotangents: Tensor, batched: BatchedBackward | None = None
) -> tuple[Tensor, ...]:
    """:func:`pullback` of every cotangent ``cotangents[k]`` (shaped like ``output``), stacked over ``k``.

    One batched backward where ``batched`` (:class:`BatchedBackward`) allows it, else one backward per cotangent.
    """
    result = (batched or BatchedBackward())(output, tuple(inputs), cotangents)
    if result is not None:
        return result
    rows = [pullback(output, inputs, cotangent) for cotangent in cotangents]
    return tuple(torch.stack(per_input) for per_input in zip(*rows))


def layer_grad(grad: Tensor, plan: LayerPlan) -> Tensor:
    """The gradient at a layer's output as ``(points, out)``, or ``(points, out, locations)`` for a convolution."""
    if plan.conv:
        return grad.flatten(2)
    return grad.unsqueeze(-1) if grad.dim() == 1 else grad


def layer_inputs(inputs: Tensor, plan: LayerPlan) -> Tensor:
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


def rest_jacobian(net: NetworkFunction, theta: Tensor, rest: Tensor, batch, group: int = 64) -> Tensor:
    """Per-example Jacobian columns for the flat indices ``rest``: ``(points, outputs, len(rest))``."""
    columns = []
    for start in range(0, rest.numel(), group):
        index = rest[start : start + group]
        tangents = theta.new_zeros(index.numel(), theta.numel())
        tangents[torch.arange(index.numel(), device=theta.device), index] = 1.0
        _, products = net.jvp(theta, tangents, batch)
        columns.append(products.detach())
    return torch.cat(columns).permute(1, 2, 0)


def assemble_rows(
    f: Tensor, plans: list[LayerPlan], grads: list[Tensor], inputs: list[Tensor], rest: Tensor, rest_rows, d: int
) -> Tensor:
    """The rows ``(points, d)`` of one cotangent column of the outputs ``f``, from its layer and ``rest`` rows."""
    rows = f.new_zeros(f.shape[0], d)
    for plan, g, a in zip(plans, grads, inputs):
        rows[:, plan.index.flatten()] = per_example(g, a, plan).flatten(1)
    if rest_rows is not None:
        rows[:, rest] = rest_rows
    return rows


class OutputJacobian:
    r"""The Jacobian of every output at some points, by layer: what :math:`J\Sigma J^\top` is assembled from.

    ``derivatives[k]`` is :math:`\partial f/\partial z_k` (``(points, outputs, out_k[, locations])``, one backward
    pass per output for every point at once), ``inputs[k]`` the layer's :math:`\tilde a` and ``rest`` the
    Jacobian columns of the parameters outside recorded layers (``(points, outputs, len(rest))``, or ``None``).
    """

    def __init__(self, net: NetworkFunction, theta: Tensor, plans: list[LayerPlan], rest_index: Tensor, batch: Batch):
        self.net, self.plans, self.rest_index = net, plans, rest_index
        leaf = theta.detach().requires_grad_(True)
        out = net.outputs(leaf, batch, layers=True)
        f = out.f
        width = f.shape[1]
        layers = [out.raw.layers[p.position] for p in plans]
        outputs = [layer.outputs for layer in layers]
        self.inputs = [layer_inputs(p.rows(layer.inputs, batch), p) for layer, p in zip(layers, plans)]
        per_output: list[list[Tensor]] = [[] for _ in plans]
        if plans:
            for c in range(width):
                cotangent = torch.zeros_like(f)
                cotangent[:, c] = 1.0
                grads = pullback(f, outputs, cotangent)
                for k, (g, plan) in enumerate(zip(grads, plans)):
                    per_output[k].append(layer_grad(plan.rows(g, batch), plan))
        self.derivatives = [torch.stack(g, dim=1) for g in per_output]
        self.rest = rest_jacobian(net, theta.detach(), rest_index, batch) if rest_index.numel() else None
        self.f = f.detach()
        self.likelihood: Likelihood = out.likelihood

    def layer(self, k: int) -> Tensor:
        """The full Jacobian block of recorded layer ``k``: ``(points, outputs, out, in')``."""
        return per_output(self.derivatives[k], self.inputs[k], self.plans[k])

    @cached_property
    def rows(self) -> Tensor:
        """Every output's Jacobian row over all ``d`` parameters, ``(points, outputs, d)``."""
        points, width = self.f.shape
        rows = self.f.new_zeros(points, width, self.net.layout.num_params)
        for k, plan in enumerate(self.plans):
            rows[:, :, plan.index.flatten()] = self.layer(k).flatten(2)
        if self.rest is not None:
            rows[:, :, self.rest_index] = self.rest
        return rows

    def diagonal_covariance(self, inverse: Tensor) -> Tensor:
        r""":math:`J\,\mathrm{diag}(h)\,J^\top` for a diagonal covariance ``inverse`` = :math:`h` (flat, ``d``)."""
        points, width = self.f.shape
        covariance = self.f.new_zeros(points, width, width)
        for k, (plan, b, a) in enumerate(zip(self.plans, self.derivatives, self.inputs)):
            if plan.conv:
                jacobian = self.layer(k)
                covariance += torch.einsum("pmkj,pnkj,kj->pmn", jacobian, jacobian, inverse[plan.index])
                continue
            weights = (a**2) @ inverse[plan.index].T
            covariance += torch.einsum("pmk,pnk,pk->pmn", b, b, weights)
        return self.add_rest(covariance, inverse[self.rest_index])

    def add_rest(self, covariance: Tensor, rest_inverse: Tensor) -> Tensor:
        """Add the diagonal covariance ``rest_inverse`` of the parameters outside recorded layers."""
        if self.rest is not None:
            covariance += torch.einsum("pmr,pnr,r->pmn", self.rest, self.rest, rest_inverse)
        return covariance


def per_output(derivative: Tensor, inputs: Tensor, plan: LayerPlan) -> Tensor:
    """``(points, outputs, out[, L])`` and ``(points, in'[, L])`` to ``(points, outputs, out, in')``."""
    return per_example(derivative.movedim(1, 0), inputs, plan).movedim(0, 1)
