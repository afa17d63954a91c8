r"""Gradients at many points at once by plain autograd: nested vmaps of a density, one backward pass.

The latents carry leading dimensions, one per level of points: the chains, and within each chain a minibatch's
groups of examples for the noise estimate. The points share no parameter, so the gradient of the sum of their log
densities with respect to point :math:`p`'s latents is point :math:`p`'s own gradient, and a second backward pass of
:math:`\sum_p \langle \nabla \ell_p(\theta_p), v_p \rangle` gives every point's Hessian-vector product
:math:`H_p v_p` (the Hessian of the sum is block-diagonal). These are the numbers ``vmap(grad_and_value(...))`` and
``vmap(vjp(grad(...)))`` give, without a gradient transform: torch's first one in a process imports
``torch._dynamo`` (over a second on a CPU), and under vmap every operation pays the transform's wrapping.

A density may compute its batched gradient better itself (``batched_gradient``,
:class:`~.density.MinibatchDensity`): the control variate evaluates its inner density at the chains' points and at
its centre as one batch (:class:`~.controlled.ControlledDensity`), which a vmapped density could not do without a
gradient inside it; warm-up's metric maps the points to θ and the gradients back (:class:`~.whitened.WhitenedDensity`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.func import vmap

from pyro_scalable.bridge.records import Batch
from pyro_scalable.infer.autodiff import gradient_products
from pyro_scalable.infer.gradients.density import MinibatchDensity

__all__ = ["batched_gradient", "batched_hvp", "gradient_and_value", "index_dims"]

Latents = dict[str, Tensor]


def index_dims(indices: dict) -> dict:
    """The ``in_dims`` for a step's indices: 0 for per-chain ``(C, B)``, None for a shared ``(B,)``."""
    return {name: 0 if idx.dim() == 2 else None for name, idx in indices.items()}


def gradient_and_value(
    density: Any, latents: Latents, batch: Batch, dims: list | None = None, *, create_graph: bool = False
) -> tuple[Latents, Tensor]:
    """Every point's gradient and value of ``density``: one vmap per leading dimension, one backward pass.

    ``dims``: the indices' ``in_dims`` at each leading dimension of the latents, outermost first (default: one chain
    dimension, :func:`index_dims`). ``create_graph``: the gradients stay differentiable in ``latents`` (which then
    require grad themselves), for a second backward pass.

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> density = lambda latents, batch: -0.5 * latents["w"].square().sum()  # gradient -w at each chain
        >>> two_chains = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
        >>> grads, values = gradient_and_value(density, two_chains, Batch({}, (), {}))
        >>> grads["w"], values
        (tensor([[-1., -2.],
                [-3., -4.]]), tensor([ -2.5000, -12.5000]))

    """
    dims = [index_dims(batch.indices)] if dims is None else dims
    leaves = latents if create_graph else {name: x.detach().requires_grad_() for name, x in latents.items()}

    def one(point, indices, args, kwargs):
        return density(point, Batch(indices, args, kwargs))

    fn = one
    for level in reversed(dims):
        fn = vmap(fn, in_dims=(0, level, None, None))
    with torch.enable_grad():
        values = fn(leaves, batch.indices, batch.args, batch.kwargs)
        grads = torch.autograd.grad(
            values.sum(), list(leaves.values()), create_graph=create_graph, allow_unused=True, materialize_grads=True
        )
    return dict(zip(leaves, grads, strict=True)), values if create_graph else values.detach()


def batched_gradient(
    density: MinibatchDensity, latents: Latents, batch: Batch, dims: list | None = None, *, create_graph: bool = False
) -> tuple[Latents, Tensor]:
    """The density's own ``batched_gradient`` where it gives one, else :func:`gradient_and_value` (same arguments).

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> from pyro_scalable.infer.gradients import FunctionDensity
        >>> density = FunctionDensity(lambda latents, batch: latents["w"].sin().sum())  # gradient cos w
        >>> grads, _ = batched_gradient(density, {"w": torch.zeros(3, 1)}, Batch({}, (), {}))
        >>> grads["w"].flatten()
        tensor([1., 1., 1.])

    """
    result = density.batched_gradient(latents, batch, dims, create_graph=create_graph)
    return (
        result if result is not None else gradient_and_value(density, latents, batch, dims, create_graph=create_graph)
    )


def batched_hvp(density: MinibatchDensity, latents: Latents, batch: Batch, tangents: Latents) -> Latents:
    """Every chain's Hessian of ``density`` at its latents times its tangent: two backward passes (module docstring).

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> from pyro_scalable.infer.gradients import FunctionDensity
        >>> density = FunctionDensity(lambda latents, batch: -latents["w"].pow(3).sum())  # Hessian diag(-6 w)
        >>> two_chains = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
        >>> batched_hvp(density, two_chains, Batch({}, (), {}), {"w": torch.ones(2, 2)})["w"]
        tensor([[ -6., -12.],
                [-18., -24.]])

    """
    leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
    with torch.enable_grad():
        grads, _ = batched_gradient(density, leaves, batch, create_graph=True)
    products = gradient_products([grads[name] for name in leaves], [tangents[name] for name in leaves], leaves.values())
    return dict(zip(leaves, products, strict=True))
