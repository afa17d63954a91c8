r"""The likelihoods of ``BayesianNetwork``: the law of one row's target given the network's output on that row.

The network's output :math:`f = f_\theta(x)` on a minibatch has the rows first, ``(B, ...)``.

* ``"normal"``: :math:`y_i \sim \mathcal{N}(f_i, \sigma^2)`, with a fixed :math:`\sigma` (``noise_scale=0.1``)
  or a learned one (``noise_scale=None``: a latent site ``noise_scale`` with a ``HalfNormal(noise_prior)`` prior,
  sampled outside the data plate);
* ``"bernoulli"``: :math:`y_i \sim \mathrm{Bernoulli}(\mathrm{sigmoid}(f_i))`, the output read as logits;
* ``"categorical"``: :math:`y_i \sim \mathrm{Categorical}(\mathrm{softmax}(f_i))`, logits over the last dimension;
* a callable ``output -> Distribution`` whose batch shape starts with the rows.

An output whose last dimension is 1 (``nn.Linear(h, 1)``) is squeezed there for ``"normal"`` and ``"bernoulli"``.
Every dimension after the rows that is not the distribution's own event (a sequence's positions, several outputs)
is made part of the event, so each row contributes one log-likelihood term and the data plate scales it by N/B.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Union

import pyro.distributions as dist
from torch import Tensor

__all__ = ["LIKELIHOODS", "Likelihood", "row_distribution"]

LIKELIHOODS = ("normal", "bernoulli", "categorical")
Likelihood = Union[Literal["normal", "bernoulli", "categorical"], Callable[[Tensor], dist.Distribution]]


def _squeezed(output: Tensor) -> Tensor:
    return output.squeeze(-1) if output.dim() >= 2 and output.shape[-1] == 1 else output


def row_distribution(likelihood: Likelihood, output: Tensor, noise_scale: Tensor | float | None) -> dist.Distribution:
    """The law of the minibatch's targets given the network's ``output``, batch shape ``(B,)``.

    Example:
        >>> import torch
        >>> row_distribution("categorical", torch.zeros(5, 7, 3), None).batch_shape  # 5 sequences of 7 tokens
        torch.Size([5])

    """
    if likelihood == "normal":
        law = dist.Normal(_squeezed(output), noise_scale)
    elif likelihood == "bernoulli":
        law = dist.Bernoulli(logits=_squeezed(output))
    elif likelihood == "categorical":
        law = dist.Categorical(logits=output)
    else:
        law = likelihood(output)
        if not isinstance(law, dist.torch_distribution.TorchDistributionMixin):
            raise TypeError(f"likelihood must return a Pyro distribution, got {type(law).__name__}.")
    if law.batch_shape[:1] != output.shape[:1]:
        raise ValueError(
            f"the likelihood's batch shape {tuple(law.batch_shape)} does not start with the minibatch's "
            f"{output.shape[0]} rows (the network's output has shape {tuple(output.shape)})."
        )
    return law.to_event(len(law.batch_shape) - 1) if len(law.batch_shape) > 1 else law
