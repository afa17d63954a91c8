r"""The sweep of multilevel MCMC: the group plate's blocks moved on their own rows, the globals with the groups along.

A model with a group plate of :math:`G` groups (local latents :math:`b_k`, one block of :math:`p` unconstrained
coordinates each), global latents :math:`\theta \in \mathbb{R}^d` and data rows that each read one group
(:mod:`~pyro_scalable.bridge.row_groups`) has the posterior :math:`\pi(\theta, b) \propto p(\theta) \prod_k
p(b_k \mid \theta) \prod_i p(y_i \mid \theta, b_{g(i)})` (:mod:`~pyro_scalable.bridge.group_terms`). Each iteration
is a sweep of two kinds of exact Metropolis-Hastings move (:mod:`.mala`):

1. **The locals.** :math:`M` groups drawn uniformly without replacement (all of them by default), independently of
   the state. Given :math:`\theta` the groups are independent, and group :math:`k`'s conditional
   :math:`\ell_k(b_k) = \log p(b_k \mid \theta) + \sum_{g(i)=k} \log p(y_i \mid \theta, b_k)` reads its own rows only
   (through the data plate's subsample), with no :math:`N/B` scale. Each drawn block takes one preconditioned MALA
   move (``local_steps`` leapfrog steps of HMC; default 1, which is MALA) and accepts on its own. Its mass matrix is
   :math:`P_k = R_k + Q_k(\theta)`: :math:`R_k` the rows' negative Hessian at a reference point fixed in sampling,
   :math:`Q_k(\theta)` the group prior's negative Hessian at the reference locals under the *current* globals (so a
   block's step follows the group scale as it moves, as a funnel needs), by central differences (exact for a
   Gaussian group prior; the stencil's widths are the group's conditional spread at the reference point). Neither
   depends on :math:`b_k`, so each move leaves the conditional invariant.
2. **The globals, with the groups carried along.** A Gibbs move of :math:`\theta` given :math:`b` mixes slowly where
   the two are coupled: a centred model's group scale given its effects, a non-centred model's mean and scale given
   the standardised effects. So :math:`\theta` moves in the coordinates :math:`(\theta, \varepsilon)`,

   .. math::

       b_k = a_k + B_k\theta + L_k(\theta)^{-\top}\varepsilon_k, \qquad L_k(\theta)L_k(\theta)^\top = R_k + Q_k(\theta),

   holding :math:`\varepsilon` fixed: each group follows its conditional mean (:math:`a_k + B_k\theta`, its
   regression on the globals over warm-up's last window) and its conditional spread (the curvature's factor at the
   current globals). A weakly informed group (:math:`R_k \ll Q_k`) then moves as if non-centred, a strongly informed
   one as if centred: a partially non-centred parametrisation (Papaspiliopoulos, Roberts & Sköld 2007), chosen per
   group from the data whatever parametrisation the model is written in. For fixed :math:`\theta` the map is a
   bijection with :math:`\log|\partial b / \partial\varepsilon| = -\sum_k \log\det L_k(\theta)`, so one HMC
   trajectory (``global_steps`` leapfrog steps, default 3) on :math:`\log\pi(\theta, b(\theta, \varepsilon)) -
   \sum_k \log\det L_k(\theta)` leaves :math:`\pi` invariant, whatever smooth function of :math:`\theta`
   :math:`L_k` is: its curvature by differences serves as well as the exact one. Its gradient comes by autodiff
   through the map (through the differences, a first derivative of the group prior, which reads no data). Each evaluation reads every row (a data pass); the
   last one gives every group's conditional and gradient where the chain now is, which the next sweep's local move
   starts from. Where no local's prior depends on a global (a non-centred model), :math:`Q` is a constant and the
   map a shear.

Each move leaves :math:`\pi` invariant, and so does their composition (the blocks drawn do not depend on the state):
the kept draws are exact MCMC draws of the posterior, with no step-size bias and no minibatch noise. A sweep with
all groups costs :math:`\text{local\_steps} + 1 + \text{global\_steps}` passes over the data.

**Warm-up** (``num_warmup`` sweeps): each chain's steps for its two kinds of block are set by dual averaging of their
acceptance. At the start, and at the ends of windows of 10%, 10%, 15% and 25% of warm-up, each chain's reference
point becomes its window's mean and :math:`R` is read there; :math:`B` and :math:`a` become the window's regression
(pooled over chains) of each group's locals on the globals, and the globals' mass matrix the inverse of their window
covariance (regularised towards the identity as Stan regularises its metric). At the start, with no window,
:math:`B_k = (R_k + Q_k)^{-1} \partial^2 \log\pi / \partial b_k \partial\theta` (the conditional mean's slope) and
the mass matrix is the sheared joint's curvature, at each chain's point. The steps are fixed at their averages for
sampling.

**What it does not do** (yet): move the globals with a minibatch estimate (each global step costs a data pass), or
read a group plate that the model writes as one vector site (``.to_event(1)``) rather than a ``pyro.plate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, vmap

from pyro_scalable.bridge.group_terms import GroupTermsOf
from pyro_scalable.bridge.hierarchy import prior_parents
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.row_groups import RowGroups
from pyro_scalable.infer.multilevel.layout import Layout
from pyro_scalable.infer.multilevel.mala import DualAveraging, hmc, precision_factor

__all__ = ["Sweep", "SweepInfo"]


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


class SweepInfo(NamedTuple):
    """A sweep's statistics, per chain: the mean acceptance of its local moves and of its global ones."""

    accept_prob: Tensor
    accept_global: Tensor


