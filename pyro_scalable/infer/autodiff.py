"""Jacobian- and Hessian-vector products, and row-sliced work on ``(K, d)`` tensors, shared by the engines."""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["gradient_products", "hvp", "jvp", "row_slices"]


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
    Hessian is symmetric, so the vjp is the product wanted. Outside torch.func transforms, plain autograd's two
    backward passes: the same numbers without a gradient transform (torch's first one in a process imports
    ``torch._dynamo``, over a second on a CPU).
    """
    active = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if active is not None and active() is None:
        flat, spec = tree_flatten(primals)
        leaves = [x.detach().requires_grad_() for x in flat]
        with torch.enable_grad():
            value = func(*tree_unflatten(leaves, spec))
            grads = torch.autograd.grad(value, leaves, create_graph=True, allow_unused=True, materialize_grads=True)
        return tree_unflatten(gradient_products(grads, tree_flatten(tangents)[0], leaves), spec)
    _, pullback = torch.func.vjp(torch.func.grad(func), *primals)
    return pullback(*tangents)


def gradient_products(grads, tangents, leaves) -> list:
    r"""The gradient of :math:`\sum_j \langle g_j, v_j \rangle` in ``leaves``: the Hessian times the tangents.

    ``grads`` are a scalar's gradients in ``leaves``, taken with ``create_graph=True``; ``tangents`` line up with
    them. Gradients that do not depend on the leaves (a linear function) have no curvature: zeros.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.autodiff import gradient_products
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> (g,) = torch.autograd.grad(w.pow(3).sum(), [w], create_graph=True)  # Hessian diag(6 w)
        >>> gradient_products([g], [torch.ones(2)], [w])
        [tensor([ 6., 12.])]

    """
    with torch.enable_grad():
        inner = sum((g * v).sum() for g, v in zip(grads, tangents, strict=True))
        if not torch.is_tensor(inner) or not inner.requires_grad:
            return [torch.zeros_like(x) for x in leaves]
        return list(torch.autograd.grad(inner, leaves, allow_unused=True, materialize_grads=True))


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
