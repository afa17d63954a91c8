r"""Any ``torch.nn.Module`` as a Pyro model: chosen parameters random, the rest fixed, a likelihood in a data plate.

:class:`BayesianNetwork` wraps a network :math:`f_\theta` whose parameters split into random ones :math:`\theta_R`
(chosen by ``random=``, :mod:`.selection`) and fixed ones :math:`\theta_F` (held at the module's values). Called on
data :math:`(x, y)` of N rows it is the Pyro model

.. math::

    \log p(\theta_R, \sigma, y \mid x) = \sum_{s \in R} \log \mathcal{N}(\theta_s; c_s, \sigma_s^2 I)
        + \log p(\sigma) + \frac{N}{B} \sum_{i \in \mathcal{B}} \log p(y_i \mid f_{\theta_R, \theta_F}(x_i), \sigma),

with the priors of :mod:`.priors`, the likelihoods of :mod:`.likelihoods` and :math:`\mathcal{B}` a minibatch of
B rows drawn by the data plate (``pyro.plate("data", N, subsample_size=B)``, which supplies the N/B).

**Sites.** In this order:

1. ``noise_scale`` (only for ``likelihood="normal"`` with ``noise_scale=None``): ``HalfNormal(noise_prior)``;
2. one latent site per random parameter, named by its dotted parameter name (``"fc2.weight"``), with the
   parameter's shape, as one event (``.to_event(dim)``);
3. the plate ``"data"`` of size N (the rows of ``x``, or of each tensor of a dict ``x``), and inside it
4. the observed site ``"y"`` (``obs=None`` draws it), one event per row.

The network runs as ``torch.func.functional_call(module, {**fixed, **random}, x_minibatch)``: the random sites'
values replace the selected parameters, the fixed parameters are the module's own tensors, detached (never a copy,
never a gradient). Engines that run K chains or draws at once (``torch.func.vmap`` over chains) therefore batch
only the random parameters: K copies of :math:`\theta_R`, one of :math:`\theta_F`. The module is put in evaluation
mode (batch norm reads its running statistics, dropout is off) and is never modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide.initialization import init_to_value
from torch import Tensor, nn
from torch.func import functional_call

from pyro_scalable.arguments import check_choice, check_count, check_number
from pyro_scalable.bridge import ModelError
from pyro_scalable.nn.likelihoods import LIKELIHOODS, Likelihood, row_distribution
from pyro_scalable.nn.priors import PriorScale, parameter_prior, prior_scales
from pyro_scalable.nn.selection import RandomChoice, select_parameters

__all__ = ["BayesianNetwork"]

_RESERVED = ("y", "data", "noise_scale")


def _rows(x: Any) -> int:
    """The number of rows of ``x``: a tensor's first dimension, or the common one of a dict's tensors."""
    if isinstance(x, Tensor):
        if x.dim() == 0:
            raise ModelError("x is a 0-d tensor; the network's input needs its rows on the first dimension.")
        return x.shape[0]
    if isinstance(x, Mapping):
        rows = {key: value.shape[0] for key, value in x.items() if isinstance(value, Tensor) and value.dim()}
        if not rows or len(set(rows.values())) != 1:
            raise ModelError(
                f"x is a dict whose tensors must share their first dimension (the rows), got "
                f"{ {key: n for key, n in rows.items()} or 'no tensor' }."
            )
        return next(iter(rows.values()))
    raise ModelError(
        f"x must be a tensor or a dict of tensors (e.g. input_ids, attention_mask), got {type(x).__name__}."
    )


def _take(x: Any, idx: Tensor) -> Any:
    if isinstance(x, Mapping):
        return {key: value[idx] if isinstance(value, Tensor) and value.dim() else value for key, value in x.items()}
    return x[idx]


def _output(result: Any) -> Tensor:
    """The network's output tensor: itself, a model output's ``logits`` (``transformers``), or a tuple's first."""
    if isinstance(result, Tensor):
        return result
    logits = getattr(result, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
        return result[0]
    raise ModelError(f"the network returned {type(result).__name__}; it must return a tensor (or have .logits).")


class BayesianNetwork:
    """A Pyro model of ``module`` whose chosen parameters are random (see the module docstring for its sites).

    Args:
        module: the network; called as ``module(x)`` on a tensor ``x``, ``module(**x)`` on a dict.
        likelihood: ``"normal"``, ``"bernoulli"``, ``"categorical"`` (on logits), or ``output -> Distribution``.
        random: which parameters are random (:mod:`pyro_scalable.nn.selection`); the others are fixed.
        prior_scale: the priors' sd: a number, a mapping by name or layer (layer-wise), or ``"fan_in"``.
        prior_center: ``"zero"`` or ``"pretrained"`` (the module's current values).
        noise_scale: for ``"normal"``: a fixed sd, or ``None`` for a latent ``noise_scale`` site.
        noise_prior: the sd of the latent noise scale's ``HalfNormal`` prior.
        batch_size: the minibatch size B of the data plate (at most N); ``None`` for every row at every step.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
        >>> model = BayesianNetwork(net, likelihood="normal", random="last_layer", batch_size=32)
        >>> model.random_names
        ['2.weight', '2.bias']
        >>> trace = pyro.poutine.trace(model).get_trace(torch.randn(100, 3), torch.randn(100))
        >>> [name for name, site in trace.nodes.items() if site["type"] == "sample"]
        ['noise_scale', '2.weight', '2.bias', 'data', 'y']

    """

    def __init__(
        self,
        module: nn.Module,
        likelihood: Likelihood = "normal",
        *,
        random: RandomChoice = "all",
        prior_scale: PriorScale = 1.0,
        prior_center: Literal["zero", "pretrained"] = "zero",
        noise_scale: float | None = None,
        noise_prior: float = 1.0,
        batch_size: int | None = 128,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
        if not callable(likelihood):
            check_choice("likelihood", likelihood, LIKELIHOODS)
        self.module = module.eval()
        self.likelihood = likelihood
        self.prior_center = check_choice("prior_center", prior_center, ("zero", "pretrained"))
        self.noise_scale = check_number("noise_scale", noise_scale, positive=True, optional=True)
        self.noise_prior = check_number("noise_prior", noise_prior, positive=True)
        self.batch_size = check_count("batch_size", batch_size, optional=True)
        self.random_names = select_parameters(module, random)
        clash = [name for name in self.random_names if name in _RESERVED]
        if clash:
            raise ValueError(f"the parameter name {clash[0]!r} is one of the model's own sites {_RESERVED}; rename it.")
        parameters = dict(module.named_parameters())
        self.fixed = {name: p.detach() for name, p in parameters.items() if name not in self.random_names}
        random_values = {name: parameters[name].detach() for name in self.random_names}
        self.prior_scales = prior_scales(random_values, prior_scale)
        self.priors = {
            name: parameter_prior(value, self.prior_scales[name], self.prior_center)
            for name, value in random_values.items()
        }
        #: the random parameters' values when the model was built (copies), by site name
        self.pretrained = {name: value.clone() for name, value in random_values.items()}
        #: a Pyro init strategy that starts every chain (or the MAP search) at :attr:`pretrained`
        self.init_to_pretrained = init_to_value(values=self.pretrained)

    @property
    def learns_noise(self) -> bool:
        """Whether the model has a latent ``noise_scale`` site (a ``"normal"`` likelihood with no fixed sd)."""
        return self.likelihood == "normal" and self.noise_scale is None

    def num_random(self) -> int:
        """The number of random scalars (the random parameters' elements, without the noise scale)."""
        return sum(prior.event_shape.numel() for prior in self.priors.values())

    def __call__(
        self,
        x: Tensor | Mapping[str, Tensor],
        y: Tensor | None = None,
        *,
        batch_size: int | None | Literal["default"] = "default",
    ) -> Tensor:
        """Run the model on ``x`` (a tensor, or a dict passed as keyword arguments) and condition on ``y``.

        ``batch_size`` overrides the constructor's for this call (``None``: every row; e.g. a MAP search by SVI).
        """
        if self.module.training:
            raise ModelError(
                "the module is in training mode (batch norm would update its running statistics, dropout draw "
                "masks); call module.eval() again before running the model."
            )
        rows = _rows(x)
        size = self.batch_size if batch_size == "default" else batch_size
        noise = self.noise_scale
        if self.learns_noise:
            reference = next(iter(self.priors.values())).mean
            noise = pyro.sample("noise_scale", dist.HalfNormal(reference.new_tensor(self.noise_prior)))
        random = {name: pyro.sample(name, prior) for name, prior in self.priors.items()}
        data = pyro.plate("data", rows, subsample_size=None if size is None else min(size, rows))
        inputs = _take(x, data.indices)
        params = {**self.fixed, **random}
        if isinstance(inputs, Mapping):
            result = functional_call(self.module, params, (), dict(inputs))
        else:
            result = functional_call(self.module, params, (inputs,))
        law = row_distribution(self.likelihood, _output(result), noise)
        with data:
            return pyro.sample("y", law, obs=None if y is None else y[data.indices])

    def __repr__(self) -> str:
        return (
            f"BayesianNetwork({type(self.module).__name__}, likelihood={self.likelihood!r}, "
            f"{len(self.random_names)} random parameters ({self.num_random()} scalars), {len(self.fixed)} fixed)"
        )
