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

**Warm-up** (``num_warmup`` sweeps): each chain's steps for its two kinds of block are set by dual averaging of their
acceptance. At the start, and at the ends of windows of 10%, 10%, 15% and 25% of warm-up, each chain's reference
point becomes its window's mean, with each group's conditional curvature there (by autodiff) for the differences'
widths and the fallback factor, and the globals' mass matrix becomes the transformed density's negative Hessian at
the chain's point (where the conditionals are Gaussian, the globals' marginal posterior's curvature: a window's
covariance pooled over chains that have not yet met would stretch it). A chain whose steps fell below a tenth of the
upper middle chain's at a window's end is restarted from that chain by the driver (:mod:`.engine`). The
steps are fixed at their averages for sampling.

**What it does not do** (yet): move the globals with a minibatch estimate (each global step reads every row), or
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

__all__ = ["MAP_ROWS", "Sweep", "SweepInfo"]

MAP_ROWS = 32  # rows of each group (at most) that its Laplace map reads, weighted to all of them


def _wide(x: Tensor) -> Tensor:
    """``x`` in double precision, where its device has it: sums of many rows' terms then lose nothing that matters."""
    return x if x.device.type == "mps" else x.double()


def _sums(terms: Tensor, group: Tensor, size: int) -> Tensor:
    """The sums of ``terms`` by ``group`` (``size`` of them), accumulated in double precision (:func:`_wide`)."""
    terms = _wide(terms)
    return terms.new_zeros(size).index_add(0, group, terms)


