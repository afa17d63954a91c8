r"""A multilevel model's log joint split by group: the terms a block sampler of the local latents needs.

With a group plate of :math:`G` groups holding the local latents :math:`b_k` (unconstrained), global latents
:math:`\theta`, and data rows :math:`i` each reading one group :math:`g(i)` (:mod:`.row_groups`), the log joint is

.. math::

    \log p(\theta, b, y) = \underbrace{\log p(\theta)}_{\text{global}}
        + \sum_{k=1}^{G} \underbrace{\log p(b_k \mid \theta)}_{\text{group } k}
        + \sum_{i=1}^{N} \underbrace{\log p(y_i \mid \theta, b_{g(i)})}_{\text{row } i},

each latent's term with its Jacobian. Given :math:`\theta`, group :math:`k`'s conditional is its own term plus its
rows', :math:`\log p(b_k \mid \theta, y) = \log p(b_k \mid \theta) + \sum_{g(i) = k} \log p(y_i \mid \theta, b_k)
+ \text{const}`: no other group's latents and no other rows enter, and no :math:`N/B` scale. :func:`group_terms`
evaluates the model once at given latents on given rows (read through the data plate's subsample: a step reads the
rows of the groups it moves, never all of them) and returns the three kinds of term unsummed: the global terms as
one number, the group terms as a vector over the plate, the rows' log-likelihoods (unscaled) as a vector over the
rows. A sampler sums them as its conditional needs; their sum over all rows is the log joint
(:meth:`ModelBridge.log_posterior` on the full data, tested to rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents, ModelBridge, _validation
from pyro_scalable.bridge.plates import plate_indices
from pyro_scalable.bridge.row_groups import RowGroups
from pyro_scalable.bridge.traced import TracedLogDensity

__all__ = ["GroupTerms", "GroupTermsOf", "group_terms"]


class GroupTerms(NamedTuple):
    """A model's log joint at given latents, by kind of term (module docstring)."""

    globals: Tensor  # 0-d: the prior terms of the latents outside the group plate (and observed sites in no plate)
    groups: Tensor  # (G,): each group's prior terms of its local latents (and observed sites in the group plate)
    rows: Tensor  # (R,): each given row's log-likelihood, unscaled, summed over the observed sites in the data plate


def _along(log_prob: Tensor, frames, plate: str) -> Tensor | None:
    """``log_prob`` summed over every dimension but ``plate``'s, or ``None`` where the site is not in ``plate``."""
    for frame in frames:
        if frame.name == plate and frame.dim is not None:
            dim = frame.dim if log_prob.dim() >= -frame.dim else None
            if dim is None:  # a value broadcast along the plate: one term, the same for every index
                return None
            return log_prob.movedim(dim, 0).reshape(log_prob.shape[dim], -1).sum(1)
    return None


class _Terms(Messenger):
    """Substitute unconstrained latents; keep each site's terms along the group or the data plate."""

    def __init__(self, bridge: ModelBridge, latents: Latents, plate: str, data_plate: str, num_groups: int):
        super().__init__()
        self.bridge, self.latents, self.plate, self.data_plate = bridge, latents, plate, data_plate
        self.globals: Tensor | float = 0.0
        self.groups: Tensor | float = 0.0
        self.rows: Tensor | float = 0.0
        self.num_groups = num_groups
        self.jacobians: dict[str, Tensor] = {}

    def _pyro_sample(self, msg) -> None:
        if site_is_subsample(msg) or msg["is_observed"]:
            return
        site = self.bridge.sites[msg["name"]]
        unconstrained = self.latents[site.name]
        value = site.transform(unconstrained)
        if site.has_jacobian:
            self.jacobians[site.name] = site.transform.log_abs_det_jacobian(unconstrained, value)
        msg["value"] = value
        msg["done"] = True

    def _pyro_post_sample(self, msg) -> None:
        if site_is_subsample(msg) or msg["infer"].get("_deterministic"):
            return
        fn, value = msg["fn"], msg["value"]
        term = fn.log_prob(value, *msg["args"], **msg["kwargs"])
        if msg["is_observed"]:
            rows = _along(term, msg["cond_indep_stack"], self.data_plate)
            if rows is not None:  # unscaled: the rows given are the rows wanted
                self.rows = self.rows + rows
                return
        else:
            jacobian = self.jacobians.get(msg["name"])
            if jacobian is not None:  # elementwise or over the event's dims: summed down to the batch's shape
                extra = jacobian.dim() - term.dim()
                term = term + (jacobian.reshape(jacobian.shape[: term.dim()] + (-1,)).sum(-1) if extra else jacobian)
        term = scale_and_mask(term, msg["scale"], msg["mask"])
        groups = _along(term, msg["cond_indep_stack"], self.plate)
        if groups is not None and groups.shape[0] == self.num_groups:
            self.groups = self.groups + groups
        else:
            self.globals = self.globals + term.sum()


