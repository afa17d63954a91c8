r"""Preconditioned MALA on many independent blocks at once, and the dual averaging that sets its step.

For a block :math:`x \in \mathbb{R}^p` with log density :math:`\ell` (up to a constant), a precision-like matrix
:math:`P = LL^\top` (the preconditioner, fixed while the block moves) and a step :math:`h`, the Metropolis-adjusted
Langevin move proposes

.. math::

    x' = x + \tfrac{h^2}{2} P^{-1} \nabla\ell(x) + h\, L^{-\top} \xi, \qquad \xi \sim \mathcal{N}(0, I_p),

a Gaussian :math:`q(x' \mid x)` with mean :math:`m(x) = x + \tfrac{h^2}{2}P^{-1}\nabla\ell(x)` and covariance
:math:`h^2 P^{-1}`, and accepts it with probability :math:`\min(1, \alpha)`,

.. math::

    \log\alpha = \ell(x') - \ell(x) + \log q(x \mid x') - \log q(x' \mid x), \qquad
    \log q(a \mid b) = -\tfrac{1}{2h^2} \lVert L^\top (a - m(b)) \rVert^2 + \text{const},

so the move leaves :math:`e^{\ell}` invariant exactly (detailed balance), whatever :math:`P` and :math:`h`, as long
as neither depends on :math:`x` itself. Blocks whose densities are independent given the rest (the groups of a
plate given the global latents) move together: one evaluation gives every block's :math:`\ell` and gradient, and
each accepts on its own. A proposal whose density is not finite is rejected.

The step is set in warm-up by dual averaging (Nesterov 2009, as NUTS sets its step): with acceptance
:math:`a_t` and target :math:`\delta`, :math:`\bar H_t = (1 - \tfrac{1}{t + t_0}) \bar H_{t-1} + \tfrac{1}{t + t_0}
(\delta - a_t)`, :math:`\log h_t = \mu - \tfrac{\sqrt t}{\gamma} \bar H_t`, and the step kept is the average
:math:`\log \bar h_t = t^{-\kappa} \log h_t + (1 - t^{-\kappa}) \log \bar h_{t-1}`. MALA's optimal acceptance in
high dimension is 0.574 (Roberts & Rosenthal 1998); a block of few coordinates is near that at 0.6.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DualAveraging", "Move", "mala", "precision_factor"]

TARGET = 0.6  # the acceptance the step aims at


def precision_factor(precision: Tensor, floor: float = 1e-8) -> Tensor:
    """The Cholesky factor of ``precision`` (batched ``(..., p, p)``) after its eigenvalues are raised to a floor.

    A curvature read at one point need not be positive definite (a likelihood that is not log-concave there); its
    eigenvalues below ``floor`` times the largest (and below an absolute ``floor``) are raised to that floor, and a
    non-finite entry counts as 0 (computed in float64, returned in the curvature's dtype).
    """
    wide = precision.double()  # in float64: a float32 reconstruction can miss positive definiteness by rounding
    wide = torch.where(torch.isfinite(wide), wide, torch.zeros_like(wide))
    values, vectors = torch.linalg.eigh(0.5 * (wide + wide.transpose(-1, -2)))
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


def _drift(gradient: Tensor, factor: Tensor, step: Tensor) -> Tensor:
    return 0.5 * step**2 * torch.cholesky_solve(gradient.unsqueeze(-1), factor).squeeze(-1)


def mala(
    x: Tensor,
    log_density: Tensor,
    gradient: Tensor,
    factor: Tensor,
    step: Tensor | float,
    density: Callable[[Tensor], tuple[Tensor, ...]],
    generator: torch.Generator,
    extra: tuple[Tensor, ...] = (),
) -> Move:
    r"""One MALA move of blocks ``x`` (``(..., p)``), each with its own factor ``L`` (``(..., p, p)``) of ``P``.

    ``log_density``/``gradient``: the blocks' :math:`\ell` and :math:`\nabla\ell` at ``x`` (``(...)``,
    ``(..., p)``); ``step``: one number, or one per block (``(...)``, broadcast); ``density(x')`` gives them at a
    proposal, and may give more (``extra``: tensors whose leading dimensions are the blocks'), which the move keeps
    from where each block ends (``extra`` given: their values at ``x``). Draws from ``generator``: the proposal's
    noise, then one uniform per block.
    """
    step = torch.as_tensor(step, dtype=x.dtype, device=x.device).expand(x.shape[:-1]).unsqueeze(-1)
    forward = x + _drift(gradient, factor, step)
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    moved = torch.linalg.solve_triangular(factor.transpose(-1, -2), noise.unsqueeze(-1), upper=True).squeeze(-1)
    proposal = forward + step * moved
    proposed_density, proposed_gradient, *proposed_extra = density(proposal)
    backward = proposal + _drift(proposed_gradient, factor, step)
    reverse = ((factor.transpose(-1, -2) @ (x - backward).unsqueeze(-1)).squeeze(-1) / step).square().sum(-1)
    log_alpha = proposed_density - log_density - 0.5 * reverse + 0.5 * noise.square().sum(-1)
    log_alpha = torch.where(torch.isfinite(log_alpha), log_alpha, torch.full_like(log_alpha, -math.inf))
    uniform = torch.rand(log_alpha.shape, generator=generator, dtype=x.dtype, device=x.device)
    taken = uniform.log() < log_alpha
    return Move(
        torch.where(taken.unsqueeze(-1), proposal, x),
        torch.where(taken, proposed_density, log_density),
        torch.where(taken.unsqueeze(-1), proposed_gradient, gradient),
        log_alpha.clamp_max(0.0).exp(),
        tuple(_where(taken, new, old) for new, old in zip(proposed_extra, extra, strict=True)),
    )


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
