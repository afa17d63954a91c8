r"""Exact moves of many independent blocks at once: a Newton-centred autoregressive move, and preconditioned HMC.

Blocks whose densities are independent given the rest (the groups of a plate given the global latents) move
together: one evaluation gives every block's log density :math:`\ell` and gradient, and each accepts on its own; an
end point whose density is not finite is rejected. Both moves take a preconditioner :math:`P = LL^\top` (a
curvature of :math:`-\ell`, fixed while the block moves: it must not depend on the block's own point) and a step.

**The Newton move** (the groups'). From :math:`x`, with step :math:`s \in (0, 1]` and :math:`a = 1 - \sqrt{1 -
s^2}`, propose

.. math::

    x' = x + a P^{-1}\nabla\ell(x) + s L^{-\top}\xi, \qquad \xi \sim \mathcal{N}(0, I),

and accept with probability :math:`\min\{1, e^{\ell(x') - \ell(x)}\, q(x \mid x') / q(x' \mid x)\}`, :math:`q` the
proposal's Gaussian density. Where :math:`\ell` is Gaussian with precision :math:`P` and centre :math:`m`, the
proposal is :math:`x' = m + \sqrt{1 - s^2}\,(x - m) + s L^{-\top}\xi`: an autoregression reversible with respect to
that Gaussian, so every proposal is accepted, and at :math:`s = 1` it is an exact draw of the block's law,
independent of :math:`x` (a Newton step to the centre, then a draw of the Gaussian there). A non-Gaussian block, or
a preconditioner that is only close, pays in acceptance; its centre is :math:`x`'s own Newton step, from the
block's exact gradient. For small :math:`s`, :math:`a \approx s^2/2` and the move is MALA with step :math:`s`.
MALA itself (drift :math:`h^2/2`, noise :math:`h`) is reversible for no Gaussian at a finite step, and at the step
its acceptance target picks it is antithetic: excellent for a block's mean, slow for its spread.

**Preconditioned HMC** (the globals'). A trajectory draws a momentum :math:`\rho \sim \mathcal{N}(0, P)`, takes
:math:`L` leapfrog steps

.. math::

    \rho \leftarrow \rho + \tfrac{h}{2}\nabla\ell(x), \qquad x \leftarrow x + h P^{-1}\rho, \qquad
    \rho \leftarrow \rho + \tfrac{h}{2}\nabla\ell(x),

and accepts the end point with probability :math:`\min(1, e^{H_0 - H_L})`, :math:`H = -\ell(x) + \tfrac12
\rho^\top P^{-1} \rho`. The leapfrog map is reversible and keeps volume, so the move leaves :math:`e^{\ell}`
invariant exactly, whatever :math:`P`, :math:`h` and :math:`L`.

Each step is set in warm-up by dual averaging (Nesterov 2009, as NUTS sets its step): with acceptance
:math:`a_t` and target :math:`\delta`, :math:`\bar H_t = (1 - \tfrac{1}{t + t_0}) \bar H_{t-1} + \tfrac{1}{t + t_0}
(\delta - a_t)`, :math:`\log h_t = \mu - \tfrac{\sqrt t}{\gamma} \bar H_t` (capped where the step has a largest
value, the Newton move's 1), and the step kept is the average :math:`\log \bar h_t = t^{-\kappa} \log h_t + (1 -
t^{-\kappa}) \log \bar h_{t-1}`. MALA's optimal acceptance in high dimension is 0.574 (Roberts & Rosenthal 1998),
HMC's about 0.65; blocks of few coordinates take 0.6 and 0.7.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pyro_scalable.infer.multilevel.small import cholesky_solve, matvec, solve_lower_transposed

__all__ = ["DualAveraging", "Move", "hmc", "newton", "precision_factor"]

TARGET = 0.6  # the acceptance the step aims at
JITTER_LOW, JITTER_HIGH = 0.5, 1.5  # an HMC trajectory's step: the adapted one times a uniform draw in this range


def precision_factor(precision: Tensor, floor: float = 1e-8, absolute: bool = False) -> Tensor:
    """The Cholesky factor of ``precision`` (batched ``(..., p, p)``) after its eigenvalues are raised to a floor.

    A curvature read at one point need not be positive definite (a likelihood that is not log-concave there); its
    eigenvalues below ``floor`` times the largest (and below an absolute ``floor``) are raised to that floor, and a
    non-finite entry counts as 0 (computed in float64, returned in the curvature's dtype). With ``absolute``, each
    eigenvalue is first replaced by its absolute value (Newton's step on it still climbs along a direction of
    negative curvature, Dauphin et al. 2014, where a floored one would send the step arbitrarily far along it).
    """
    wide = precision.double()  # in float64: a float32 reconstruction can miss positive definiteness by rounding
    wide = torch.where(torch.isfinite(wide), wide, torch.zeros_like(wide))
    values, vectors = torch.linalg.eigh(0.5 * (wide + wide.transpose(-1, -2)))
    values = values.abs() if absolute else values
    least = floor * values.abs().amax(-1, keepdim=True).clamp_min(1.0)
    values = values.clamp_min(least)
    return torch.linalg.cholesky((vectors * values.unsqueeze(-2)) @ vectors.transpose(-1, -2)).to(precision.dtype)


@dataclass
class Move:
    """One move of every block: where each is now, its log density and gradient there, and the acceptances."""

    x: Tensor
    log_density: Tensor
    gradient: Tensor
    accept: Tensor  # the acceptance probability of each block's proposal, min(1, alpha)
    extra: tuple[Tensor, ...] = ()  # what the density gave besides, at the block's new place


def _where(taken: Tensor, new: Tensor, old: Tensor) -> Tensor:
    return torch.where(taken.reshape(taken.shape + (1,) * (new.dim() - taken.dim())), new, old)


class DualAveraging:
    """The step of one kind of block in each chain, set by dual averaging of its acceptance (module docstring)."""

    def __init__(
        self,
        step: Tensor,
        target: float = TARGET,
        gamma: float = 0.05,
        t0: float = 10.0,
        kappa: float = 0.75,
        most: float = math.inf,
    ):
        self.target, self.gamma, self.t0, self.kappa, self.most = target, gamma, t0, kappa, most
        self.restart(step)

    def restart(self, step: Tensor) -> None:
        """Start again from ``step`` (after the preconditioner changed): ``mu = log(10 h)``, as NUTS restarts."""
        self.step = step.clone()
        self.mu = torch.log(10 * step)
        self.count = 0
        self.error = torch.zeros_like(step)
        self.log_average = torch.zeros_like(step)

    def update(self, accept: Tensor) -> Tensor:
        """Take each chain's acceptance (its mean over blocks); return the next steps to use."""
        self.count += 1
        t = self.count
        weight = 1.0 / (t + self.t0)
        self.error = (1 - weight) * self.error + weight * (self.target - accept)
        log_step = (self.mu - math.sqrt(t) / self.gamma * self.error).clamp_max(math.log(self.most))
        eta = t ** (-self.kappa)
        self.log_average = eta * log_step + (1 - eta) * self.log_average
        self.step = log_step.exp()
        return self.step

    @property
    def final(self) -> Tensor:
        """The averaged steps, kept for sampling."""
        return self.log_average.exp() if self.count else self.step


def hmc(
    x: Tensor,
    log_density: Tensor,
    gradient: Tensor,
    factor: Tensor,
    step: Tensor | float,
    steps: int,
    density: Callable[[Tensor], tuple[Tensor, ...]],
    generator: torch.Generator,
    extra: tuple[Tensor, ...] = (),
    correct: Callable[[Tensor, list[Tensor]], tuple[Tensor, list[Tensor]]] | None = None,
) -> Move:
    r"""One Hamiltonian Monte Carlo trajectory of ``steps`` leapfrog steps for each block (MALA is one step).

    The momentum is :math:`\rho \sim \mathcal{N}(0, P)` with :math:`P = LL^\top` (the mass matrix), the positions move
    by :math:`h P^{-1}\rho`, and the end point is accepted with probability :math:`\min(1, e^{-\Delta H})`,
    :math:`H = -\ell(x) + \tfrac12 \rho^\top P^{-1}\rho`: the leapfrog map is reversible and keeps volume, so the
    move leaves :math:`e^{\ell}` invariant exactly. A trajectory of :math:`L` steps costs :math:`L` evaluations and
    travels about :math:`L` times as far as one MALA move, where :math:`L` MALA moves diffuse :math:`\sqrt L` times.
    Each block's step is ``step`` times a uniform draw in [0.5, 1.5] (Neal 2011): a fixed length near half a period
    of the target's oscillation would send a Gaussian block to its mirror image, :math:`x' \approx -x`, a move whose
    mean is excellent and whose spread never changes (the squares' effective sample size collapses); a random
    length breaks the period, and the move stays reversible since the length does not depend on the state.
    ``log_density``/``gradient``: the blocks' :math:`\ell` and :math:`\nabla\ell` at ``x`` (``(...)``,
    ``(..., p)``); ``factor``: each block's ``L`` (``(..., p, p)``); ``step``: one number or one per block;
    ``density(x')`` gives :math:`\ell` and :math:`\nabla\ell` at a point, and may give more (``extra``: tensors whose
    leading dimensions are the blocks'), which the move keeps from where each block ends (``extra`` given: their
    values at ``x``). Draws from ``generator``: the steps' jitter, the momentum, then one uniform per block.

    ``correct`` makes the move a delayed-acceptance one (Christen & Fox 2005) when ``density`` is a proxy
    :math:`\tilde\ell` of the target :math:`\ell`: ``correct(x', extra')`` gives each block's
    :math:`(\ell - \tilde\ell)(x') - (\ell - \tilde\ell)(x)` (and ``extra'`` updated), and a proposal the first
    stage took is kept with probability :math:`\min(1, e^{\text{that}})`, from a second uniform per block. The
    two stages' product satisfies detailed balance for :math:`e^{\ell}`, so the move is exact for the target while
    its trajectory costs only the proxy's evaluations; the acceptance returned is the product of the two.
    """
    step = torch.as_tensor(step, dtype=x.dtype, device=x.device).expand(x.shape[:-1]).unsqueeze(-1)
    jitter = torch.rand(step.shape, generator=generator, dtype=x.dtype, device=x.device)
    step = step * (JITTER_LOW + (JITTER_HIGH - JITTER_LOW) * jitter)
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    momentum = matvec(factor, noise)  # covariance L L^T = P

    def kinetic(rho: Tensor) -> Tensor:
        return 0.5 * (rho * cholesky_solve(rho, factor)).sum(-1)

    start = -log_density + kinetic(momentum)
    position, value, grad, more = x, log_density, gradient, extra
    rho = momentum + 0.5 * step * grad
    for k in range(steps):
        position = position + step * cholesky_solve(rho, factor)
        value, grad, *more = density(position)
        rho = rho + (0.5 if k == steps - 1 else 1.0) * step * grad
    return _accept(
        x,
        log_density,
        gradient,
        extra,
        (position, value, grad, more),
        start - (-value + kinetic(rho)),
        generator,
        correct,
    )


def newton(
    x: Tensor,
    log_density: Tensor,
    gradient: Tensor,
    factor: Tensor,
    step: Tensor | float,
    density: Callable[[Tensor], tuple[Tensor, ...]],
    generator: torch.Generator,
    extra: tuple[Tensor, ...] = (),
    correct: Callable[[Tensor, list[Tensor]], tuple[Tensor, list[Tensor]]] | None = None,
) -> Move:
    r"""One Newton-centred autoregressive move of each block (module docstring): exact for any ``factor``.

    Arguments as :func:`hmc`'s; ``step`` (:math:`s`, one number or one per block) is capped at 1, the exact draw of
    a Gaussian block whose precision is ``factor``'s. Draws from ``generator``: the proposal's noise, then one
    uniform per block (and a second with ``correct``).
    """
    step = torch.as_tensor(step, dtype=x.dtype, device=x.device).expand(x.shape[:-1]).clamp_max(1.0)
    drift = (1 - (1 - step.square()).clamp_min(0.0).sqrt()).unsqueeze(-1)  # a = 1 - sqrt(1 - s^2)

    def mean(z: Tensor, g: Tensor) -> Tensor:
        return z + drift * cholesky_solve(g, factor)

    def log_proposal(to: Tensor, centre: Tensor) -> Tensor:  # log q(to | from), up to a constant shared by both ways
        white = matvec(factor.transpose(-1, -2), to - centre)
        return -0.5 * white.square().sum(-1) / step.square()

    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    position = mean(x, gradient) + step.unsqueeze(-1) * solve_lower_transposed(factor, noise)
    value, grad, *more = density(position)
    log_alpha = value - log_density + log_proposal(x, mean(position, grad)) - log_proposal(position, mean(x, gradient))
    return _accept(x, log_density, gradient, extra, (position, value, grad, more), log_alpha, generator, correct)


def _accept(x, log_density, gradient, extra, proposed, log_alpha, generator, correct) -> Move:
    """Each block's Metropolis-Hastings decision on ``log_alpha`` (then on ``correct``'s ratio, delayed acceptance)."""
    position, value, grad, more = proposed
    log_alpha = torch.where(torch.isfinite(log_alpha), log_alpha, torch.full_like(log_alpha, -math.inf))
    uniform = torch.rand(log_alpha.shape, generator=generator, dtype=x.dtype, device=x.device)
    taken = uniform.log() < log_alpha
    accept = log_alpha.clamp_max(0.0).exp()
    if correct is not None:
        log_ratio, more = correct(position, more)
        log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, torch.full_like(log_ratio, -math.inf))
        second = torch.rand(log_alpha.shape, generator=generator, dtype=x.dtype, device=x.device)
        taken = taken & (second.log() < log_ratio)
        accept = accept * log_ratio.clamp_max(0.0).exp()
    return Move(
        torch.where(taken.unsqueeze(-1), position, x),
        torch.where(taken, value, log_density),
        torch.where(taken.unsqueeze(-1), grad, gradient),
        accept.to(x.dtype),
        tuple(_where(taken, new, old) for new, old in zip(more, extra, strict=True)),
    )