class GroupTermsOf:
    """:func:`group_terms` of one model, replayed from a recorded graph per signature (:mod:`.traced`).

    ``terms(latents, rows)`` runs the model through Pyro on the first calls of each signature (the rows' number and
    the latents' shapes), then from the graph recorded and checked as the log posterior's is.
    """

    def __init__(self, bridge: ModelBridge, groups: RowGroups):
        self.bridge, self.groups = bridge, groups
        self.traced = TracedLogDensity(self._evaluate, {groups.data_plate: len(groups.group)})

    def _evaluate(self, latents: Latents, batch: Batch) -> Tensor:
        rows = batch.indices[self.groups.data_plate]
        terms = group_terms(self.bridge, self.groups, latents, rows)
        return torch.cat([terms.globals.reshape(1), terms.groups, terms.rows])

    def __call__(self, latents: Latents, rows: Tensor) -> GroupTerms:
        batch = Batch({self.groups.data_plate: rows}, self.bridge.args, self.bridge.kwargs)
        flat = self.traced(latents, batch)
        size = self.groups.num_groups
        return GroupTerms(flat[0], flat[1 : size + 1], flat[size + 1 :])


def group_terms(bridge: ModelBridge, groups: RowGroups, latents: Latents, rows: Tensor) -> GroupTerms:
    """The model's terms at unconstrained ``latents`` (one chain's) on data rows ``rows`` (module docstring).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> from pyro_scalable.bridge.row_groups import row_groups
        >>> def model(g, y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        ...     with pyro.plate("groups", 3):
        ...         b = pyro.sample("b", dist.Normal(mu, 1.0))
        ...     with pyro.plate("data", len(y), subsample_size=4) as idx:
        ...         pyro.sample("obs", dist.Normal(b[g[idx]], 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.arange(12) % 3, torch.zeros(12)))
        >>> latents = {"mu": torch.tensor(0.0), "b": torch.tensor([0.0, 1.0, 2.0])}
        >>> terms = group_terms(bridge, row_groups(bridge), latents, torch.tensor([1, 4]))
        >>> terms.groups - terms.groups[0], terms.rows
        (tensor([ 0.0000, -0.5000, -2.0000]), tensor([-1.4189, -1.4189]))

    """
    batch = Batch({groups.data_plate: rows}, bridge.args, bridge.kwargs)
    handler = _Terms(bridge, latents, groups.plate, groups.data_plate, groups.num_groups)
    with _validation(False), plate_indices(batch.indices, full_data=True), handler:
        bridge.model(*batch.args, **batch.kwargs)
    zero = next(iter(latents.values())).new_zeros(())
    as_tensor = lambda x, shape: x if isinstance(x, Tensor) else zero.expand(shape)  # noqa: E731
    return GroupTerms(
        as_tensor(handler.globals, ()).reshape(()),
        as_tensor(handler.groups, (groups.num_groups,)),
        as_tensor(handler.rows, rows.shape),
    )
