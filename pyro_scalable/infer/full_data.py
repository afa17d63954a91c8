r"""Full-data passes: the log joint, its gradient, its Hessian and Hessian-vector products, summed over chunks.

**A full-data pass** (:func:`full_data_gradient`) sums the log joint :math:`\ell(\theta)` and its gradient over
chunks of the subsampled plate: chunk :math:`c` of :math:`C_c` points is the bridge's minibatch estimate weighted by
:math:`C_c/N`, so the weighted sum is exact; it is taken in float64. A chunk holds 2^16 points, fewer where the
data's rows would take more than 64 MB, never fewer than the plate's minibatch
(:func:`~pyro_scalable.bridge.minibatches.points_per_chunk`: per chunk the bridge costs about a millisecond whatever
its size, so small chunks make a pass several times a hand-written one).

:func:`full_data_gradient` is a control variate's centre with its full-data log joint and gradient
(:class:`ControlVariate`); :func:`full_data_hessian` the dense Hessian (one pass of d Hessian-vector products per
chunk) and :func:`full_data_hvps` the products with given vectors, for the mode search's exact check, SWAG's check
and the linearised engines. A data-parallel run splits each pass over its ranks and all-reduces the sums.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad_and_value

from pyro_scalable.bridge.minibatches import CHUNK_SIZE, chunks, points_per_chunk
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.bridge.traced import recording_at_first_call
from pyro_scalable.infer.distributed import all_reduce_sum

__all__ = [
    "CHUNK_SIZE",
    "ControlVariate",
    "as_control_variate",
    "full_data_gradient",
    "full_data_hessian",
    "full_data_hvps",
    "full_data_sums",
    "point_gradient_and_value",
    "point_hessian",
]


class ControlVariate(NamedTuple):
    """The centre θ̂ (unconstrained latents) with the full-data log joint and gradient there."""

    centre: Latents
    gradient: Latents
    log_joint: Tensor


def _batches(bridge: ModelBridge, size: int, indices: Tensor | None) -> Iterator[tuple[Batch, float]]:
    """The data (or the points ``indices``) as ``(batch, weight)`` pairs whose weighted log joints sum to theirs."""
    full = bridge.full_batch()
    plate = next(iter(bridge.plates.values()), None)
    if plate is None:
        yield full, 1.0
        return
    if indices is None:
        parts, total = chunks(plate.size, size, bridge.device), plate.size
    else:
        parts, total = indices.split(size), len(indices)
    for part in parts:
        yield Batch({**full.indices, plate.name: part}, full.args, full.kwargs), len(part) / total


def point_gradient_and_value(fn: Callable, latents: Latents, batch: Batch) -> tuple[Latents, Tensor]:
    """∇ and value of ``fn`` at ``latents`` as constants: plain autograd outside torch.func transforms."""
    active = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if active is None or active() is not None:  # inside vmap, grad, jvp...: autograd cannot be used there
        return grad_and_value(fn)(latents, batch)
    leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
    with torch.enable_grad():
        value = fn(leaves, batch)
        grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(leaves, grads, strict=True)), value.detach()


def full_data_sums(bridge: ModelBridge, latents: Latents, size: int, reducer: Any, indices: Tensor | None = None):
    """The log joint and its gradient at ``latents`` in float64: over the data, or estimated on ``indices``."""
    first = next(iter(latents.values()))
    total = {name: torch.zeros_like(x, dtype=torch.float64) for name, x in latents.items()}
    value = torch.zeros((), dtype=torch.float64, device=first.device)
    rank, world = (reducer.rank, reducer.world_size) if reducer is not None else (0, 1)
    with recording_at_first_call():  # the chunks' signatures recur on every pass
        for c, (batch, weight) in enumerate(_batches(bridge, size, indices)):
            if c % world != rank:
                continue
            grads, chunk_value = point_gradient_and_value(bridge.log_posterior, latents, batch)
            value = value + weight * chunk_value.double()
            for name, g in grads.items():
                total[name] = total[name] + weight * g.double()
    if reducer is not None:
        *summed, value = all_reduce_sum([*total.values(), value])
        total = dict(zip(total, summed, strict=True))
    return value, total


def full_data_gradient(
    bridge: ModelBridge, latents: Latents, *, chunk_size: int | None = None, reducer: Any = None
) -> ControlVariate:
    """The full-data log joint and its gradient at unconstrained ``latents``, in chunks of the subsampled plate.

    Chunk c of C_c points is the minibatch estimate scaled by C_c/N, so the chunks' sum is exact; the sum is taken
    in float64. With a ``reducer`` (data-parallel) each rank takes every ``world_size``-th chunk and the sums are
    all-reduced.
    """
    value, total = full_data_sums(bridge, latents, points_per_chunk(bridge, chunk_size), reducer)
    return as_control_variate(latents, value, total)


def as_control_variate(latents: Latents, value: Tensor, total: Latents) -> ControlVariate:
    """A centre with its full-data log joint and gradient (float64 sums) in the latents' dtype."""
    first = next(iter(latents.values()))
    gradient = {name: total[name].to(x.dtype) for name, x in latents.items()}
    centre = {name: x.detach().clone() for name, x in latents.items()}
    return ControlVariate(centre, gradient, value.to(first.dtype))


