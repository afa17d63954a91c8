r"""The sweep of multilevel MCMC: the group plate's blocks moved on their own rows, the globals with the groups along.

A model with a group plate of :math:`G` groups (local latents :math:`b_k`, one block of :math:`p` unconstrained
coordinates each), global latents :math:`\theta \in \mathbb{R}^d` and data rows that each read one group
(:mod:`~pyro_scalable.bridge.row_groups`) has the posterior :math:`\pi(\theta, b) \propto p(\theta) \prod_k
p(b_k \mid \theta) \prod_i p(y_i \mid \theta, b_{g(i)})` (:mod:`~pyro_scalable.bridge.group_terms`). Given
:math:`\theta` the groups are independent: group :math:`k`'s conditional :math:`\ell_k(b_k; \theta) = \log p(b_k
\mid \theta) + \sum_{g(i)=k} \log p(y_i \mid \theta, b_k)` reads its own prior term and its own rows (through the
data plate's subsample), with no :math:`N/B` scale. Each iteration is a sweep of two kinds of exact
Metropolis-Hastings move (:mod:`.mala`), both built on each group's **Laplace map at the current globals**.

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

1. **The locals.** :math:`M` groups drawn uniformly without replacement (all of them by default), independently of
   the state, each take one preconditioned MALA move (``local_steps`` leapfrog steps of HMC; default 1, which is
   MALA) with mass matrix :math:`P_k(\theta)` at the current globals, and accept on their own. The mass matrix does
   not read :math:`b_k`, so each move leaves the conditional invariant; it follows the group's scale as the
   globals move (a funnel's neck and mouth), and a non-centred group's as the scale multiplies it.
2. **The globals, with the groups carried along.** A Gibbs move of :math:`\theta` given :math:`b` mixes slowly where
   the two are coupled: a centred model's group scale given its effects, a non-centred model's mean and scale given
   the standardised effects. So :math:`\theta` moves in the coordinates :math:`(\theta, \varepsilon)`,

   .. math::

       b_k = m_k(\theta) + L_k(\theta)^{-\top}\varepsilon_k,

   holding :math:`\varepsilon` fixed: each group follows its conditional centre and spread. For fixed
   :math:`\theta` the map is a bijection with :math:`\log|\partial b / \partial\varepsilon| = -\sum_k
   \log\det L_k(\theta)`, so one HMC trajectory (``global_steps`` leapfrog steps, default 3) on
   :math:`\log\pi(\theta, b(\theta, \varepsilon)) - \sum_k \log\det L_k(\theta)` leaves :math:`\pi` invariant,
   whatever smooth functions of :math:`\theta` :math:`m_k` and :math:`L_k` are. Where every conditional is
   Gaussian, :math:`\varepsilon` is exactly standard normal and independent of :math:`\theta`: the trajectory
   samples the globals' marginal posterior, whichever parametrisation the model is written in (the groups
   integrated out, as a Laplace method would, but exactly). Its gradient comes by autodiff through the map and the
   differences (first derivatives of the model). The last evaluation gives every group's conditional, gradient,
   centre and factor where the chain now is, which the next sweep's local move starts from.

Each move leaves :math:`\pi` invariant, and so does their composition (the blocks drawn do not depend on the state):
the kept draws are exact MCMC draws of the posterior, with no step-size bias and no minibatch noise. An evaluation
of the globals' density reads every row once and the map's rows :math:`1 + p + p^2` times; a sweep with all groups
costs one pass for the locals and ``global_steps + 1`` such evaluations for the globals.

3. **On tall data, the proxy** (from :data:`PROXY_ROWS` rows, or ``proxy=True``): both moves run on the rows'
   second-order proxy (:mod:`.proxy`, exact priors, no row read; the map then reads no rows either) and a
   delayed-acceptance stage corrects each proposal to the exact density, reading every row once, forward only: a
   sweep costs two passes instead of about ten with gradients, and stays exact. The proxy is each chain's own,
   fitted at its reference point; a local expansion, it is renewed every few sweeps until warm-up's first window ends.

**Warm-up** (``num_warmup`` sweeps): each chain's steps for its two kinds of block are set by dual averaging of their
acceptance. At the start, and at the ends of windows of 10%, 10%, 15% and 25% of warm-up, each chain's reference
point becomes its window's mean, with each group's conditional curvature there (by autodiff) for the differences'
widths and the fallback factor, and the globals' mass matrix becomes the transformed density's negative Hessian at
the chain's point (a window's covariance pooled over chains that have not yet met would stretch it). A chain whose
steps fell below a tenth of the upper middle chain's at a window's end is restarted from that chain by the driver
(:mod:`.engine`). The steps are fixed at their averages for sampling.

**What it does not do** (yet): estimate the exact stage from a subsample of rows (each sweep reads every row), or
read a group plate that the model writes as one vector site (``.to_event(1)``) rather than a ``pyro.plate``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, vmap

from pyro_scalable.bridge.group_terms import GroupTermsOf
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.row_groups import RowGroups
from pyro_scalable.infer.multilevel.layout import Layout
from pyro_scalable.infer.multilevel.mala import DualAveraging, hmc, precision_factor
from pyro_scalable.infer.multilevel.proxy import Taylor, fit
from pyro_scalable.infer.multilevel.rows import Rows, sums, wide
from pyro_scalable.infer.multilevel.stencil import derivatives, stencil

__all__ = ["MAP_ROWS", "PROXY_ROWS", "Sweep", "SweepInfo"]

MAP_ROWS = 32  # rows of each group (at most) that its Laplace map reads, weighted to all of them
PROXY_ROWS = 50_000  # from this many rows, the moves run on the rows' proxy (:mod:`.proxy`) by default


class SweepInfo(NamedTuple):
    """A sweep's statistics, per chain: the mean acceptance of its local moves and of its global ones."""

    accept_prob: Tensor
    accept_global: Tensor


