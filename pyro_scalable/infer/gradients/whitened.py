r"""A density in the variables of an affine map: what warm-up's metric hands the kernels.

With :math:`\theta = \mu + Lz` over the flattened unconstrained latents (:class:`AffineMap`, ``L`` lower triangular
or diagonal), :class:`WhitenedDensity` is :math:`\log\tilde p(z) = \log p(\mu + Lz)` (the constant
:math:`\log\lvert\det L\rvert` left out). Every gradient, per-example gradient (the noise estimate) and
Hessian-vector product in :math:`z` is :math:`L^\top` times the one in :math:`\theta`, so a kernel, the noise estimate
and warm-up run on it unchanged (:mod:`pyro_scalable.infer.sgmcmc.metric` chooses the map).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.infer.gradients.density import MinibatchDensity, as_density
from pyro_scalable.infer.linearized.layout import ParameterLayout

__all__ = ["AffineMap", "WhitenedDensity"]


class AffineMap(NamedTuple):
    """θ = mean + L z over the flattened unconstrained latents; ``scale`` is L (D × D, lower) or its diagonal (D,)."""

    mean: Tensor
    scale: Tensor

    def to_theta(self, flat: Tensor) -> Tensor:
        """θ from z (leading dims allowed)."""
        if self.scale.dim() == 1:
            return self.mean + flat * self.scale
        return self.mean + flat @ self.scale.T

    def gradient_to_z(self, flat_gradient: Tensor) -> Tensor:
        """The gradient in z of a function whose gradient in θ is ``flat_gradient`` (Lᵀ g; leading dims allowed).

        Example:
            >>> import torch
            >>> affine = AffineMap(torch.zeros(2), torch.tensor([[2.0, 0.0], [1.0, 3.0]]))
            >>> affine.gradient_to_z(torch.tensor([1.0, 1.0]))  # Lᵀ (1, 1)
            tensor([3., 3.])

        """
        if self.scale.dim() == 1:
            return flat_gradient * self.scale
        return flat_gradient @ self.scale

    def to_z(self, flat: Tensor) -> Tensor:
        """The z of θ (leading dims allowed)."""
        centred = flat - self.mean
        if self.scale.dim() == 1:
            return centred / self.scale
        shape = centred.shape
        solved = torch.linalg.solve_triangular(self.scale, centred.reshape(-1, shape[-1]).T, upper=False)
        return solved.T.reshape(shape)


class WhitenedDensity:
    """``density(z, batch) = inner(mean + L z, batch)`` (log|det L| is a constant and left out).

    A :class:`~.density.MinibatchDensity`: ``inner``'s groups of examples, its ``terms`` and its
    ``batched_gradient``, each in z.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.gradients import FunctionDensity
        >>> from pyro_scalable.infer.linearized.layout import ParameterLayout
        >>> inner = FunctionDensity(lambda latents, batch: -0.5 * latents["x"].square().sum())
        >>> affine = AffineMap(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.5]))  # θ = mean + scale z
        >>> whitened = WhitenedDensity(inner, ParameterLayout({"x": torch.Size([2])}), affine)
        >>> whitened({"x": torch.zeros(2)}, None)  # at θ = (1, 2)
        tensor(-2.5000)

    """

    def __init__(self, inner: MinibatchDensity, layout: ParameterLayout, affine: AffineMap):
        self.inner, self.layout, self.affine = inner, layout, affine

    def examples(self, batch: Batch):
        """The wrapped density's split of ``batch`` into groups of examples."""
        return self.inner.examples(batch)

    def __call__(self, latents: Latents, batch: Batch) -> Tensor:
        return self._mapped(self.inner, latents, batch)

    @property
    def terms(self) -> tuple[MinibatchDensity, MinibatchDensity] | None:
        """The wrapped density's ``terms`` (prior's, data's) in z; ``None`` where it has none."""
        inner = self.inner.terms
        return (
            None if inner is None else tuple(WhitenedDensity(as_density(fn), self.layout, self.affine) for fn in inner)
        )

    def _mapped(self, fn: Callable, latents: Latents, batch: Batch) -> Tensor:
        flat = self.affine.to_theta(self.layout.flatten(latents))
        return fn(self.layout.unflatten(flat), batch)

    def batched_gradient(
        self, latents: Latents, batch: Batch, dims: list | None = None, *, create_graph: bool = False
    ) -> tuple[Latents, Tensor] | None:
        """Every chain's gradient in z and value, from the wrapped density's own batched gradient in θ.

        ``latents`` have leading dimensions (``dims``, :mod:`.batched`: one chain dimension by default). ``None``
        where the wrapped one has no ``batched_gradient``.
        """
        levels = 1 if dims is None else len(dims)
        theta = self.layout.unflatten(self.affine.to_theta(self.layout.flatten(latents, batch_dims=levels)))
        result = self.inner.batched_gradient(theta, batch, dims, create_graph=create_graph)
        if result is None:
            return None
        grads, values = result
        return self.layout.unflatten(self.affine.gradient_to_z(self.layout.flatten(grads, batch_dims=levels))), values