class Sweep:
    """One Metropolis-within-Gibbs sweep of every chain, and the warm-up that sets its preconditioners and steps."""

    def __init__(self, bridge: ModelBridge, groups: RowGroups, engine: Any):
        self.bridge, self.groups = bridge, groups
        self.layout = Layout(bridge, groups)
        self.terms = GroupTermsOf(bridge, groups)
        self.rows = _Rows(groups)
        self.num_groups = groups.num_groups
        self.per_step = min(engine.groups_per_step or self.num_groups, self.num_groups)
        self.one_row = self.rows.all[:1]
        self.global_steps = engine.global_steps or 3
        self.local_steps = engine.local_steps or 1
        ones = torch.ones(engine.num_chains, dtype=bridge.sites[groups.sites[0]].dtype, device=bridge.device)
        # MALA's optimal acceptance is about 0.57, HMC's (several steps) about 0.65-0.8
        self.local_step = DualAveraging(ones, target=0.6 if self.local_steps == 1 else 0.7)
        self.global_step = DualAveraging(ones, target=0.6 if self.global_steps == 1 else 0.7)
        self.rows_read = 0
        self.cache: tuple[Tensor, Tensor] | None = None  # every group's conditional and gradient where the chains are
        parents = prior_parents(bridge)
        # whether a local's prior depends on a global (centred): then its curvature Q follows the globals
        self.prior_follows = any(parents[name] for name in groups.sites)
        # the central-difference stencil of the group prior's curvature: the centre, +-e_j, then +-(e_j + e_k), j < k
        self.p = self.layout.local_size
        eye = torch.eye(self.p, dtype=ones.dtype, device=ones.device)
        self.pairs = [(j, k) for j in range(self.p) for k in range(j + 1, self.p)]
        steps = [eye[0] * 0] + [s * eye[j] for j in range(self.p) for s in (1, -1)]
        steps += [s * (eye[j] + eye[k]) for j, k in self.pairs for s in (1, -1)]
        self.stencil = torch.stack(steps)

    # ---------------------------------------------------------------- densities (one chain; vmapped over chains)
    def _terms(self, theta: Tensor, b: Tensor, rows: Tensor):
        return self.terms(self.layout.join(theta, b), rows)

    def _local(self, b: Tensor, theta: Tensor, drawn: Tensor, rows: Tensor, slot: Tensor):
        terms = self._terms(theta, b, rows)
        per_group = terms.groups[drawn] + terms.rows.new_zeros(len(drawn)).index_add(0, slot, terms.rows)
        return per_group.sum(), per_group

    def _joint(self, theta: Tensor, b: Tensor):
        """The log joint on all rows, with every group's conditional (its terms and its rows') beside it."""
        terms = self._terms(theta, b, self.rows.all)
        per_group = terms.groups + terms.rows.new_zeros(self.num_groups).index_add(0, self.rows.group, terms.rows)
        return terms.globals + per_group.sum(), per_group

    def _sheared(self, theta: Tensor, u: Tensor, shear: Tensor) -> Tensor:
        """The log joint at the globals ``theta`` and the locals ``u + B theta``."""
        return self._joint(theta, u + shear @ theta)[0]

    def _group_prior(self, b: Tensor, theta: Tensor) -> Tensor:
        return self._terms(theta, b, self.one_row).groups.sum()

    def _rows_only(self, b: Tensor, theta: Tensor) -> Tensor:
        return self._terms(theta, b, self.rows.all).rows.sum()

    def _block_curvature(self, function: Callable, b: Tensor, theta: Tensor) -> Tensor:
        """Each group's ``(p, p)`` negative Hessian of a group-separable ``function(b, theta)`` in ``b``: p products."""
        columns = []
        for j in range(b.shape[-1]):
            tangent = torch.zeros_like(b)
            tangent[..., j] = 1.0
            # reverse over reverse: torch's forward mode runs its decompositions in Python, many times slower here
            columns.append(-grad(lambda x, v=tangent: (grad(function)(x, theta) * v).sum())(b))
        return torch.stack(columns, -1)

    def _prior_curvatures(self, theta: Tensor, b_ref: Tensor) -> Tensor:
        """Every chain's group-prior curvatures ``Q_k`` at its reference locals under its globals: ``(C, G, p, p)``."""
        return vmap(lambda t, b: self._block_curvature(self._group_prior, b, t))(theta, b_ref)

    def _prior_differences(self, theta: Tensor, b_ref: Tensor, width: Tensor) -> Tensor:
        """``Q_k(theta)`` by central second differences of the group prior (one chain): ``(G, p, p)``.

        The prior is evaluated at the reference locals moved by ``width`` (``(G, p)``, each group's conditional
        spread) along the stencil's directions, every point in one batched evaluation; its gradient in the globals
        is then a first derivative, where the exact Hessian's would be a third. It is exact for a Gaussian group
        prior and smooth in the globals for any, which is all the sweep needs of it: any smooth ``Q`` that does not
        read the locals keeps each move exact.
        """
        values = vmap(lambda step: self._terms(theta, b_ref + width * step, self.one_row).groups)(self.stencil)
        centre, single, pair = values[0], values[1 : 1 + 2 * self.p], values[1 + 2 * self.p :]
        plus, minus = single[0::2].T, single[1::2].T  # (G, p): the prior moved up and down along each coordinate
        curvature = torch.diag_embed((plus + minus - 2 * centre[:, None]) / width**2)
        for n, (j, k) in enumerate(self.pairs):
            both = pair[2 * n] + pair[2 * n + 1] - plus[:, j] - minus[:, j] - plus[:, k] - minus[:, k] + 2 * centre
            unit = torch.zeros_like(curvature[0])  # the symmetric pair (j, k), (k, j)
            unit[j, k] = unit[k, j] = 1.0
            curvature = curvature + (both / (2 * width[:, j] * width[:, k]))[:, None, None] * unit
        return -curvature

    def _cross(self, theta: Tensor, b: Tensor) -> Tensor:
        """Each group's ``(p, d)`` mixed second derivative of the log joint in its locals and the globals."""
        columns = []
        for j in range(theta.shape[-1]):
            tangent = torch.zeros_like(theta)
            tangent[j] = 1.0
            along = lambda x, v=tangent: (grad(lambda t: self._joint(t, x)[0])(theta) * v).sum()  # noqa: E731
            columns.append(grad(along)(b))
        return torch.stack(columns, -1)

    # ---------------------------------------------------------------- warm-up
    def adapt_to(self, theta: Tensor, b_mean: Tensor, b_theta: Tensor | None = None) -> None:
        """Each chain's reference point and the curvatures there; the shear and the globals' preconditioner.

        ``theta``: each chain's globals over a window (``(C, T, d)``); ``b_mean``: its locals' mean there
        (``(C, G, p)``); ``b_theta``: the sum over the window and the chains of each group's locals times the globals
        (``(G, p, d)``), or ``None`` at the start. The locals' preconditioners are each chain's own: a chain far from
        the others (a start in a narrow corner) is preconditioned where it is. The shear is the window's regression
        of each group's locals on the globals, and the globals' preconditioner the inverse of the residual spread
        of the globals, pooled over the chains (at the start: each chain's curvature where it is).
        """
        chains = theta.shape[0]
        self.theta_ref, self.b_ref = theta.mean(1), b_mean
        curvature = lambda t, b: self._block_curvature(self._rows_only, b, t)  # noqa: E731
        self.rows_curvature = vmap(curvature)(self.theta_ref, self.b_ref)
        passes = self.layout.local_size * 3
        d = self.layout.global_size
        prior = self._prior_curvatures(self.theta_ref, self.b_ref)
        if d and b_theta is not None:
            pooled = theta.reshape(-1, d)
            n = pooled.shape[0]
            mean = pooled.mean(0)
            covariance = torch.cov(pooled.T).reshape(d, d) * (n - 1) / n
            covariance = n / (n + 5) * covariance + 1e-3 * 5 / (n + 5) * torch.eye(d, dtype=theta.dtype)
            cross = b_theta / n - b_mean.mean(0)[..., None] * mean  # (G, p, d): the window's Cov(b_k, theta)
            shear = torch.linalg.solve(covariance, cross.reshape(-1, d).T).T.reshape(cross.shape)
            self.shear = shear.expand(chains, *shear.shape)
            centre = b_mean.mean(0) - shear @ mean  # the regression's intercept, pooled
            self.centre = centre.expand(chains, *centre.shape)
            self.global_factor = precision_factor(torch.linalg.inv(covariance.double())).to(theta.dtype)
            self.global_factor = self.global_factor.expand(chains, d, d)
        elif d:  # at the start: the conditional-mean slope and the sheared joint's curvature at each chain's point
            cross = vmap(self._cross)(self.theta_ref, self.b_ref)
            self.shear = torch.cholesky_solve(cross, precision_factor(self.rows_curvature + prior))
            u_ref = self.b_ref - (self.shear @ self.theta_ref[:, None, :, None]).squeeze(-1)
            self.centre = u_ref
            hessian = vmap(torch.func.jacrev(torch.func.jacrev(self._sheared)))(self.theta_ref, u_ref, self.shear)
            self.global_factor = precision_factor(-hessian).to(theta.dtype)
            passes += d * 9
        if d:
            rows_factor = precision_factor(self.rows_curvature)
            self.rows_floored = rows_factor @ rows_factor.transpose(-1, -2)
            self.spread_fallback = precision_factor(self.rows_floored + prior)
        # the differences' widths: each group's conditional spread along each coordinate at the reference point
        floored = precision_factor(self.rows_curvature + prior)
        self.width = (floored @ floored.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).rsqrt()
        self.prior_curvature = prior  # at the reference globals: the curvature wherever the prior does not follow them
        self.rows_read += chains * passes * self.rows.all.shape[0]
        self.local_step.restart(self.local_step.step)
        self.global_step.restart(self.global_step.step)
        self.cache = None

    def fix_steps(self) -> None:
        self.local_step.step = self.local_step.final
        self.global_step.step = self.global_step.final

    # ---------------------------------------------------------------- the sweep
    def __call__(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        chains = b.shape[0]
        joint = vmap(grad_and_value(self._joint, argnums=(0, 1), has_aux=True))
        if self.cache is None:
            (_, gradient_b), (_, per_group) = joint(theta, b)
            self.cache = (per_group, gradient_b)
            self.rows_read += chains * self.rows.all.shape[0]
        b, accept_local = self._move_locals(theta, b, generator, adapt)
        accept_global = torch.ones(chains, dtype=b.dtype, device=b.device)
        if self.layout.global_size:
            theta, b, accept_global = self._move_globals(theta, b, joint, generator, adapt)
        else:
            self.cache = None
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

        if self.prior_follows:
            self.prior_curvature = vmap(self._prior_differences)(theta, self.b_ref, self.width)
        precision = (self.rows_curvature + self.prior_curvature)[:, drawn]
        per_group, gradient_b = self.cache
        step = self.local_step.step[:, None]
        move = hmc(
            b[:, drawn],
            per_group[:, drawn],
            gradient_b[:, drawn],
            precision_factor(precision),
            step,
            self.local_steps,
            density,
            generator,
        )
        b = b.clone()
        b[:, drawn] = move.x
        accept = move.accept.mean(-1)
        if adapt:
            self.local_step.update(accept)
        return b, accept

    def _spread(self, theta: Tensor, b_ref: Tensor, width: Tensor, rows_floored: Tensor, fallback: Tensor) -> Tensor:
        """Each group's factor ``L_k(theta)`` of ``R_k + Q_k(theta)`` (one chain); the fallback where it has none."""
        if not self.prior_follows:  # the group prior's curvature is the same at every value of the globals
            return fallback
        precision = rows_floored + self._prior_differences(theta, b_ref, width)
        factor, info = torch.linalg.cholesky_ex(precision)
        return torch.where((info == 0)[:, None, None], factor, fallback)

    def _transformed(self, x, offset, eps, centre, shear, b_ref, width, rows_floored, fallback):
        """The log density of the globals ``x`` at fixed standardised locals ``eps`` (module docstring, 2).

        ``offset`` (zero) is added to the locals so that its gradient is the joint's in the locals.
        """
        factor = self._spread(x, b_ref, width, rows_floored, fallback)
        spread = torch.linalg.solve_triangular(factor.transpose(-1, -2), eps.unsqueeze(-1), upper=True).squeeze(-1)
        b = centre + shear @ x + spread + offset
        value, per_group = self._joint(x, b)
        log_det = factor.diagonal(dim1=-2, dim2=-1).log().sum()
        return value - log_det, (per_group, b)

    def _move_globals(self, theta: Tensor, b: Tensor, joint: Callable, generator: torch.Generator, adapt: bool):
        """MALA moves of the globals, the locals following their conditional mean and spread (module docstring, 2)."""
        chains = b.shape[0]
        factor = vmap(self._spread)(theta, self.b_ref, self.width, self.rows_floored, self.spread_fallback)
        mean = self.centre + (self.shear @ theta[:, None, :, None]).squeeze(-1)
        eps = (factor.transpose(-1, -2) @ (b - mean).unsqueeze(-1)).squeeze(-1)
        fixed = (eps, self.centre, self.shear, self.b_ref, self.width, self.rows_floored, self.spread_fallback)
        transformed = vmap(grad_and_value(self._transformed, argnums=(0, 1), has_aux=True))
        offset = torch.zeros_like(b)

        def density(x: Tensor) -> tuple[Tensor, ...]:
            (gradient_theta, gradient_b), (value, (per_group, moved)) = transformed(x, offset, *fixed)
            return value, gradient_theta, per_group, gradient_b, moved

        value, gradient, *extra = density(theta)
        self.rows_read += chains * self.rows.all.shape[0] * (1 + self.global_steps)
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
        per_group, gradient_b, b = move.extra
        self.cache = (per_group, gradient_b)
        return move.x, b, move.accept