class _Where(NamedTuple):
    """Every chain's groups where the chain is: conditionals, their gradients, and the Laplace map at its globals."""

    per_group: Tensor  # (C, G)
    gradient: Tensor  # (C, G, p)
    centre: Tensor  # (C, G, p): m_k(theta)
    factor: Tensor  # (C, G, p, p): L_k(theta)
    gap: Tensor | None = None  # (C, G): with the proxy, each group's rows' log-likelihood less its proxy


class Sweep:
    """One Metropolis-within-Gibbs sweep of every chain, and the warm-up that sets its preconditioners and steps."""

    def __init__(self, bridge: ModelBridge, groups: RowGroups, engine: Any):
        self.bridge, self.groups = bridge, groups
        self.layout = Layout(bridge, groups)
        self.terms = GroupTermsOf(bridge, groups)
        self.rows = Rows(groups)
        self.num_groups = groups.num_groups
        self.per_step = min(engine.groups_per_step or self.num_groups, self.num_groups)
        self.global_steps = engine.global_steps or 3
        self.local_steps = engine.local_steps or 1
        ones = torch.ones(engine.num_chains, dtype=bridge.sites[groups.sites[0]].dtype, device=bridge.device)
        # MALA's optimal acceptance is about 0.57, HMC's (several steps) about 0.65-0.8
        self.local_step = DualAveraging(ones, target=0.6 if self.local_steps == 1 else 0.7)
        self.global_step = DualAveraging(ones, target=0.6 if self.global_steps == 1 else 0.7)
        self.rows_read = 0
        self.where: _Where | None = None
        self.p = self.layout.local_size
        self.stencil, self.pairs = stencil(self.p, ones)  # the central differences' points
        self.map_rows, self.map_group, self.map_weight = self.rows.sample(MAP_ROWS, ones.dtype)
        self.map_share = self.map_rows.shape[0] / self.rows.all.shape[0]  # of a data pass, per point of the stencil
        self.proxy = engine.proxy if engine.proxy is not None else len(groups.group) >= PROXY_ROWS
        if self.proxy:  # the map reads no rows: the priors' terms on one row (ignored) and the proxy's quadratic
            self.map_rows, self.map_group, self.map_share = self.rows.all[:1], self.rows.group[:1], 0.0
        self.taylor: Taylor | tuple = ()  # each chain's proxy at its reference point; () without (vmap takes it)

    # ---------------------------------------------------------------- densities (one chain; vmapped over chains)
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
            terms = self._terms(theta, b, self.map_rows)
            per_group = wide(terms.groups) + taylor.groups(theta, b)
            return wide(terms.globals) + taylor.globals(theta) + per_group.sum(), per_group
        terms = self._terms(theta, b, self.rows.all)
        per_group = wide(terms.groups) + sums(terms.rows, self.rows.group, self.num_groups)
        return wide(terms.globals) + per_group.sum(), per_group

    def _local_proxy(self, b: Tensor, theta: Tensor, drawn: Tensor, taylor: Taylor):
        """The drawn groups' conditionals with the rows' terms by the proxy: no row read."""
        per_group = wide(self._terms(theta, b, self.map_rows).groups[drawn]) + taylor.subset(drawn).groups(theta, b[drawn])
        return per_group.sum(), per_group

    def _rows_by_group(self, theta: Tensor, b: Tensor, rows: Tensor, slot: Tensor, size: int) -> Tensor:
        """The rows' log-likelihood summed by group (``slot``: each row's place among ``size`` groups)."""
        return sums(self._terms(theta, b, rows).rows, slot, size)

    def _changes(self, theta: Tensor, b_ref: Tensor, width: Tensor) -> Tensor:
        """Each group's conditional at the stencil's points less its value at the centre: ``(S - 1, G)``, wide.

        On the map's rows (at most :data:`MAP_ROWS` of each group's, weighted to all). Each row's change is taken
        before the rows are summed: a large group's conditional is a sum of thousands of terms, and the difference
        of two such sums in single precision would lose the change to rounding (noise in the map that the globals'
        acceptance would pay for).
        """

        def at(step: Tensor) -> tuple[Tensor, Tensor]:
            terms = self._terms(theta, b_ref + width * step, self.map_rows)
            return terms.groups, terms.rows

        groups, rows = vmap(at)(self.stencil)
        if self.proxy:
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
        changes = self._changes(theta, b_ref, width)  # (S - 1, G): from the centre to each other point
        gradient, hessian = derivatives(changes, wide(width), self.pairs)
        if taylor:
            gradient, hessian = gradient + taylor.gradient_b(theta, b_ref), hessian + taylor.h
        return gradient, -hessian  # wide: the Laplace map is formed in double precision, then narrowed

    def _laplace(self, theta: Tensor, b_ref: Tensor, width: Tensor, fallback: Tensor, taylor: Taylor | tuple = ()):
        """Each group's Laplace map at ``theta`` (one chain): its centre ``m_k`` and factor ``L_k`` (docstring)."""
        gradient, precision = self._differences(theta, b_ref, width, taylor)
        factor, info = torch.linalg.cholesky_ex(precision)
        factor = torch.where((info == 0)[:, None, None], factor, wide(fallback))
        shift = torch.cholesky_solve(gradient.unsqueeze(-1), factor).squeeze(-1)
        return b_ref + shift.to(b_ref.dtype), factor.to(b_ref.dtype)

    def _transformed(self, x, offset, eps, b_ref, width, fallback, taylor=()):
        """The log density of the globals ``x`` at fixed standardised locals ``eps`` (module docstring, 2).

        ``offset`` (zero) is added to the locals so that its gradient is the joint's in the locals.
        """
        centre, factor = self._laplace(x, b_ref, width, fallback, taylor)
        spread = torch.linalg.solve_triangular(factor.transpose(-1, -2), eps.unsqueeze(-1), upper=True).squeeze(-1)
        b = centre + spread + offset
        value, per_group = self._joint(x, b, taylor)
        log_det = factor.diagonal(dim1=-2, dim2=-1).log().sum()
        return value - log_det, (per_group, b, centre, factor)

    # ---------------------------------------------------------------- warm-up
    def adapt_to(self, theta: Tensor, b_mean: Tensor) -> None:
        """Each chain's reference point and the curvatures there: the locals', and the globals' mass matrix.

        ``theta``: each chain's globals over a window (``(C, T, d)``, ``T = 1`` at the start); ``b_mean``: its
        locals' mean there (``(C, G, p)``). Everything is each chain's own, read where the chain is: a chain far from
        the others (a start in a narrow corner, a chain not yet converged) is preconditioned where it is, and no
        chain's metric is stretched by the others' distance from it.
        """
        chains, d = theta.shape[0], self.layout.global_size
        theta_ref, self.b_ref = theta.mean(1), b_mean
        self.fallback = precision_factor(vmap(self._curvature)(theta_ref, self.b_ref))
        self.width = (self.fallback @ self.fallback.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).rsqrt()
        passes = self.p * 3
        if self.proxy:
            every = (self.rows.all, self.rows.group, self.num_groups)
            self.taylor = vmap(lambda t, x: fit(lambda u, y: self._rows_by_group(u, y, *every), t, x))(
                theta_ref, self.b_ref
            )
            passes += 3 * (d + self.p + 1)
        if d:  # the transformed density's curvature at the chain's point: where the map is exact, the marginal's
            fixed = (self.b_ref, self.width, self.fallback, self.taylor)
            centre, factor = vmap(self._laplace)(theta_ref, *fixed)
            eps = (factor.transpose(-1, -2) @ (self.b_ref - centre).unsqueeze(-1)).squeeze(-1)
            offset = torch.zeros_like(self.b_ref[0])
            density = lambda x, *fixed: self._transformed(x, offset, *fixed)[0]  # noqa: E731
            hessian = vmap(torch.func.jacrev(torch.func.jacrev(density)))(theta_ref, eps, *fixed)
            self.global_factor = precision_factor(-hessian).to(theta.dtype)
            if not self.proxy:
                passes += d * 3 * (len(self.stencil) * self.map_share + 1)
        self.rows_read += chains * passes * self.rows.all.shape[0]
        self.local_step.restart(self.local_step.step)
        self.global_step.restart(self.global_step.step)
        self.where = None

    def fix_steps(self) -> None:
        self.local_step.step = self.local_step.final
        self.global_step.step = self.global_step.final

    # ---------------------------------------------------------------- the sweep
    def __call__(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        chains = b.shape[0]
        if self.where is None:
            joint = vmap(grad_and_value(self._joint, argnums=1, has_aux=True))
            gradient_b, (_, per_group) = joint(theta, b, self.taylor)
            centre, factor = vmap(self._laplace)(theta, self.b_ref, self.width, self.fallback, self.taylor)
            self.where = _Where(per_group, gradient_b, centre, factor, self._gap(theta, b))
            self.rows_read += chains * self.rows.all.shape[0] * (1 + len(self.stencil) * self.map_share)
        b, accept_local = self._move_locals(theta, b, generator, adapt)
        accept_global = torch.ones(chains, dtype=b.dtype, device=b.device)
        if self.layout.global_size:
            theta, b, accept_global = self._move_globals(theta, b, generator, adapt)
        return theta, b, SweepInfo(accept_local, accept_global)

    @torch.no_grad()
    def _gap(self, theta: Tensor, b: Tensor, drawn: Tensor | None = None) -> Tensor | None:
        """With the proxy: each (drawn) group's rows' log-likelihood less its proxy, ``(C, G)``; one forward pass."""
        if not self.proxy:
            return None
        drawn = torch.arange(self.num_groups, device=b.device) if drawn is None else drawn
        rows, slot = self.rows.of(drawn)
        self.rows_read += b.shape[0] * rows.shape[0]
        exact = vmap(self._rows_by_group, in_dims=(0, 0, None, None, None))(theta, b, rows, slot, len(drawn))
        return exact - vmap(lambda taylor, t, x: taylor.subset(drawn).groups(t, x[drawn]))(self.taylor, theta, b)

    def _move_locals(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        """One MALA move of each drawn group's block on its own rows (module docstring, 1)."""
        if self.per_step == self.num_groups:
            drawn = torch.arange(self.num_groups, device=b.device)
        else:
            drawn = torch.randperm(self.num_groups, generator=generator, device=b.device)[: self.per_step]
        where = self.where
        if self.proxy:
            local = vmap(grad_and_value(self._local_proxy, has_aux=True), in_dims=(0, 0, None, 0))
            arguments: tuple = (drawn, self.taylor)
        else:
            rows, slot = self.rows.of(drawn)
            self.rows_read += b.shape[0] * rows.shape[0]
            local = vmap(grad_and_value(self._local, has_aux=True), in_dims=(0, 0, None, None, None))
            arguments = (drawn, rows, slot)

        def place(x: Tensor) -> Tensor:
            moved = b.clone()
            moved[:, drawn] = x
            return moved

        def density(x: Tensor) -> tuple[Tensor, Tensor]:
            gradient, (_, per_group) = local(place(x), theta, *arguments)
            return per_group, gradient[:, drawn]

        def correct(x: Tensor, more: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            gap = self._gap(theta, place(x), drawn)
            return gap - where.gap[:, drawn], [*more, gap]

        step = self.local_step.step[:, None]
        move = hmc(
            b[:, drawn],
            where.per_group[:, drawn],
            where.gradient[:, drawn],
            where.factor[:, drawn],
            step,
            self.local_steps,
            density,
            generator,
            (where.gap[:, drawn],) if self.proxy else (),
            correct if self.proxy else None,
        )
        b, per_group, gradient = b.clone(), where.per_group.clone(), where.gradient.clone()
        b[:, drawn], per_group[:, drawn], gradient[:, drawn] = move.x, move.log_density, move.gradient
        self.where = where._replace(per_group=per_group, gradient=gradient)
        if self.proxy:
            gap = where.gap.clone()
            gap[:, drawn] = move.extra[0]
            self.where = self.where._replace(gap=gap)
        accept = move.accept.mean(-1)
        if adapt:
            self.local_step.update(accept)
        return b, accept

    def _move_globals(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        """One HMC trajectory of the globals, the locals following their Laplace map (module docstring, 2)."""
        chains = b.shape[0]
        eps = (self.where.factor.transpose(-1, -2) @ (b - self.where.centre).unsqueeze(-1)).squeeze(-1)
        fixed = (eps, self.b_ref, self.width, self.fallback, self.taylor)
        transformed = vmap(grad_and_value(self._transformed, argnums=(0, 1), has_aux=True))
        offset = torch.zeros_like(b)

        def density(x: Tensor) -> tuple[Tensor, ...]:
            (gradient_theta, gradient_b), (value, (per_group, moved, centre, factor)) = transformed(x, offset, *fixed)
            return value, gradient_theta, per_group, gradient_b, moved, centre, factor

        def correct(x: Tensor, more: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            gap = self._gap(x, more[2])
            change = gap.sum(-1) - self.where.gap.sum(-1)
            return change - vmap(Taylor.globals)(self.taylor, x) + vmap(Taylor.globals)(self.taylor, theta), [
                *more,
                gap,
            ]

        value, gradient, *extra = density(theta)
        passes = (1 + self.global_steps) * (1 + len(self.stencil) * self.map_share)
        if not self.proxy:
            self.rows_read += chains * self.rows.all.shape[0] * passes
        move = hmc(
            theta,
            value,
            gradient,
            self.global_factor,
            self.global_step.step,
            self.global_steps,
            density,
            generator,
            (*extra, self.where.gap) if self.proxy else tuple(extra),
            correct if self.proxy else None,
        )
        if adapt:
            self.global_step.update(move.accept)
        per_group, gradient_b, b, centre, factor, *gap = move.extra
        self.where = _Where(per_group, gradient_b, centre, factor, gap[0] if gap else None)
        return move.x, b, move.accept