def full_data_hessian(bridge: ModelBridge, unflatten: Callable, x: Tensor, size: int, reducer: Any = None) -> Tensor:
    """The full-data log joint's Hessian at the flat ``x`` (float64, ``d x d``), one pass over the chunks."""
    total = torch.zeros(len(x), len(x), dtype=torch.float64, device=x.device)
    rank, world = (reducer.rank, reducer.world_size) if reducer is not None else (0, 1)
    point = x.to(unflatten(x)[next(iter(unflatten(x)))].dtype)

    with recording_at_first_call():
        for c, (batch, weight) in enumerate(_batches(bridge, size, None)):
            if c % world != rank:
                continue
            fn = lambda flat, batch=batch: bridge.log_posterior(unflatten(flat), batch)  # noqa: E731
            total = total + weight * point_hessian(fn, point).double()
    if reducer is not None:
        (total,) = all_reduce_sum([total])
    return 0.5 * (total + total.T)


def point_hessian(fn: Callable, point: Tensor) -> Tensor:
    """The scalar ``fn``'s Hessian at the flat ``point``: row i the gradient of ∂fn/∂x_i, by plain autograd.

    Outside torch.func transforms, d backward passes over the gradient's graph: several times quicker than
    ``torch.func.hessian`` (forward over reverse, its d tangents vmapped through the recorded graph), and without
    torch's one-time load of its forward-mode rules (compiled by TorchScript). The two agree to the dtype's
    rounding. Inside a transform, or where an operation has no double backward, ``torch.func`` does it: forward over
    reverse, else reverse over reverse (an operation without a forward-mode formula).
    """
    active = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if active is not None and active() is None:
        leaf = point.detach().requires_grad_()
        try:
            with torch.enable_grad():
                (gradient,) = torch.autograd.grad(fn(leaf), leaf, create_graph=True)
                if not gradient.requires_grad:  # a gradient that does not depend on the point
                    return torch.zeros(len(leaf), len(leaf), dtype=leaf.dtype, device=leaf.device)
                rows = [
                    torch.autograd.grad(
                        gradient[i], leaf, retain_graph=True, allow_unused=True, materialize_grads=True
                    )[0]
                    for i in range(len(leaf))
                ]
            return torch.stack(rows)
        except (RuntimeError, NotImplementedError):  # an operation without a double backward
            pass
    try:
        with warnings.catch_warnings():  # torch loads its forward-mode rules by jit once
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.func.hessian(fn)(point)  # forward over reverse
    except (RuntimeError, NotImplementedError):  # an operation without a forward-mode formula
        return torch.func.jacrev(torch.func.jacrev(fn))(point)


def full_data_hvps(bridge: ModelBridge, unflatten: Callable, x: Tensor, vectors: Tensor, size: int) -> Tensor:
    """The full-data log joint's Hessian at the flat ``x`` times each row of ``vectors`` ``(k, d)``: float64 ``(k, d)``.

    One pass over the chunks, the k products of a chunk vectorised (one after another where the model cannot be).
    """
    total = torch.zeros(vectors.shape, dtype=torch.float64, device=x.device)
    point = x.to(next(iter(unflatten(x).values())).dtype)
    tangents = vectors.to(point.dtype)
    for batch, weight in _batches(bridge, size, None):
        fn = lambda flat, batch=batch: bridge.log_posterior(unflatten(flat), batch)  # noqa: E731
        _, pullback = torch.func.vjp(torch.func.grad(fn), point)
        try:
            (chunk,) = torch.func.vmap(pullback)(tangents)
        except (RuntimeError, NotImplementedError):  # an operation without a batching rule
            chunk = torch.stack([pullback(v)[0] for v in tangents])
        total = total + weight * chunk.double()
    return total
