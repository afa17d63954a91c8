r"""The sweep of multilevel MCMC: the group plate's blocks moved on their own rows, the globals with the groups along.

A model with a group plate of :math:`G` groups (local latents :math:`b_k`, one block of :math:`p` unconstrained
coordinates each), global latents :math:`\theta \in \mathbb{R}^d` and data rows that each read one group
(:mod:`~pyro_scalable.bridge.row_groups`) has the posterior :math:`\pi(\theta, b) \propto p(\theta) \prod_k
p(b_k \mid \theta) \prod_i p(y_i \mid \theta, b_{g(i)})` (:mod:`~pyro_scalable.bridge.group_terms`). Given
:math:`\theta` the groups are independent: group :math:`k`'s conditional :math:`\ell_k(b_k; \theta) = \log p(b_k
\mid \theta) + \sum_{g(i)=k} \log p(y_i \mid \theta, b_k)` reads its own prior term and its own rows (through the
data plate's subsample), with no :math:`N/B` scale. Each iteration is a sweep of two kinds of exact
Metropolis-Hastings move (:mod:`.mala`), both built on each group's **Laplace map at the current globals**.

**The Laplace map** (:mod:`.conditionals`) gives each group's conditional centre :math:`m_k(\theta)` and a factor
:math:`L_k(\theta)` of its curvature :math:`P_k(\theta) = L_k L_k^\top`, smooth functions of :math:`\theta`
alone, exact where the conditional is Gaussian in :math:`b_k`.

1. **The locals.** :math:`M` groups drawn uniformly without replacement (all of them by default), independently of
   the state, each take ``local_steps`` (default 1) Newton moves (:func:`.mala.newton`) preconditioned by
   :math:`P_k(\theta)` at the current globals, and accept on their own: :math:`b_k' = b_k + a P_k^{-1}\nabla
   \ell_k(b_k) + s L_k^{-\top}\xi`, :math:`a = 1 - \sqrt{1 - s^2}`. The preconditioner does not read :math:`b_k`,
   so each move leaves the conditional invariant; it follows the group's scale as the globals move (a funnel's neck
   and mouth), and a non-centred group's as the scale multiplies it. Where the conditional is Gaussian (and the
   map exact) the move at :math:`s = 1` is an exact Gibbs draw of the group, accepted always; warm-up takes each
   chain's :math:`s` up to that 1 where its groups' acceptance allows.
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
   sweep costs two passes instead of about ten with gradients, and stays exact. The proxy takes over from warm-up's
   first sweep (the climb of :mod:`.start` has brought the chains to the posterior's bulk), each chain's own, fitted
   where the chain is; a local expansion, it is fitted again in warm-up where a chain has left it :data:`STALE` sds
   behind, and given up for the exact moves after a window whose second stage accepted less than
   :data:`SECOND_STAGE` on average (from the second window: the first one's proxy was fitted at the start's draw,
   where a chain need not yet be typical). In sampling it is fixed (a proxy that followed the chain would make the
   kernel depend on its past).

**Warm-up** (``num_warmup`` sweeps) starts each chain from one draw of the Laplace approximation at the mode of its
globals' marginal (:mod:`.start`), not where Pyro's initialisation put it: on tall data a start hundreds of sds from
the bulk makes warm-up fit its steps to curvatures far above the bulk's, and they collapse. Each chain's steps for
its two kinds of block are set by dual averaging of their acceptance, each capped: the Newton move's at 1 (an exact
draw of a Gaussian conditional), the globals' so that a trajectory lasts at most a quarter period of the mass
matrix's Gaussian, :math:`\pi/2` (:data:`QUARTER`): there, :math:`x(t) = x \cos t + \rho \sin t`, and a quarter
period is an independent draw of both the place and the spread. Left to the acceptance alone, three steps reach
about half a period, :math:`x' \approx -x`: antithetic, the mean's ESS above the number of draws and the spread's
(the tail's) about a third of it, which is the part of r_hat a long run needs. With the steps' jitter, the lengths
run over :math:`[\pi/4, 3\pi/4]`, whose mean cosine is 0. At the start, and at the ends of windows of
10%, 10%, 15% and 25% of warm-up, each chain's reference point becomes its window's mean, with each group's
conditional curvature there (by autodiff) for the differences' widths and the fallback factor, and the globals' mass
matrix becomes the transformed density's negative Hessian averaged over the chain's window: at its mean and at up to
:data:`CURVATURE_POINTS` - 1 of its draws, evenly spaced. Averaged over the posterior, the negative Hessian is the
covariance of the score (:math:`\mathbb{E}[-\nabla^2 \log\pi] = \mathbb{E}[\nabla\log\pi\,\nabla\log\pi^\top]`),
positive definite and the inverse covariance where the marginal is Gaussian; at one point of a funnel's neck it can
be nearly singular along the scale, and a mass matrix with a near-zero eigenvalue sends the trajectory along it until
warm-up shrinks the step a thousandfold, with no window left to mend it. (A window's covariance pooled over chains
that have not yet met would stretch it.) A chain whose steps fell below a tenth of the upper middle chain's at a
window's end is restarted from that chain by the driver (:mod:`.engine`). The steps are fixed at their averages for
sampling.

**What it does not do** (yet): estimate the exact stage from a subsample of rows (each sweep reads every row), or
read a group plate that the model writes as one vector site (``.to_event(1)``) rather than a ``pyro.plate``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.row_groups import RowGroups
from pyro_scalable.infer.multilevel.conditionals import Conditionals
from pyro_scalable.infer.multilevel.mala import DualAveraging, hmc, newton, precision_factor
from pyro_scalable.infer.multilevel.proxy import Taylor
from pyro_scalable.infer.multilevel.small import matvec

__all__ = ["Sweep", "SweepInfo"]

SECOND_STAGE = 0.75  # a window's mean second-stage acceptance below which warm-up gives the proxy up
STALE = 3.0  # in warm-up, the proxy is fitted again where a chain is once this many sds farther than a draw would be
QUARTER = math.pi / 2  # the globals' trajectory lasts at most a quarter period of the mass matrix's Gaussian


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


CURVATURE_POINTS = 8  # the window's points (its mean among them) at which the globals' curvature is averaged


def _curvature_points(window: Tensor, mean: Tensor) -> Tensor:
    """Each chain's window mean and up to ``CURVATURE_POINTS - 1`` of its draws, evenly spaced: ``(C, K, d)``."""
    steps = window.shape[1]
    if steps < 2:
        return mean[:, None]
    index = torch.linspace(0, steps - 1, min(CURVATURE_POINTS - 1, steps), device=window.device).round().long()
    return torch.cat([mean[:, None], window[:, index]], 1)


