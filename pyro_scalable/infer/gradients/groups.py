r"""The per-group half of the gradient-noise estimate: each group's gradient of a minibatch, and their spread.

:func:`~.estimate.estimate_gradient` splits a minibatch into :math:`G` groups
(:mod:`pyro_scalable.bridge.log_posterior`) and needs each group's gradient :math:`h_g` of the terms that differ
between groups (the data's, where the density offers its ``terms`` apart) and the sample variance
:math:`\mathrm{var}_G(h_g)` per coordinate.
:func:`per_group` computes the :math:`h_g` with one vmapped density and one backward pass (:mod:`.batched`);
:func:`spread` their variance, in place where the gradients' memory is the estimate's own (:func:`own_storage`).
"""

from __future__ import annotations

import collections
from typing import Any

from torch import Tensor
from torch.func import grad_and_value, vmap

from pyro_scalable.bridge.records import Batch
from pyro_scalable.bridge.traced import under_transform
from pyro_scalable.infer.gradients.batched import batched_gradient

__all__ = ["own_storage", "per_group", "spread"]

Latents = dict[str, Tensor]


def per_group(log_posterior_fn: Any, latents: Latents, examples: Any, in_dims: Any) -> tuple:
    """Each group's gradient and value: one vmapped density and one backward pass, outside a transform.

    Each group evaluates the density at its own leaf of the latents, so the gradient of the sum with respect to the
    leaves is the groups' gradients (:mod:`.batched`), the numbers ``vmap(grad_and_value(...))`` gives without its
    gradient transform around every operation (on a small model, a large share of the noise-measuring step). The
    leaves are one expanded view of the latents, not copies: no copy per group, and a layer's batched product reads
    one weight matrix rather than one per group. A model that writes to its latents in place cannot take them so
    and gets each group's own gradient below.
    """
    dims = in_dims.indices if isinstance(in_dims, Batch) else None  # the bridge's: the groups along a plate's indices
    split = [i for i, d in zip(examples.indices.values(), dims.values(), strict=True) if d == 0] if dims else []
    if not split or any(under_transform(x) for x in latents.values()):
        return vmap(grad_and_value(log_posterior_fn), in_dims=(None, in_dims))(latents, examples)
    size = split[0].shape[0]
    leaves = {name: x.detach().expand(size, *x.shape) for name, x in latents.items()}
    try:
        return batched_gradient(log_posterior_fn, leaves, examples, [dims])
    except RuntimeError:  # a model that branches on its latents cannot take them batched: each group's own gradient
        return vmap(grad_and_value(log_posterior_fn), in_dims=(None, in_dims))(latents, examples)


def own_storage(tensors: Latents) -> set[str]:
    """The names of the tensors that share memory with no other (none under a transform, whose memory is hidden)."""
    if any(under_transform(x) for x in tensors.values()):
        return set()
    storages = collections.Counter(x.untyped_storage().data_ptr() for x in tensors.values())
    return {name for name, x in tensors.items() if storages[x.untyped_storage().data_ptr()] == 1}


def spread(per_grads: Tensor, mean: Tensor, own: bool = False, dim: int = 0) -> Tensor:
    """``per_grads.var(dim, correction=1)`` as a centred sum of squares; ``own``: ``per_grads`` may be overwritten.

    ``mean``: the mean over ``dim``, without that dimension. torch's ``var`` over a leading dimension is much slower.
    Centring in place spares a copy the size of every group's gradient, whose fresh pages the allocator may take
    from the system on every call (on a CPU, for a network's gradients, at a cost above the arithmetic's).
    """
    mean = mean.unsqueeze(dim)
    centred = per_grads.sub_(mean) if own and per_grads.is_contiguous() else per_grads - mean
    return centred.mul_(centred).sum(dim) / (per_grads.shape[dim] - 1)
