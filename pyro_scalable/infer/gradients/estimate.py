r"""The minibatch gradient of a density at one chain's point or every chain's, and the diagonal of its noise.

With a subsampled plate of size :math:`N` and a minibatch :math:`\mathcal{B}` of :math:`B` points drawn without
replacement, the minibatch gradient is the mean of the per-example gradients
:math:`g_i = \nabla \log p(\theta) + N \nabla \log p(y_i \mid \theta)`, so its covariance is
:math:`V = (1 - B/N)\,\mathrm{Cov}_i(g_i) / B`. :func:`estimate_gradient` with ``noise=True`` evaluates the
:math:`g_i` with one ``torch.func.vmap`` over single-example batches and returns the diagonal of the unbiased
estimate :math:`\hat V = (1 - B/N)\, s^2 / B` (sample variance :math:`s^2` over the minibatch) next to their
mean, which is the usual minibatch gradient. A density may split a large minibatch into :math:`G` groups of
:math:`m` examples instead (the bridge does above 32 examples): the groups' mean gradients :math:`h_g` give
:math:`s^2 \approx m\,\mathrm{var}_G(h_g)`, unbiased over random partitions, at the cost of one batched
gradient (:mod:`pyro_scalable.bridge.log_posterior`, :mod:`.groups`). Terms that are the same in every group (the
prior's) add to the mean and not to the spread: where the density offers its ``terms`` apart and the latents have
:data:`SHARED_FROM` coordinates or more, they are evaluated once and only the data's per group, so that a network's
prior, as large as its weights, is not evaluated :math:`G` times.

:func:`chains_gradient` is the plain gradient of every chain at once (one vmapped density, one backward pass, or
the density's own ``batched_gradient``), :func:`chains_estimate` the same with the noise: every chain's groups of
examples in one doubly vmapped density and one backward pass (:mod:`.batched`), no gradient transform.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad_and_value

from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.bridge.traced import under_transform
from pyro_scalable.infer.gradients.batched import batched_gradient, gradient_and_value, index_dims
from pyro_scalable.infer.gradients.density import MinibatchDensity, as_density
from pyro_scalable.infer.gradients.groups import own_storage, per_group, spread

__all__ = [
    "SHARED_FROM",
    "GradientEstimate",
    "chain_indices",
    "chains_estimate",
    "chains_gradient",
    "estimate_gradient",
    "evaluate",
    "flag",
    "gradient_and_value",
    "index_dims",
]

SHARED_FROM = 10_000  # latent coordinates from which the noise estimate takes the prior's terms once


class GradientEstimate(NamedTuple):
    """The minibatch gradient of the log posterior at one point, and what is known about its noise."""

    grads: Latents
    log_posterior: Tensor  # the minibatch estimate of the log joint
    grad_norm: Tensor
    diverging: Tensor  # bool: the value or the gradient is not finite
    noise_variance: Latents  # diag of the estimated Cov(grads) per site; {} when not estimated
    num_examples: Tensor  # B, the number of per-example gradients behind noise_variance (0 when not estimated)
    hessian_product: Latents  # warm-up's Hessian-vector product ({} outside warm-up)
    # the noise a kernel subtracts from the noise it injects: the program hands ``noise_variance`` here where the
    # kernel corrects for it (``gradient_noise="correct"``), ``{}`` where it only reports it or ignores it
    noise_correction: Latents = {}  # noqa: RUF012 -- never mutated: a NamedTuple's fields are replaced


def evaluate(density: MinibatchDensity, latents: Latents, batch: Any) -> tuple[Latents, Tensor, Tensor, Tensor]:
    """Gradient, value, gradient norm and a divergence flag of the log posterior at ``latents``."""
    grads, value = _gradient_and_value(density, latents, batch)
    grad_sq = functools.reduce(torch.add, (g.square().sum() for g in grads.values()))
    # one check for both: the sum is finite where both are (grad_sq >= 0; it overflows only past ~1e38, a divergence)
    total = value + grad_sq
    if total.device.type == "cpu" and not under_transform(total) and not torch.is_inference_mode_enabled():
        diverging = flag(not math.isfinite(total.item()), total.device)  # a plain CPU step: one read, no flag made
    else:
        diverging = ~torch.isfinite(total)
    return grads, value, grad_sq.sqrt(), diverging


def estimate_gradient(
    density: MinibatchDensity, latents: Latents, batch: Any, *, noise: bool = False
) -> GradientEstimate:
    """The minibatch gradient at ``latents``; with ``noise=True`` also the diagonal of its covariance.

    The noise estimate needs ``density.examples`` (the Pyro bridge offers it for a model with one
    subsampled plate) and at least two examples per minibatch.
    """
    if not noise:
        grads, value, grad_norm, diverging = evaluate(density, latents, batch)
        return GradientEstimate(grads, value, grad_norm, diverging, {}, _no_examples(value.device), {})
    return _with_noise(density, latents, batch, chains=False)


def chains_estimate(density: MinibatchDensity, latents: Latents, batch: Batch, *, noise: bool = False):
    """:func:`estimate_gradient` for every chain at once (latents with a leading chain dimension), outside vmap.

    The chains' groups of examples are one doubly vmapped density and one backward pass (:mod:`.batched`), not a
    gradient transform per chain: the same numbers, to rounding.
    """
    if not noise:
        return chains_gradient(density, latents, batch)
    return _with_noise(density, latents, batch, chains=True)


def _with_noise(density: MinibatchDensity, latents: Latents, batch: Any, chains: bool) -> GradientEstimate:
    """The gradient and its noise's diagonal at one chain's latents, or (``chains``) at every chain's."""
    parts = density.examples(batch)
    if parts is None:  # the full data: an exact gradient, no noise
        exact = chains_gradient(density, latents, batch) if chains else estimate_gradient(density, latents, batch)
        variance = {name: torch.zeros_like(g) for name, g in exact.grads.items()}
        return exact._replace(noise_variance=variance, num_examples=torch.zeros_like(exact.log_posterior))
    examples, in_dims, population_size, *group = parts
    group = group[0] if group else 1
    # the prior's terms apart cost a gradient of their own, which pays where the prior is large (a network's weights,
    # from about SHARED_FROM coordinates); below, that gradient costs more than the prior's evaluations it saves
    many = sum(x[0].numel() if chains else x.numel() for x in latents.values()) >= SHARED_FROM
    terms = tuple(as_density(t) for t in density.terms) if many and density.terms is not None else None
    grouped = density if terms is None else terms[1]
    if chains:  # every chain's groups: leaves (chains, groups, ...), vmapped over both
        groups = next(i for i, d in zip(examples.indices.values(), in_dims.indices.values(), strict=True) if d == 0)
        leaves = {
            name: x.detach().unsqueeze(1).expand(x.shape[0], groups.shape[-2], *x.shape[1:])
            for name, x in latents.items()
        }
        dims = [index_dims(batch.indices), in_dims.indices]
        per_grads, per_values = batched_gradient(grouped, leaves, examples, dims)
    else:
        per_grads, per_values = per_group(grouped, latents, examples, in_dims)
    axis = int(chains)  # the groups' dimension
    own = own_storage(per_grads)
    size = per_values.shape[axis] * group
    means = {name: g.mean(axis) for name, g in per_grads.items()}
    value = per_values.mean(axis)
    shrink = group * (1.0 - size / population_size) / size  # m var_G(h_g) estimates s^2 (bridge.log_posterior)
    variance = {name: spread(g, means[name], own=name in own, dim=axis) * shrink for name, g in per_grads.items()}
    if terms is None:
        grads = means
    else:  # the terms every group shares (the prior's), once: the same mean, and no spread
        if chains:
            shared_grads, shared_value = batched_gradient(terms[0], latents, batch)
        else:
            shared_grads, shared_value = _gradient_and_value(terms[0], latents, batch)
        grads = {name: shared_grads[name] + g for name, g in means.items()}
        value = shared_value + value
    grad_sq = sum(_per_chain(g.square(), axis).sum(-1) for g in grads.values())
    finite_noise = torch.stack([_per_chain(torch.isfinite(v), axis).all(-1) for v in variance.values()]).all(0)
    diverging = ~(torch.isfinite(value) & torch.isfinite(grad_sq) & finite_noise)
    count = torch.full(value.shape, float(size), dtype=value.dtype, device=value.device)
    return GradientEstimate(grads, value, grad_sq.sqrt(), diverging, variance, count, {})


