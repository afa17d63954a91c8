"""The minibatch density: the one object a gradient estimate is taken of, and its written contract.

A :class:`MinibatchDensity` is ``density(latents, batch)``, an unbiased minibatch estimate of the full-data log joint,
and offers three things every estimate may use, always present (``None`` where it has nothing to give), never
probed for:

* ``examples(batch)``: the minibatch split into groups of examples along a leading dimension, each an estimate of
  the log joint on its own (:class:`~pyro_scalable.bridge.log_posterior.Examples`: the groups, their ``in_dims`` for
  ``torch.func.vmap``, the number of data points N they are drawn from (``inf`` for draws with replacement), the
  group size); ``None`` where the batch is the full data and the gradient exact. The per-example noise estimate
  needs it (:func:`~.estimate.estimate_gradient`).
* ``terms``: a pair ``(shared, grouped)`` of densities (or functions of ``(latents, batch)``) that sum to this one,
  ``shared`` reading none of the minibatch's examples (the prior's terms), or ``None``: the noise estimate then
  evaluates ``shared`` once and only ``grouped`` per group.
* ``batched_gradient(latents, batch, dims=None, *, create_graph=False)``: every point's gradient and value for
  latents with leading dimensions (the chains, and within them a minibatch's groups of examples: ``dims`` gives the
  indices' ``in_dims`` at each), where the density computes them better than nested vmaps of itself and one
  backward pass; ``None`` where it does not (:func:`~.batched.batched_gradient` then does that). With
  ``create_graph`` the gradients stay differentiable in the latents (a Hessian-vector product's second pass).

The densities here: the bridge's log posterior of a Pyro model
(:class:`~pyro_scalable.bridge.log_posterior.LogPosterior`), the control variate around it
(:class:`~.controlled.ControlledDensity`), the density in warm-up's metric's variables
(:class:`~.whitened.WhitenedDensity`), and :class:`FunctionDensity` for a plain function of ``(latents, batch)``;
:class:`Density` is a base for a hand-written one.
Each is immutable once made: a run that changes what its steps' gradient is (a control variate switched on, a new
metric, a new centre) makes another and hands it to the chain stepper with the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents

__all__ = ["Density", "FunctionDensity", "MinibatchDensity", "as_density"]


@runtime_checkable
class MinibatchDensity(Protocol):
    """``density(latents, batch)``: an unbiased minibatch estimate of the log joint, with the contract above."""

    terms: tuple[Callable, Callable] | None

    def __call__(self, latents: Latents, batch: Any) -> Tensor: ...

    def examples(self, batch: Batch) -> Any:
        """The minibatch split into groups of examples (``Examples``), or ``None`` for the full data."""

    def batched_gradient(
        self, latents: Latents, batch: Batch, dims: list | None = None, *, create_graph: bool = False
    ) -> tuple[Latents, Tensor] | None:
        """Every point's gradient and value, or ``None`` (nested vmaps of the density, one backward pass then)."""


class Density:
    """A base for a hand-written :class:`MinibatchDensity`: define ``__call__``, and ``examples`` for the noise.

    The defaults: no terms apart, no batched gradient of its own, no groups of examples (asking for the noise names
    what is missing).
    """

    terms: tuple[Callable, Callable] | None = None

    def __call__(self, latents: Latents, batch: Any) -> Tensor:
        raise NotImplementedError

    def examples(self, batch: Any) -> Any:
        raise TypeError(
            f"estimating the gradient noise needs per-example terms: {type(self).__name__} offers no examples(batch). "
            "Use the Pyro bridge's log posterior (ModelBridge(model, args).log_posterior_fn offers it for a model "
            "with a subsampled plate), or define examples(batch) (pyro_scalable.infer.gradients.MinibatchDensity)."
        )

    @staticmethod
    def batched_gradient(latents: Latents, batch: Any, dims: list | None = None, *, create_graph: bool = False) -> None:
        return None


class FunctionDensity(Density):
    """A plain function of ``(latents, batch)`` as a :class:`MinibatchDensity`: no groups of examples, no terms."""

    def __init__(self, function: Callable[[Latents, Any], Tensor]):
        self.function = function

    def __call__(self, latents: Latents, batch: Any) -> Tensor:
        return self.function(latents, batch)


def as_density(function: Any) -> MinibatchDensity:
    """``function`` where it is a :class:`MinibatchDensity` already, else a :class:`FunctionDensity` around it.

    Example:
        >>> import torch
        >>> density = as_density(lambda latents, batch: -latents["x"].square().sum())
        >>> isinstance(density, MinibatchDensity), density.terms, density({"x": torch.ones(2)}, None)
        (True, None, tensor(-2.))
        >>> as_density(density) is density
        True

    """
    return function if isinstance(function, MinibatchDensity) else FunctionDensity(function)
