r"""The control variate: a minibatch log joint whose gradient noise vanishes at a centre near the posterior mode.

With a subsampled plate of N points and a minibatch :math:`\mathcal{B}` of B of them, the bridge's minibatch
estimate of the log joint is :math:`\ell_{\mathcal{B}}(\theta) = \log p(\theta) + \frac{N}{B}\sum_{i\in\mathcal{B}}
\log p(y_i\mid\theta)`; its gradient's covariance is :math:`O(N^2/B)` (:mod:`.estimate`). Given a centre
:math:`\hat\theta` and the full-data log joint :math:`\ell(\hat\theta)` and gradient :math:`\nabla\ell(\hat\theta)`
(one pass over the data), the **controlled** estimate (Baker, Fearnhead, Fox & Nemeth 2019, "Control variates for
stochastic gradient MCMC"; Nagapetyan et al. 2017) is

.. math::

    \tilde\ell_{\mathcal{B}}(\theta) = \ell(\hat\theta) + \ell_{\mathcal{B}}(\theta) - \ell_{\mathcal{B}}(\hat\theta)
        + \big\langle \nabla\ell(\hat\theta) - \nabla\ell_{\mathcal{B}}(\hat\theta),\ \theta - \hat\theta\big\rangle.

Both corrections have mean zero over minibatches, so :math:`\tilde\ell_{\mathcal{B}}` is again an unbiased
estimate of the log joint, and its gradient is the control-variate gradient

.. math::

    \nabla\tilde\ell_{\mathcal{B}}(\theta) = \nabla\ell(\hat\theta)
        + \big(\nabla\ell_{\mathcal{B}}(\theta) - \nabla\ell_{\mathcal{B}}(\hat\theta)\big),

in which the prior's terms cancel to :math:`\nabla\log p(\theta) - \nabla\log p(\hat\theta)` and the data's to
:math:`\frac{N}{B}\sum_{\mathcal{B}}(\nabla\log p(y_i\mid\theta) - \nabla\log p(y_i\mid\hat\theta))`. Its covariance is
:math:`(1 - B/N)\,\mathrm{Cov}_i(g_i(\theta) - g_i(\hat\theta))/B = O(N^2\lVert\theta-\hat\theta\rVert^2/B)`: zero at
:math:`\hat\theta`, and, with :math:`\lVert\theta-\hat\theta\rVert = O(N^{-1/2})` across the posterior, :math:`O(N/B)`
where the plain estimate's is :math:`O(N^2/B)`. The value's own noise is second order in
:math:`\theta-\hat\theta`.

:class:`ControlledDensity` is this estimate as a minibatch density: every kernel, warm-up (its
curvature is that of :math:`\ell_{\mathcal{B}}`, the linear term having none) and the per-example noise estimate
(whose single-example terms :math:`g_i(\theta) - g_i(\hat\theta) + \nabla\ell(\hat\theta)` have the spread above) use
it unchanged, so the noise correction and warm-up's step size see the reduced noise. A step evaluates the model
twice (at :math:`\theta` and :math:`\hat\theta`, on the same minibatch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.infer.full_data import ControlVariate
from pyro_scalable.infer.full_data import point_gradient_and_value as _gradient_and_value
from pyro_scalable.infer.gradients.batched import batched_gradient, index_dims
from pyro_scalable.infer.gradients.density import MinibatchDensity, as_density

__all__ = ["ControlVariate", "ControlledDensity"]


class ControlledDensity:
    """The controlled minibatch log joint (module docstring) of density ``inner`` around ``control``'s centre.

    A :class:`~.density.MinibatchDensity` (``inner``'s ``examples``, its ``terms`` each controlled); ``control=None``
    is ``inner``'s plain estimate (a centre warm-up has not chosen yet).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> from pyro_scalable.infer.full_data import full_data_gradient
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.arange(20.0),))
        >>> control = full_data_gradient(bridge, {"mu": torch.tensor(9.5)})
        >>> batch = Batch({"data": torch.tensor([0, 1, 2, 3, 4])}, bridge.args, {})
        >>> controlled = ControlledDensity(bridge.log_posterior_fn, control)
        >>> exact = bridge.log_posterior({"mu": torch.tensor(9.5)}, bridge.full_batch())
        >>> bool(torch.isclose(controlled({"mu": torch.tensor(9.5)}, batch), exact))  # exact at the centre
        True

    """

    def __init__(self, inner: MinibatchDensity, control: ControlVariate | None, *, anchored: bool = True):
        self.inner = inner
        self.control = control  # None: the plain estimate (a warm-up centre not chosen yet)
        # False: the data's terms apart (``terms``), which take no share of the full-data value and gradient
        self.anchored = anchored

    def examples(self, batch: Batch):
        """The wrapped density's split of ``batch`` into groups of examples."""
        return self.inner.examples(batch)

    def __call__(self, latents: Latents, batch: Batch) -> Tensor:
        if self.control is None:
            return self.inner(latents, batch)
        anchor, offset = (self.control.gradient, self.control.log_joint) if self.anchored else (None, None)
        centre = self.control.centre
        at_centre, value_at_centre = _gradient_and_value(self.inner, centre, batch)
        value = self.inner(latents, batch) - value_at_centre
        if offset is not None:
            value = value + offset
        for name, x in latents.items():
            slope = at_centre[name] if anchor is None else at_centre[name] - anchor[name]
            value = value - (slope * (x - centre[name])).sum()
        return value

    @property
    def terms(self) -> tuple[MinibatchDensity, MinibatchDensity] | None:
        """The wrapped density's ``terms`` (prior's, data's), each controlled with its own share of the centre.

        The prior's terms take the full-data value and gradient at the centre, the data's none; the two sum to the
        controlled estimate. ``None`` where the wrapped one has none.
        """
        inner = self.inner.terms
        if inner is None or self.control is None:
            return inner
        shared, grouped = (as_density(fn) for fn in inner)
        return ControlledDensity(shared, self.control), ControlledDensity(grouped, self.control, anchored=False)

    def batched_gradient(
        self, latents: Latents, batch: Batch, dims: list | None = None, *, create_graph: bool = False
    ) -> tuple[Latents, Tensor]:
        """Every chain's controlled gradient and value (``latents`` with leading dimensions, :mod:`.batched`).

        The chains at θ and at the centre, each on its chain's minibatch, are one batch of 2C points and one
        backward pass (:func:`~.batched.batched_gradient` of the wrapped density): the centre's minibatch gradient
        is not a gradient transform nested in the chains' vmap, as in :meth:`__call__`. ``dims``: the indices'
        ``in_dims`` at each leading dimension (default one chain dimension); ``create_graph``: the gradients stay
        differentiable in ``latents`` (the centre's half is a constant: the controlled Hessian is the wrapped one's).

        Example:
            >>> import pyro, pyro.distributions as dist, torch
            >>> from pyro_scalable.bridge import ModelBridge
            >>> from pyro_scalable.infer.full_data import full_data_gradient
            >>> def model(y):
            ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
            ...     with pyro.plate("data", len(y), subsample_size=5) as idx:
            ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
            >>> bridge = ModelBridge(model, (torch.arange(20.0),))
            >>> controlled = ControlledDensity(
            ...     bridge.log_posterior_fn, full_data_gradient(bridge, {"mu": torch.tensor(9.5)}))
            >>> minibatches = Batch({"data": torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])}, bridge.args, {})
            >>> grads, values = controlled.batched_gradient({"mu": torch.tensor([8.0, 9.5])}, minibatches)
            >>> exact = bridge.log_posterior({"mu": torch.tensor(9.5)}, bridge.full_batch())
            >>> bool(torch.isclose(values[1], exact))  # the chain at the centre: exact, whatever its minibatch
            True

        """
        if self.control is None:
            return batched_gradient(self.inner, latents, batch, dims, create_graph=create_graph)
        centre, full_gradient, full_value = self.control
        dims = [index_dims(batch.indices)] if dims is None else dims
        chains = next(iter(latents.values())).shape[0]
        both = {name: torch.cat([x, centre[name].expand_as(x)]) for name, x in latents.items()}
        doubled = {name: torch.cat([idx, idx]) if dims[0][name] == 0 else idx for name, idx in batch.indices.items()}
        both_batch = Batch(doubled, batch.args, batch.kwargs)
        grads, values = batched_gradient(self.inner, both, both_batch, dims, create_graph=create_graph)
        value = values[:chains] - values[chains:]
        if self.anchored:
            value = value + full_value
        controlled = {}
        for name, x in latents.items():
            correction = -grads[name][chains:]
            if self.anchored:
                correction = correction + full_gradient[name]
            controlled[name] = grads[name][:chains] + correction
            value = value + (correction * (x - centre[name])).reshape(*value.shape, -1).sum(-1)
        return controlled, value
