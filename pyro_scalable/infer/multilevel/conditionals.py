r"""Each group's conditional given the globals, and its Laplace map: the densities the sweep (:mod:`.sweep`) moves on.

Group :math:`k`'s conditional :math:`\ell_k(b_k; \theta) = \log p(b_k \mid \theta) + \sum_{g(i)=k} \log p(y_i \mid
\theta, b_k)` reads its own prior term and its own rows (through the data plate's subsample). All densities here are
one chain's; the sweep maps them over chains.

**The Laplace map.** From a reference point :math:`\bar b_k` (fixed in sampling), central differences of
:math:`\ell_k(\cdot\,; \theta)` at :math:`\bar b_k \pm w_{kj} e_j` and :math:`\bar b_k \pm (w_{kj} e_j + w_{kl} e_l)`
(:math:`1 + p + p^2` evaluations, all in one batched pass; :math:`w_k` the group's conditional spread at the reference)
give its gradient :math:`g_k(\theta)` and negative Hessian :math:`P_k(\theta) = L_k(\theta) L_k(\theta)^\top`, and
one Newton step gives the conditional's centre :math:`m_k(\theta) = \bar b_k + P_k(\theta)^{-1} g_k(\theta)`. Both
are exact for a conditional that is Gaussian in :math:`b_k` (a Gaussian likelihood and group prior, centred or not,
whatever :math:`\theta` is), and both are smooth functions of :math:`\theta` alone for any model (where the
differences give no positive-definite :math:`P_k`, the reference point's curvature factor stands in). The map reads
at most :data:`MAP_ROWS` of each group's rows (a fixed sample, each row weighted by :math:`n_k / m_k`): it need only
be a deterministic function of :math:`\theta`, not the exact conditional, so a large group's map costs no more
than a small one's, while the moves' densities read every row.

With the rows' proxy (:mod:`.proxy`), the densities read the priors' terms exactly and the rows' terms by the
proxy, reading no row; the map's differences then read the priors' terms only, and the proxy's quadratic in
:math:`b_k` adds its gradient and curvature exactly. ``taylor`` is the chains' proxy, or ``()`` without one (a
pytree that :func:`torch.func.vmap` maps over).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad, vmap

from pyro_scalable.bridge.group_terms import GroupTermsOf
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.row_groups import RowGroups
from pyro_scalable.infer.multilevel import small
from pyro_scalable.infer.multilevel.layout import Layout
from pyro_scalable.infer.multilevel.proxy import Taylor, fit
from pyro_scalable.infer.multilevel.rows import Rows, sums, wide
from pyro_scalable.infer.multilevel.stencil import derivatives, stencil

__all__ = ["MAP_ROWS", "PROXY_ROWS", "Conditionals"]

MAP_ROWS = 32  # rows of each group (at most) that its Laplace map reads, weighted to all of them
PROXY_ROWS = 50_000  # from this many rows, the moves run on the rows' proxy (:mod:`.proxy`) by default


class Conditionals:
    """A multilevel model's densities by block, each group's Laplace map, and the rows' proxy (module docstring)."""

    def __init__(self, bridge: ModelBridge, groups: RowGroups, dtype: torch.dtype, proxy: bool | None):
        self.bridge, self.groups = bridge, groups
        self.layout = Layout(bridge, groups)
        self.terms = GroupTermsOf(bridge, groups)
        self.rows = Rows(groups)
        self.num_groups = groups.num_groups
        self.rows_read = 0
        self.p = self.layout.local_size
        self.stencil, self.pairs = stencil(self.p, torch.ones((), dtype=dtype, device=bridge.device))
        self.map_rows, self.map_group, self.map_weight = self.rows.sample(MAP_ROWS, dtype)
        self.map_share = self.map_rows.shape[0] / self.rows.all.shape[0]  # of a data pass, per point of the stencil
        self.wants_proxy = proxy if proxy is not None else len(groups.group) >= PROXY_ROWS
        self.one_row = self.rows.all[:1]  # with the proxy, the priors' terms are read on one row (its term ignored)
        self.read: list[int] | None = None  # the globals the rows read (the proxy's products skip the others)
        self.taylor: Taylor | tuple = ()  # each chain's proxy at its reference point

    def _terms(self, theta: Tensor, b: Tensor, rows: Tensor):
        return self.terms(self.layout.join(theta, b), rows)

    def _local(self, b: Tensor, theta: Tensor, drawn: Tensor, rows: Tensor, slot: Tensor):
        terms = self._terms(theta, b, rows)
        per_group = wide(terms.groups[drawn]) + sums(terms.rows, slot, len(drawn))
        return per_group.sum(), per_group

    def _joint(self, theta: Tensor, b: Tensor, taylor: Taylor | tuple = ()):
        """The log joint on all rows, with every group's conditional (its terms and its rows') beside it.

        With ``taylor``, the rows' terms are the proxy's (:mod:`.proxy`) and no row is read.
        """
        if taylor:
            terms = self._terms(theta, b, self.one_row)
            per_group = wide(terms.groups) + taylor.groups(theta, b)
            return wide(terms.globals) + taylor.globals(theta) + per_group.sum(), per_group
        terms = self._terms(theta, b, self.rows.all)
        per_group = wide(terms.groups) + sums(terms.rows, self.rows.group, self.num_groups)
        return wide(terms.globals) + per_group.sum(), per_group

    def _local_proxy(self, b: Tensor, theta: Tensor, drawn: Tensor, taylor: Taylor):
        """The drawn groups' conditionals with the rows' terms by the proxy: no row read."""
        prior = wide(self._terms(theta, b, self.one_row).groups[drawn])
        per_group = prior + taylor.subset(drawn).groups(theta, b[drawn])
        return per_group.sum(), per_group

    def _rows_by_group(self, theta: Tensor, b: Tensor, rows: Tensor, slot: Tensor, size: int) -> Tensor:
        """The rows' log-likelihood summed by group (``slot``: each row's place among ``size`` groups)."""
        return sums(self._terms(theta, b, rows).rows, slot, size)

    def _changes(self, theta: Tensor, b_ref: Tensor, width: Tensor, prior_only: bool = False) -> Tensor:
        """Each group's conditional at the stencil's points less its value at the centre: ``(S - 1, G)``, wide.

        On the map's rows (at most :data:`MAP_ROWS` of each group's, weighted to all). Each row's change is taken
        before the rows are summed: a large group's conditional is a sum of thousands of terms, and the difference
        of two such sums in single precision would lose the change to rounding (noise in the map that the globals'
        acceptance would pay for). With ``prior_only``, the groups' prior terms alone (the proxy adds the rows').
        """

        def at(step: Tensor) -> tuple[Tensor, Tensor]:
            terms = self._terms(theta, b_ref + width * step, self.one_row if prior_only else self.map_rows)
            return terms.groups, terms.rows

        groups, rows = vmap(at)(self.stencil)
        if prior_only:
            return wide(groups[1:] - groups[:1])
        rows = wide(rows[1:] - rows[:1])
        if self.map_weight is not None:
            rows = rows * self.map_weight
        return wide(groups[1:] - groups[:1]) + vmap(lambda r: sums(r, self.map_group, self.num_groups))(rows)

    def _curvature(self, theta: Tensor, b: Tensor) -> Tensor:
        """Each group's ``(p, p)`` negative Hessian of its conditional in ``b`` by autodiff: p products."""
        columns = []
        for j in range(b.shape[-1]):
            tangent = torch.zeros_like(b)
            tangent[..., j] = 1.0
            # reverse over reverse: torch's forward mode runs its decompositions in Python, many times slower here
            along = lambda x, v=tangent: (grad(lambda y: self._joint(theta, y)[0])(x) * v).sum()  # noqa: E731
            columns.append(-grad(along)(b))
        return torch.stack(columns, -1)

    def _differences(
        self, theta: Tensor, b_ref: Tensor, width: Tensor, taylor: Taylor | tuple = ()
    ) -> tuple[Tensor, Tensor]:
        """Each group's conditional's gradient ``(G, p)`` and negative Hessian ``(G, p, p)`` at ``b_ref`` (one chain).

        By central differences of widths ``width`` (``(G, p)``), every point of the stencil in one batched evaluation;
        with ``taylor``, the differences read the priors' terms only and the proxy's quadratic adds its own exactly.
        """
        changes = self._changes(theta, b_ref, width, bool(taylor))  # (S - 1, G): from the centre to each other point
        gradient, hessian = derivatives(changes, wide(width), self.pairs)
        if taylor:
            gradient, hessian = gradient + taylor.gradient_b(theta, b_ref), hessian + taylor.curvature(theta)
        return gradient, -hessian  # wide: the Laplace map is formed in double precision, then narrowed

    def _laplace(self, theta: Tensor, b_ref: Tensor, width: Tensor, fallback: Tensor, taylor: Taylor | tuple = ()):
        """Each group's Laplace map at ``theta`` (one chain): its centre ``m_k`` and factor ``L_k`` (docstring)."""
        gradient, precision = self._differences(theta, b_ref, width, taylor)
        factor, ok = small.cholesky(precision)
        factor = torch.where(ok[:, None, None], factor, wide(fallback))
        shift = small.cholesky_solve(gradient, factor)
        return b_ref + shift.to(b_ref.dtype), factor.to(b_ref.dtype)

    def _transformed(self, x, offset, eps, b_ref, width, fallback, taylor=()):
        """The log density of the globals ``x`` at fixed standardised locals ``eps`` (module docstring, 2).

        ``offset`` (zero) is added to the locals so that its gradient is the joint's in the locals.
        """
        centre, factor = self._laplace(x, b_ref, width, fallback, taylor)
        spread = small.solve_lower_transposed(factor, eps)
        b = centre + spread + offset
        value, per_group = self._joint(x, b, taylor)
        log_det = factor.diagonal(dim1=-2, dim2=-1).log().sum()
        return value - log_det, (per_group, b, centre, factor)

    @property
    def proxy(self) -> bool:
        """Whether the moves now run on the rows' proxy (from warm-up's first sweep, where wanted)."""
        return bool(self.taylor)

    @property
    def _map_share(self) -> float:
        return 0.0 if self.proxy else self.map_share

    def _fit(self, theta: Tensor, b: Tensor) -> int:
        """Fit each chain's proxy at ``(theta, b)``; return the passes over the rows it took."""
        every = (self.rows.all, self.rows.group, self.num_groups)
        rows = lambda u, y: self._rows_by_group(u, y, *every)  # noqa: E731
        passes = 0
        if self.read is None:  # the globals the rows read: those their gradient finds, where the chains start
            read = vmap(grad(lambda u, y: rows(u, y).sum()))(theta, b) != 0
            self.read, passes = [j for j in range(theta.shape[-1]) if bool(read[:, j].any())], 3
        self.taylor = vmap(lambda t, x: fit(rows, t, x, self.read))(theta, b)
        self.where = None
        return passes + 3 * (len(self.read) + self.p + 1) + 4 * len(self.read) * self.p

    @torch.no_grad()
    def _gap(self, theta: Tensor, b: Tensor, drawn: Tensor | None = None) -> Tensor | None:
        """With the proxy: each (drawn) group's rows' log-likelihood less its proxy, ``(C, G)``; one forward pass."""
        if not self.proxy:
            return None
        every = drawn is None
        drawn = torch.arange(self.num_groups, device=b.device) if every else drawn
        rows, slot = self.rows.of(drawn)
        self.rows_read += b.shape[0] * rows.shape[0]
        exact = vmap(self._rows_by_group, in_dims=(0, 0, None, None, None))(theta, b, rows, slot, len(drawn))
        if every:  # the globals' move, every sweep: no copy of the proxy's coefficients
            return exact - vmap(Taylor.groups)(self.taylor, theta, b)
        return exact - vmap(lambda taylor, t, x: taylor.subset(drawn).groups(t, x[drawn]))(self.taylor, theta, b)
