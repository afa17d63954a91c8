r"""One pass over the full data at the MAP: the log-likelihood, its gradient, and the GGN rows for a curvature.

With :math:`\Lambda_i = L_i L_i^\top` (see ``likelihoods``), :math:`G = \sum_i \sum_c r_{ic} r_{ic}^\top` where
:math:`r_{ic} = J_i^\top L_i e_c` is the gradient of :math:`L_{i,:c}^\top f(x_i, \theta)`; the empirical Fisher
uses one column, the score :math:`\partial \log p(y_i\mid f_i)/\partial f_i`. The rows come layer by layer
(:mod:`~pyro_scalable.infer.linearized.jacobians`): :math:`g_{ic} \otimes \tilde a_i` for a recorded layer.

:func:`ggn_pass` walks the data once in chunks and hands each :class:`Chunk` to an :class:`Accumulator`, which
keeps what its structure needs of :math:`G` (the Laplace curvature structures of
:mod:`pyro_scalable.infer.laplace.structures` are accumulators). :class:`GGNDiagonal` is the one the floor itself
needs (sample-then-optimise's g-prior): :math:`\mathrm{diag}(G) = \sum_{i,c} g_{ic}^2 \otimes \tilde a_i^2`,
exact, with no per-example Jacobian.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
from collections.abc import Callable
from functools import cached_property
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch
from pyro_scalable.bridge.observed import check_site_values
from pyro_scalable.infer.linearized.jacobians import (
    BatchedBackward,
    LayerPlan,
    assemble_rows,
    layer_inputs,
    per_example,
    plan_from,
    pullbacks,
    rest_jacobian,
)
from pyro_scalable.infer.linearized.network import NetworkFunction, Outputs

__all__ = ["Accumulator", "Chunk", "DataFit", "GGNDiagonal", "data_gradient", "fit_chunk", "ggn_pass"]

_REST_WARNING = 2048
# the most numbers the layer gradients of one group of columns take (Chunk.column_groups): 64 MB in float32
COLUMN_NUMBERS = 2**24


class DataFit:
    r"""What a posterior needs from the data at :math:`\theta_*`: the accumulated curvature and the likelihood.

    ``gradient`` is :math:`\nabla_\theta \log p(D\mid\theta_*)` (flat), or a function that computes it: a pass
    that had no use for it (``ggn_pass(..., gradient=False)``) leaves it to :func:`data_gradient` on first read.
    """

    def __init__(
        self,
        curvature: Any,  # what the accumulator finished into
        log_likelihood: Tensor,  # log p(D | theta*)
        gradient: Tensor | Callable[[], Tensor],
        num_points: int,
        layers: list[LayerPlan],
        rest: Tensor,  # flat indices outside recorded layers
        sum_squares: Tensor | None = None,  # Normal: sum of squared residuals (observed, unmasked)
        num_observations: Tensor | None = None,  # Normal: number of observed scalars
    ):
        self.curvature, self.log_likelihood, self._gradient = curvature, log_likelihood, gradient
        self.num_points, self.layers, self.rest = num_points, layers, rest
        self.sum_squares, self.num_observations = sum_squares, num_observations

    def with_curvature(self, curvature: Any) -> DataFit:
        """The same fit with another curvature (a structure that tunes its prior returns a new one)."""
        fit = copy.copy(self)
        fit.curvature = curvature
        return fit

    @property
    def gradient(self) -> Tensor:
        r""":math:`\nabla_\theta \log p(D\mid\theta_*)`, flat (computed here on first read if the pass skipped it)."""
        if callable(self._gradient):
            self._gradient = self._gradient()
        return self._gradient


class Chunk:
    r"""One chunk of the data at :math:`\theta_*`: the outputs, the roots of :math:`\Lambda`, the layer pieces."""

    def __init__(
        self,
        net: NetworkFunction,
        theta: Tensor,
        batch: Batch,
        out: Outputs,
        roots: Tensor,
        plans,
        rest,
        batched: BatchedBackward | None = None,
    ):
        self.net, self.theta, self.batch, self.out = net, theta, batch, out
        self.roots = roots  # (points, outputs, columns)
        self.plans: list[LayerPlan] = plans
        self.rest: Tensor = rest
        self.batched = batched or BatchedBackward()  # shared by a pass's chunks

    @property
    def f(self) -> Tensor:
        return self.out.f

    @cached_property
    def point_weights(self) -> Tensor | None:
        """Each point's weight ``(points,)`` (``poutine.scale``; 0 where masked), ``None`` where every point's is 1.

        A point whose outputs have different weights (a mask per output) counts with the largest.
        """
        likelihood = self.out.likelihood
        if likelihood.weight is None and likelihood.mask is None:
            return None
        return likelihood.weight_outputs(self.f.detach()).amax(-1)

    @cached_property
    def inputs(self) -> list[Tensor]:
        """Each recorded layer's inputs ã for the chunk's points (bias column appended)."""
        layers = self.out.raw.layers
        return [layer_inputs(p.rows(layers[p.position].inputs, self.batch), p) for p in self.plans]

    @cached_property
    def raw_inputs(self) -> list[Tensor]:
        """Each recorded layer's inputs a, without the bias column (a structure that folds the bias adds it)."""
        layers = self.out.raw.layers
        return [p.rows(layers[p.position].inputs, self.batch).detach() for p in self.plans]

    @cached_property
    def rest_jacobian(self) -> Tensor | None:
        if not self.rest.numel():
            return None
        return rest_jacobian(self.net, self.theta.detach(), self.rest, self.batch)

    def column_groups(self):
        r"""The columns of the roots a group at a time: the stacked layer gradients and ``rest`` rows.

        Each layer's :math:`g_{\cdot c}` come as ``(columns, points, out[, L])``, the ``rest`` rows as
        ``(columns, points, len(rest))`` (or ``None``). One batched backward per group, whose stacked layer
        gradients hold at most about :data:`COLUMN_NUMBERS` numbers.
        """
        layers = self.out.raw.layers
        outputs = [layers[p.position].outputs for p in self.plans]
        rest_jacobian = self.rest_jacobian
        width = self.roots.shape[-1]
        size = max(1, min(width, COLUMN_NUMBERS // max(sum(t.numel() for t in outputs), 1)))
        for start in range(0, width, size):
            roots = self.roots[..., start : start + size]
            grads = pullbacks(self.f, outputs, roots.movedim(-1, 0).contiguous(), self.batched) if outputs else ()
            grads = [_stacked_grad(g, p, self.batch) for g, p in zip(grads, self.plans)]
            rest_rows = torch.einsum("pmc,pmr->cpr", roots, rest_jacobian) if rest_jacobian is not None else None
            yield grads, rest_rows

    def columns(self):
        r"""For each column ``c`` of the roots: the layer gradients :math:`g_{\cdot c}` and the ``rest`` rows."""
        for grads, rest_rows in self.column_groups():
            for c in range(len(grads[0]) if grads else 0 if rest_rows is None else rest_rows.shape[0]):
                yield [g[c] for g in grads], (rest_rows[c] if rest_rows is not None else None)

    def rows(self, grads: list[Tensor], rest_rows: Tensor | None) -> Tensor:
        """The per-example rows ``(points, d)`` of one column."""
        return assemble_rows(self.f, self.plans, grads, self.inputs, self.rest, rest_rows, self.theta.numel())


def _stacked_grad(grad: Tensor, plan: LayerPlan, batch: Batch) -> Tensor:
    """:func:`layer_grad` of gradients stacked over columns: ``(columns, points, out)`` or ``(..., out, L)``."""
    if plan.plate is not None:
        grad = grad[:, batch.indices[plan.plate]]
    if plan.conv:
        return grad.flatten(3)
    return grad.unsqueeze(-1) if grad.dim() == 2 else grad


class Accumulator(Protocol):
    """What one structure keeps of :math:`G` as the pass goes: ``start``, then ``accumulate`` per chunk."""

    uses_rows: bool  # False for a matrix-free structure (no per-example rows, no warning about slow ones)

    def start(self, net: NetworkFunction, theta: Tensor, plans: list[LayerPlan], rest: Tensor) -> None: ...
    def accumulate(self, chunk: Chunk) -> None: ...
    def finish(self, num_points: int) -> Any: ...


def fit_chunk(
    net: NetworkFunction,
    theta: Tensor,
    batch: Batch,
    plans,
    rest: Tensor,
    curvature: Literal["ggn", "ef"],
    forward: tuple[Tensor, Outputs] | None = None,
    batched: BatchedBackward | None = None,
    gradient: bool = True,
) -> tuple[Chunk, Tensor, Tensor | None]:
    r"""The :class:`Chunk` of ``batch`` at ``theta``, with its log-likelihood and the gradient of that in theta.

    The chunk's roots are :math:`\Lambda^{1/2}` (``"ggn"``) or the score (``"ef"``, the empirical Fisher).
    ``forward``: the leaf and the outputs (layers recorded) of a forward pass already taken on ``batch``;
    ``batched``: whether the chunk's columns are pulled back in one batched backward (shared by a pass's chunks);
    ``gradient=False``: no gradient in theta (``None``; a backward pass through the network less).
    """
    leaf, out = forward if forward is not None else _forward(net, theta, batch)
    f, likelihood = out.f, out.likelihood
    log_prob = likelihood.log_prob(f, out.value)
    grad_theta, grad_f = None, None
    if gradient:
        grad_theta, grad_f = torch.autograd.grad(log_prob, [leaf, f], retain_graph=True)
    elif curvature == "ef":
        (grad_f,) = torch.autograd.grad(log_prob, [f], retain_graph=True)
    # detached: a Normal's scale among the Laplace sites would otherwise carry the leaf into the pulled-back columns
    roots = likelihood.hessian_sqrt(f.detach()) if curvature == "ggn" else likelihood.score_root(grad_f.detach())
    roots = roots.detach()
    return Chunk(net, leaf, batch, out, roots, plans, rest, batched), log_prob, grad_theta


def _forward(net: NetworkFunction, theta: Tensor, batch: Batch) -> tuple[Tensor, Outputs]:
    """A leaf at ``theta`` and the network's outputs on ``batch`` from it, its layers recorded."""
    leaf = theta.detach().requires_grad_(True)
    return leaf, net.outputs(leaf, batch, layers=True)


def data_gradient(net: NetworkFunction, theta: Tensor, noise: Tensor | None = None) -> Tensor:
    r""":math:`\nabla_\theta \log p(D\mid\theta)`, flat: one pass over the data (a forward and a backward per chunk).

    At the observation noise ``noise`` (:attr:`NetworkFunction.noise`: ``None`` for the model's own).
    """
    gradient = theta.new_zeros(net.layout.num_params)
    kept, net.noise = net.noise, noise
    try:
        for batch in net.batches():
            leaf = theta.detach().requires_grad_(True)
            out = net.outputs(leaf, batch)
            (grad_theta,) = torch.autograd.grad(out.likelihood.log_prob(out.f, out.value), [leaf])
            gradient += grad_theta
    finally:
        net.noise = kept
    return gradient


def ggn_pass(
    net: NetworkFunction,
    theta: Tensor,
    accumulator: Accumulator,
    *,
    curvature: Literal["ggn", "ef"] = "ggn",
    stacklevel: int = 2,
    gradient: bool = True,
) -> DataFit:
    """Walk the full data once: log-likelihood, its gradient and residuals, and ``accumulator``'s curvature.

    ``gradient=False`` leaves the gradient out of the pass (one backward pass through the network per chunk less);
    the :class:`DataFit` then computes it with :func:`data_gradient` if and when it is read.

    The layer plan comes from the first chunk's forward pass, which the pass then goes on with. Each chunk's observed
    values are checked against the likelihood's support before they are used (:func:`check_site_values`: the same
    error as the bridge's full-data check, which a bridge built with ``check_values=False`` leaves to this pass).
    """
    batches = net.batches()
    first = next(batches)
    forward: tuple[Tensor, Outputs] | None = _forward(net, theta, first)
    plans, rest = plan_from(net, forward[0], first, forward[1])
    if accumulator.uses_rows and rest.numel() > _REST_WARNING:
        names = sorted({net.layout.site_of(int(i)) for i in rest[:: max(rest.numel() // 50, 1)]})
        warnings.warn(
            f"{rest.numel()} parameters (sites {names}) are not weights of a linear or convolutional layer the "
            "engine recognises (F.linear / nn.Linear, x @ W [+ b], F.conv1d/2d), so their per-example Jacobian "
            "takes one forward-mode pass per parameter. Write those layers in one of these forms, or use "
            "structure='low_rank' (matrix-free).",
            stacklevel=stacklevel + 1,
        )
    accumulator.start(net, theta, plans, rest)
    batched = BatchedBackward()
    log_likelihood, total = theta.new_zeros(()), theta.new_zeros(net.layout.num_params) if gradient else None
    sum_squares, num_observations, num_points = theta.new_zeros(()), theta.new_zeros(()), 0
    for batch in itertools.chain([first], batches):
        if forward is None:
            forward = _forward(net, theta, batch)
        raw = forward[1].raw
        if raw.value is not None and not net.bridge.values_checked:  # the bridge left it to the pass: before use
            check_site_values(net.site, raw.fn, raw.value, net.bridge.observed[net.site], batch.indices)
        chunk, log_prob, grad_theta = fit_chunk(net, theta, batch, plans, rest, curvature, forward, batched, gradient)
        forward = None
        f, likelihood = chunk.f, chunk.out.likelihood
        num_points += f.shape[0]
        log_likelihood = log_likelihood + log_prob.detach()
        if total is not None:
            total += grad_theta
        if likelihood.name == "Normal" and not likelihood.heteroscedastic:
            keep = likelihood.weight_outputs(f.detach())
            residual = likelihood.flatten(chunk.out.value) - f.detach()
            sum_squares = sum_squares + (keep * residual**2).sum()
            num_observations = num_observations + keep.sum()
        accumulator.accumulate(chunk)
    normal = sum_squares if num_observations > 0 else None
    return DataFit(
        accumulator.finish(num_points),
        log_likelihood,
        total.detach() if total is not None else functools.partial(data_gradient, net, theta.detach(), net.noise),
        num_points,
        plans,
        rest,
        normal,
        num_observations if normal is not None else None,
    )


class GGNDiagonal:
    r""":math:`\mathrm{diag}(G)` (flat, ``d``): squared rows summed, one product per layer and chunk."""

    uses_rows = True

    def start(self, net: NetworkFunction, theta: Tensor, plans: list[LayerPlan], rest: Tensor) -> None:
        self.plans, self.rest = plans, rest
        self.diagonal = theta.new_zeros(net.layout.num_params)
        self.layer_diagonals = [theta.new_zeros(p.index.shape) for p in plans]

    def accumulate(self, chunk: Chunk) -> None:
        squared_grads: list[Tensor | None] = [None] * len(self.plans)
        for grads, rest_rows in chunk.column_groups():
            for k, (plan, g) in enumerate(zip(self.plans, grads)):
                if plan.conv:
                    for column in g:
                        self.layer_diagonals[k] += per_example(column, chunk.inputs[k], plan).square().sum(0)
                    continue
                squares = g.square_().sum(0)  # summed over the columns: one product per layer and chunk
                squared_grads[k] = squares if squared_grads[k] is None else squared_grads[k] + squares
            if rest_rows is not None:
                self.diagonal[self.rest] += rest_rows.square().sum((0, 1))
        for k, (plan, a) in enumerate(zip(self.plans, chunk.raw_inputs)):
            squares = squared_grads[k]
            if plan.conv or squares is None:
                continue
            # the weight columns from the inputs' squares, the folded bias column from the column sums (no
            # (points, in + 1) copy of the inputs with a column of ones)
            diagonal = self.layer_diagonals[k]
            weights = diagonal[:, :-1] if plan.bias is not None else diagonal
            weights.addmm_(squares.T, a.square())
            if plan.bias is not None:
                diagonal[:, -1] += squares.sum(0)

    def finish(self, num_points: int) -> Tensor:
        for plan, values in zip(self.plans, self.layer_diagonals):
            self.diagonal[plan.index] = values
        return self.diagonal