def _per_chain(x: Tensor, chain_dims: int) -> Tensor:
    """``x`` flattened after its first ``chain_dims`` dimensions (0: one chain, all of it)."""
    return x.reshape(*x.shape[:chain_dims], -1)


def _gradient_and_value(density: Callable, latents: Latents, batch: Any) -> tuple[Latents, Tensor]:
    if any(under_transform(x) for x in latents.values()):
        return grad_and_value(density)(latents, batch)
    # Outside vmap, plain autograd gives the same numbers and saves torch.func's per-call overhead
    # (about half a millisecond on a CPU, as much as a small model's whole backward pass).
    leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
    with torch.enable_grad():
        value = density(leaves, batch)
        values = torch.autograd.grad(value, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(leaves, values, strict=True)), value.detach()


@functools.lru_cache(maxsize=16)
def flag(value: bool, device: torch.device) -> Tensor:
    """A shared 0-d bool tensor (``evaluate``'s divergence flag on a plain CPU step): read it, never write to it."""
    return torch.full((), value, dtype=torch.bool, device=device)


def _no_examples(device: torch.device) -> Tensor:
    """``num_examples`` of a plain gradient: a shared 0-d zero of the default dtype (read, never written)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return torch.zeros((), device=device)
    return _zero(torch.get_default_dtype(), device)


@functools.lru_cache(maxsize=16)
def _zero(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros((), dtype=dtype, device=device)


def chains_gradient(density: MinibatchDensity, latents: Latents, batch: Batch) -> GradientEstimate:
    """:func:`evaluate` for all chains at once: one vmapped log density, one backward pass outside vmap.

    The chains share no parameter, so the gradient of the sum of their log densities with respect to chain c's
    latents is chain c's own gradient. Plain autograd over the vmapped density spares every operation the gradient
    transform that ``vmap(grad_and_value(...))`` wraps it in (a quarter of a small model's vectorised step, on a CPU).

    Example:
        >>> import torch
        >>> from pyro_scalable.bridge import Batch
        >>> from pyro_scalable.infer.gradients import FunctionDensity
        >>> def log_density(latents, batch):
        ...     return -latents["w"].square().sum()
        >>> two_chains = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
        >>> chains_gradient(FunctionDensity(log_density), two_chains, Batch({}, (), {})).grads["w"]
        tensor([[-2., -4.],
                [-6., -8.]])

    """
    grads, values = batched_gradient(density, latents, batch)
    grad_sq = sum(g.square().reshape(g.shape[0], -1).sum(1) for g in grads.values())
    diverging = ~torch.isfinite(values + grad_sq)  # as evaluate's: finite where both are
    count = torch.zeros(values.shape, device=values.device)  # no noise estimated (as estimate_gradient's)
    return GradientEstimate(grads, values, grad_sq.sqrt(), diverging, {}, count, {})


def chain_indices(indices: dict, chain: int) -> dict:
    """Chain ``chain``'s minibatch indices (a shared minibatch is every chain's)."""
    return {name: idx[chain] if idx.dim() == 2 else idx for name, idx in indices.items()}
