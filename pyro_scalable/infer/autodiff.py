"""Jacobian- and Hessian-vector products, and row-sliced work on ``(K, d)`` tensors, shared by the engines."""

from __future__ import annotations

import warnings

import torch

__all__ = ["hvp", "jvp", "row_slices"]


def jvp(func, primals, tangents):
    """``torch.func.jvp``, without torch's one-time notice about its TorchScript decompositions."""
    # The first forward-mode call in a process makes torch script its jvp decompositions, which warns about
    # torch.jit.script being deprecated (a torch internal, nothing the user can act on).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script. is deprecated", category=DeprecationWarning)
        return torch.func.jvp(func, primals, tangents)


def hvp(func, primals, tangents):
    """The Hessian of the scalar ``func`` at ``primals`` times ``tangents``: the vjp of its gradient.

    Reverse-over-reverse, not the cheaper forward-over-reverse (``jvp`` of ``grad``): in torch 2.x the latter fails
    on float32 models in which a 0-d latent meets a Python number (a scale ``0.0 + 1.0 * exp(u)``, as
    ``biject_to(HalfNormal(1.0).support)`` builds it), with "addmv input tensors must have the same dtype". The
    Hessian is symmetric, so the vjp is the product wanted.
    """
    _, pullback = torch.func.vjp(torch.func.grad(func), *primals)
    return pullback(*tangents)


def row_slices(rows: int, width: int, elements: int = 2**20) -> list[slice]:
    """Slices of ``rows`` rows of ``width`` numbers, each at most ``elements`` numbers (at least one row).

    Row-wise work on ``(K, d)`` tensors done a slice at a time keeps its temporaries at ``elements`` numbers (4 MB
    in float32) rather than another ``K x d``.

    Example:
        >>> from pyro_scalable.infer.autodiff import row_slices
        >>> row_slices(5, 2**19)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]

    """
    size = max(1, elements // max(width, 1))
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]