class Sweep(Conditionals):
    """One Metropolis-within-Gibbs sweep of every chain, and the warm-up that sets its preconditioners and steps."""

    def __init__(self, bridge: ModelBridge, groups: RowGroups, engine: Any):
        dtype = bridge.sites[groups.sites[0]].dtype
        super().__init__(bridge, groups, dtype, engine.proxy)
        self.per_step = min(engine.groups_per_step or self.num_groups, self.num_groups)
        self.global_steps = engine.global_steps or 3
        self.local_steps = engine.local_steps or 1
        ones = torch.ones(engine.num_chains, dtype=dtype, device=bridge.device)
        # the Newton move's step is at most 1 (a Gaussian conditional's exact draw); HMC's (several steps) aims at 0.7
        self.local_step = DualAveraging(ones, target=0.6, most=1.0)
        self.global_step = DualAveraging(
            ones, target=0.6 if self.global_steps == 1 else 0.7, most=QUARTER / self.global_steps
        )
        self.where: _Where | None = None
        self.fits = 0  # the window ends (and the start) at which a proxy was fitted
        self.seconds: dict[str, list[Tensor]] = {"local": [], "global": []}  # in warm-up: the second stage's acceptance

    # ---------------------------------------------------------------- warm-up
    def adapt_to(self, theta: Tensor, b_mean: Tensor, b_now: Tensor, proxy: bool = False) -> None:
        """Each chain's reference point and the curvatures there: the locals', and the globals' mass matrix.

        ``theta``: each chain's globals over a window (``(C, T, d)``, ``T = 1`` at the start); ``b_mean``: its
        locals' mean there (``(C, G, p)``); ``b_now``: where its locals are now. Everything is each chain's own, read
        where the chain is: a chain far from the others (a start in a narrow corner, a chain not yet converged) is
        preconditioned where it is, and no chain's metric is stretched by the others' distance from it. The globals'
        mass matrix is the transformed density's negative Hessian averaged over the window's mean and up to
        :data:`CURVATURE_POINTS` - 1 of its draws (module docstring), with ``eps`` fixed at the mean's. The proxy is
        fitted where the chain is now (``theta[:, -1]``, ``b_now``), not at the window's mean, a point a chain still
        drifting has left. With ``proxy`` (and the proxy wanted), the moves run on it from now on.
        """
        chains, d = theta.shape[0], self.layout.global_size
        theta_ref, self.b_ref = theta.mean(1), b_mean
        self.fallback = precision_factor(vmap(self._curvature)(theta_ref, self.b_ref))
        self.width = (self.fallback @ self.fallback.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).rsqrt()
        passes = self.p * 3
        seconds = [float(torch.stack(kind).mean()) for kind in self.seconds.values() if kind]
        # the proxy ran a window and was poor: the exact moves from now on (the first window is not judged: its proxy
        # was fitted at the start's draw, where a chain need not yet be typical)
        if self.proxy and seconds and min(seconds) < SECOND_STAGE and self.fits > 1:
            self.wants_proxy = False
        self.seconds = {"local": [], "global": []}
        self.taylor = ()
        if proxy and self.wants_proxy:
            passes += self._fit(theta[:, -1], b_now)
            self.fits += 1
        if d:  # the transformed density's curvature at the chain's point: where the map is exact, the marginal's
            fixed = (self.b_ref, self.width, self.fallback, self.taylor)
            centre, factor = vmap(self._laplace)(theta_ref, *fixed)
            eps = matvec(factor.transpose(-1, -2), self.b_ref - centre)
            offset = torch.zeros_like(self.b_ref[0])
            density = lambda x, *fixed: self._transformed(x, offset, *fixed)[0]  # noqa: E731
            at_points = vmap(torch.func.jacrev(torch.func.jacrev(density)), in_dims=(0,) + (None,) * (1 + len(fixed)))
            points = _curvature_points(theta, theta_ref)
            hessian = vmap(at_points)(points, eps, *fixed).mean(1)  # (C, d, d): each chain's over its K points
            self.global_factor = precision_factor(-hessian).to(theta.dtype)
            if not self.proxy:
                passes += points.shape[1] * d * 3 * (len(self.stencil) * self._map_share + 1)
        self.rows_read += chains * passes * self.rows.all.shape[0]
        self.local_step.restart(self.local_step.step)
        self.global_step.restart(self.global_step.step)
        self.where = None

    def refit_if_stale(self, theta: Tensor, b: Tensor) -> bool:
        r"""In warm-up: fit the proxy again where the chains are if one has left its reference far behind.

        Far: :data:`STALE` sds beyond the :math:`\sqrt{2d}` two draws are apart, in the globals' metric (about the
        posterior's sds). A proxy is a local expansion; a chain still travelling to the posterior's bulk leaves it
        behind, and its moves' second stage then rejects.
        """
        if not self.proxy or not self.layout.global_size:
            return False
        delta = (theta - self.taylor.theta).to(theta.dtype).unsqueeze(-1)
        limit = STALE + math.sqrt(2 * theta.shape[-1])  # two draws' distance is about sqrt(2 d) sds
        if not bool(((self.global_factor.transpose(-1, -2) @ delta).norm(dim=(-2, -1)) > limit).any()):
            return False
        self.rows_read += theta.shape[0] * self._fit(theta, b) * self.rows.all.shape[0]
        return True

    def _second(self, log_ratio: Tensor, kind: str, adapt: bool) -> Tensor:
        """Record, in warm-up, the mean acceptance of the second stage of one kind of move; return ``log_ratio``."""
        if adapt:
            accept = torch.where(torch.isfinite(log_ratio), log_ratio.clamp_max(0.0).exp(), 0.0)
            self.seconds[kind].append(accept.mean())
        return log_ratio

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
            self.rows_read += chains * self.rows.all.shape[0] * (1 + len(self.stencil) * self._map_share)
        accept_local = torch.zeros(chains, dtype=b.dtype, device=b.device)
        for _ in range(self.local_steps):
            b, accept = self._move_locals(theta, b, generator, adapt)
            accept_local = accept_local + accept / self.local_steps
        accept_global = torch.ones(chains, dtype=b.dtype, device=b.device)
        if self.layout.global_size:
            theta, b, accept_global = self._move_globals(theta, b, generator, adapt)
        return theta, b, SweepInfo(accept_local, accept_global)

    def _move_locals(self, theta: Tensor, b: Tensor, generator: torch.Generator, adapt: bool):
        """One Newton move of each drawn group's block on its own rows (module docstring, 1)."""
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
            return self._second(gap - where.gap[:, drawn], "local", adapt), [*more, gap]

        move = newton(
            b[:, drawn],
            where.per_group[:, drawn],
            where.gradient[:, drawn],
            where.factor[:, drawn],
            self.local_step.step[:, None],
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
        eps = matvec(self.where.factor.transpose(-1, -2), b - self.where.centre)
        fixed = (eps, self.b_ref, self.width, self.fallback, self.taylor)
        transformed = vmap(grad_and_value(self._transformed, argnums=(0, 1), has_aux=True))
        offset = torch.zeros_like(b)

        def density(x: Tensor) -> tuple[Tensor, ...]:
            (gradient_theta, gradient_b), (value, (per_group, moved, centre, factor)) = transformed(x, offset, *fixed)
            return value, gradient_theta, per_group, gradient_b, moved, centre, factor

        def correct(x: Tensor, more: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            gap = self._gap(x, more[2])
            change = gap.sum(-1) - self.where.gap.sum(-1)
            change = change - vmap(Taylor.globals)(self.taylor, x) + vmap(Taylor.globals)(self.taylor, theta)
            return self._second(change, "global", adapt), [*more, gap]

        value, gradient, *extra = density(theta)
        passes = (1 + self.global_steps) * (1 + len(self.stencil) * self._map_share)
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