class _Rows:
    """The data rows of each group, in one index sorted by group: a set of groups' rows is a gather, not a copy."""

    def __init__(self, groups: RowGroups):
        self.group = groups.group
        self.sizes = groups.sizes
        self.order = torch.argsort(groups.group, stable=True)
        self.starts = torch.cumsum(groups.sizes, 0) - groups.sizes
        self.num_groups = groups.num_groups
        self.all = torch.arange(len(groups.group), device=groups.group.device)

    def of(self, drawn: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of the groups ``drawn`` and, for each row, its group's position in ``drawn``."""
        if drawn.shape[0] == self.num_groups:
            return self.all, self.group
        lengths = self.sizes[drawn]
        offsets = torch.cumsum(lengths, 0) - lengths
        slot = torch.repeat_interleave(torch.arange(len(drawn), device=drawn.device), lengths)
        within = torch.arange(int(lengths.sum()), device=drawn.device) - offsets[slot]
        return self.order[self.starts[drawn][slot] + within], slot

    def sample(self, most: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
        """At most ``most`` rows of each group, fixed once (a seeded shuffle within each group).

        Returns the rows, their groups, and each row's weight ``n_k / m_k`` (``None`` where no group has more than
        ``most`` rows: then the rows are all rows).
        """
        if int(self.sizes.max()) <= most:
            return self.all, self.group, None
        shuffle = torch.randperm(len(self.group), generator=torch.Generator().manual_seed(0)).to(self.all.device)
        order = shuffle[torch.argsort(self.group[shuffle], stable=True)]  # by group, shuffled within each
        rank = self.all - self.starts.repeat_interleave(self.sizes)  # each sorted row's place within its group
        kept = order[rank < most]
        weight = self.sizes / self.sizes.clamp(max=most)
        return kept, self.group[kept], weight[self.group[kept]].to(dtype)


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


class Sweep:
    """One Metropolis-within-Gibbs sweep of every chain, and the warm-up that sets its preconditioners and steps."""

    def __init__(self, bridge: ModelBridge, groups: RowGroups, engine: Any):
        self.bridge, self.groups = bridge, groups
        self.layout = Layout(bridge, groups)
        self.terms = GroupTermsOf(bridge, groups)
        self.rows = _Rows(groups)
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
        # the central differences' stencil: the centre, +-e_j, then +-(e_j + e_k) for j < k
        self.p = self.layout.local_size
        eye = torch.eye(self.p, dtype=ones.dtype, device=ones.device)
        self.pairs = [(j, k) for j in range(self.p) for k in range(j + 1, self.p)]
        steps = [eye[0] * 0] + [s * eye[j] for j in range(self.p) for s in (1, -1)]
        steps += [s * (eye[j] + eye[k]) for j, k in self.pairs for s in (1, -1)]
        self.stencil = torch.stack(steps)
        self.map_rows, self.map_group, self.map_weight = self.rows.sample(MAP_ROWS, ones.dtype)
        self.map_share = self.map_rows.shape[0] / self.rows.all.shape[0]  # of a data pass, per point of the stencil

    # ---------------------------------------------------------------- densities (one chain; vmapped over chains)
    def _terms(self, theta: Tensor, b: Tensor, rows: Tensor):
        return self.terms(self.layout.join(theta, b), rows)

    def _local(self, b: Tensor, theta: Tensor, drawn: Tensor, rows: Tensor, slot: Tensor):
        terms = self._terms(theta, b, rows)
        per_group = _wide(terms.groups[drawn]) + _sums(terms.rows, slot, len(drawn))
        return per_group.sum(), per_group

    def _joint(self, theta: Tensor, b: Tensor):
        """The log joint on all rows, with every group's conditional (its terms and its rows') beside it."""
        terms = self._terms(theta, b, self.rows.all)
        per_group = _wide(terms.groups) + _sums(terms.rows, self.rows.group, self.num_groups)
        return _wide(terms.globals) + per_group.sum(), per_group

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
        rows = _wide(rows[1:] - rows[:1])
        if self.map_weight is not None:
            rows = rows * self.map_weight
        return _wide(groups[1:] - groups[:1]) + vmap(lambda r: _sums(r, self.map_group, self.num_groups))(rows)

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

    def _differences(self, theta: Tensor, b_ref: Tensor, width: Tensor) -> tuple[Tensor, Tensor]:
        """Each group's conditional's gradient ``(G, p)`` and negative Hessian ``(G, p, p)`` at ``b_ref`` (one chain).

        By central differences of widths ``width`` (``(G, p)``), every point of the stencil in one batched evaluation.
        """
        changes = self._changes(theta, b_ref, width)  # (S - 1, G): from the centre to each other point
        single, pair = changes[: 2 * self.p], changes[2 * self.p :]
        plus, minus = single[0::2].T, single[1::2].T  # (G, p): moved up and down along each coordinate
        width = _wide(width)
        gradient = (plus - minus) / (2 * width)
        hessian = torch.diag_embed((plus + minus) / width**2)
        for n, (j, k) in enumerate(self.pairs):
            both = pair[2 * n] + pair[2 * n + 1] - plus[:, j] - minus[:, j] - plus[:, k] - minus[:, k]
            unit = torch.zeros_like(hessian[0])  # the symmetric pair (j, k), (k, j)
            unit[j, k] = unit[k, j] = 1.0
            hessian = hessian + (both / (2 * width[:, j] * width[:, k]))[:, None, None] * unit
        return gradient, -hessian  # wide: the Laplace map is formed in double precision, then narrowed

    def _laplace(self, theta: Tensor, b_ref: Tensor, width: Tensor, fallback: Tensor) -> tuple[Tensor, Tensor]:
        """Each group's Laplace map at ``theta`` (one chain): its centre ``m_k`` and factor ``L_k`` (docstring)."""
        gradient, precision = self._differences(theta, b_ref, width)
        factor, info = torch.linalg.cholesky_ex(precision)
        factor = torch.where((info == 0)[:, None, None], factor, _wide(fallback))
        shift = torch.cholesky_solve(gradient.unsqueeze(-1), factor).squeeze(-1)
        return b_ref + shift.to(b_ref.dtype), factor.to(b_ref.dtype)

    def _transformed(self, x, offset, eps, b_ref, width, fallback):
        """The log density of the globals ``x`` at fixed standardised locals ``eps`` (module docstring, 2).

        ``offset`` (zero) is added to the locals so that its gradient is the joint's in the locals.
        """
        centre, factor = self._laplace(x, b_ref, width, fallback)
        spread = torch.linalg.solve_triangular(factor.transpose(-1, -2), eps.unsqueeze(-1), upper=True).squeeze(-1)
        b = centre + spread + offset
        value, per_group = self._joint(x, b)
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
        if d:  # the transformed density's curvature at the chain's point: where the map is exact, the marginal's
            centre, factor = vmap(self._laplace)(theta_ref, self.b_ref, self.width, self.fallback)
            eps = (factor.transpose(-1, -2) @ (self.b_ref - centre).unsqueeze(-1)).squeeze(-1)
            offset = torch.zeros_like(self.b_ref[0])
            density = lambda x, *fixed: self._transformed(x, offset, *fixed)[0]  # noqa: E731
            hessian = vmap(torch.func.jacrev(torch.func.jacrev(density)))(
                theta_ref, eps, self.b_ref, self.width, self.fallback
            )
            self.global_factor = precision_factor(-hessian).to(theta.dtype)
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
            gradient_b, (_, per_group) = joint(theta, b)
            centre, factor = vmap(self._laplace)(theta, self.b_ref, self.width, self.fallback)
            self.where = _Where(per_group, gradient_b, centre, factor)
            self.rows_read += chains * self.rows.all.shape[0] * (1 + len(self.stencil) * self.map_share)
        b, accept_local = self._move_locals(theta, b, generator, adapt)
        accept_global = torch.ones(chains, dtype=b.dtype, device=b.device)
        if self.layout.global_size:
            theta, b, accept_global = self._move_globals(theta, b, generator, adapt)
        return theta, b, SweepInfo(accept_local, accept_global)

    def _move_locals(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        """One MALA move of each drawn group's block on its own rows (module docstring, 1)."""
        if self.per_step == self.num_groups:
            drawn = torch.arange(self.num_groups, device=b.device)
        else:
            drawn = torch.randperm(self.num_groups, generator=generator, device=b.device)[: self.per_step]
        rows, slot = self.rows.of(drawn)
        self.rows_read += b.shape[0] * rows.shape[0]
        local = vmap(grad_and_value(self._local, has_aux=True), in_dims=(0, 0, None, None, None))

        def density(x: Tensor) -> tuple[Tensor, Tensor]:
            moved = b.clone()
            moved[:, drawn] = x
            gradient, (_, per_group) = local(moved, theta, drawn, rows, slot)
            return per_group, gradient[:, drawn]

        where = self.where
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
        )
        b, per_group, gradient = b.clone(), where.per_group.clone(), where.gradient.clone()
        b[:, drawn], per_group[:, drawn], gradient[:, drawn] = move.x, move.log_density, move.gradient
        self.where = where._replace(per_group=per_group, gradient=gradient)
        accept = move.accept.mean(-1)
        if adapt:
            self.local_step.update(accept)
        return b, accept

    def _move_globals(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        """One HMC trajectory of the globals, the locals following their Laplace map (module docstring, 2)."""
        chains = b.shape[0]
        eps = (self.where.factor.transpose(-1, -2) @ (b - self.where.centre).unsqueeze(-1)).squeeze(-1)
        fixed = (eps, self.b_ref, self.width, self.fallback)
        transformed = vmap(grad_and_value(self._transformed, argnums=(0, 1), has_aux=True))
        offset = torch.zeros_like(b)

        def density(x: Tensor) -> tuple[Tensor, ...]:
            (gradient_theta, gradient_b), (value, (per_group, moved, centre, factor)) = transformed(x, offset, *fixed)
            return value, gradient_theta, per_group, gradient_b, moved, centre, factor

        value, gradient, *extra = density(theta)
        passes = (1 + self.global_steps) * (1 + len(self.stencil) * self.map_share)
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
            tuple(extra),
        )
        if adapt:
            self.global_step.update(move.accept)
        per_group, gradient_b, b, centre, factor = move.extra
        self.where = _Where(per_group, gradient_b, centre, factor)
        return move.x, b, move.accept
