r"""Preconditioned HMC (and MALA, its one-step case) on many independent blocks at once; dual averaging of the step.

For a block :math:`x \in \mathbb{R}^p` with log density :math:`\ell` (up to a constant), a mass matrix
:math:`P = LL^\top` (the preconditioner: a curvature of :math:`-\ell`, fixed while the block moves) and a step
:math:`h`, one trajectory draws a momentum :math:`\rho \sim \mathcal{N}(0, P)`, takes :math:`L` leapfrog steps

.. math::

    \rho \leftarrow \rho + \tfrac{h}{2}\nabla\ell(x), \qquad x \leftarrow x + h P^{-1}\rho, \qquad
    \rho \leftarrow \rho + \tfrac{h}{2}\nabla\ell(x),

and accepts the end point with probability :math:`\min(1, e^{H_0 - H_L})`, :math:`H = -\ell(x) + \tfrac12
\rho^\top P^{-1} \rho`. The leapfrog map is reversible and keeps volume, so the move leaves :math:`e^{\ell}`
invariant exactly, whatever :math:`P`, :math:`h` and :math:`L`, as long as none depends on :math:`x` itself. With
:math:`L = 1` it is the Metropolis-adjusted Langevin move (MALA): the proposal
:math:`x' = x + \tfrac{h^2}{2}P^{-1}\nabla\ell(x) + h L^{-\top}\xi`. Blocks whose densities are independent given
the rest (the groups of a plate given the global latents) move together: one evaluation gives every block's
:math:`\ell` and gradient, and each accepts on its own. An end point whose density is not finite is rejected.

The step is set in warm-up by dual averaging (Nesterov 2009, as NUTS sets its step): with acceptance
:math:`a_t` and target :math:`\delta`, :math:`\bar H_t = (1 - \tfrac{1}{t + t_0}) \bar H_{t-1} + \tfrac{1}{t + t_0}
(\delta - a_t)`, :math:`\log h_t = \mu - \tfrac{\sqrt t}{\gamma} \bar H_t`, and the step kept is the average
:math:`\log \bar h_t = t^{-\kappa} \log h_t + (1 - t^{-\kappa}) \log \bar h_{t-1}`. MALA's optimal acceptance in
high dimension is 0.574 (Roberts & Rosenthal 1998), HMC's about 0.65; blocks of few coordinates take 0.6 and 0.7.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pyro_scalable.infer.multilevel.small import cholesky_solve, matvec

__all__ = ["DualAveraging", "Move", "hmc", "precision_factor"]

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
        self, step: Tensor, target: float = TARGET, gamma: float = 0.05, t0: float = 10.0, kappa: float = 0.75
    ):
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
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
        log_step = self.mu - math.sqrt(t) / self.gamma * self.error
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
    log_alpha = start - (-value + kinetic(rho))
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
