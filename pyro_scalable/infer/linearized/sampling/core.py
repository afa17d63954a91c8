r"""Sample-then-optimise: posterior samples of a linear-Gaussian model as minimisers of convex quadratics.

Model: :math:`y_i = \phi(x_i)\theta + \eta_i`, :math:`\theta \sim \mathcal N(0, A^{-1})`,
:math:`\eta_i \sim \mathcal N(0, B_i^{-1})`, so the posterior is :math:`\mathcal N(\bar\theta, H^{-1})` with
:math:`M = \sum_i \phi_i^\top B_i \phi_i` and :math:`H = M + A`. A zero-mean sample
:math:`\zeta \sim \mathcal N(0, H^{-1})` is the minimiser of the low-variance objective (Antorán et al. 2023)

.. math::

    L'(z) = \tfrac12 \sum_i \lVert\phi_i z\rVert^2_{B_i} + \tfrac12 \lVert z - \theta^n\rVert^2_A, \qquad
    \theta^n = \theta^0 + A^{-1}\sum_i \phi_i^\top B_i^{1/2}\xi_i,

with :math:`\theta^0 \sim \mathcal N(0, A^{-1})` and :math:`\xi_i \sim \mathcal N(0, I)`: its minimiser
:math:`H^{-1}(A\theta^0 + \sum_i \phi_i^\top B_i^{1/2}\xi_i)` has covariance :math:`H^{-1}(A + M)H^{-1} = H^{-1}`.
The data term has no target, so its minibatch estimate :math:`\frac{N}{|\mathcal B|}\sum_{i\in\mathcal B}
\phi_i^\top B_i\phi_i z` is the only noise; the regulariser's gradient :math:`A(z - \theta^n)` is exact
(:math:`\theta^n` takes one pass over the data, done once).

The posterior mean solves the same kind of quadratic (a centre of its own, see :mod:`.problem`), but its solution is
:math:`O(\lVert\theta\rVert)` where a sample's is :math:`O(\text{posterior sd})`, so the multiplicative minibatch
noise :math:`\propto \lVert z\rVert` would swamp it. Rows may therefore carry an *anchor* :math:`\tilde z` with its
full-data product :math:`M\tilde z` (a control variate, as in SVRG: Johnson & Zhang 2013): their data term is
:math:`\frac{N}{|\mathcal B|}\sum_{i\in\mathcal B}\phi_i^\top B_i\phi_i (z - \tilde z) + M\tilde z`, still unbiased,
with noise :math:`\propto \lVert z - \tilde z\rVert`, which vanishes as the anchor is refreshed near the solution.

**Preconditioning.** Plain SGD's step is bounded by the largest eigenvalue of a minibatch's estimate of :math:`H`,
and the error along an eigenvector of eigenvalue :math:`\lambda` shrinks by :math:`1 - \eta\lambda` per step: the
directions the prior dominates (:math:`\lambda \approx A_{jj}`, often :math:`10^3`-:math:`10^4` times below the
largest) hardly move in 20 epochs, and features of different scales spread the data's own eigenvalues the same
way. The step therefore takes :math:`P^{-1}\nabla L'` with the diagonal :math:`P = \mathrm{diag}(M) + A` (exact:
one GGN-diagonal pass, :mod:`~pyro_scalable.infer.linearized.ggn`), which is SGD on the quadratic in
:math:`P^{1/2}z`, whose Hessian :math:`P^{-1/2}HP^{-1/2}` has a unit diagonal: every coordinate's own curvature,
prior-dominated or data-dominated, is 1. What remains is the conditioning due to correlations between coordinates.

The optimiser is SGD with Nesterov momentum, per-sample gradient clipping and a linear step-size decay, with all
:math:`K` samples stepped together: one batched Jacobian-vector and one vector-Jacobian product per minibatch
(``ggn_vp`` below). The functional core here sees only ``ggn_vp(z, batch)`` — for a Pyro model the bridge's
:class:`~pyro_scalable.infer.linearized.network.NetworkFunction` provides it — and is testable without Pyro.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.infer.autodiff import row_slices

__all__ = [
    "SampleInfo",
    "SampleState",
    "init",
    "joined_rows",
    "regularizer_targets",
    "step",
    "with_anchor",
]

# ggn_vp(vectors (K, d), batch) -> (K, d): sum over the minibatch's points of phi_i^T B_i phi_i v, unscaled
GGNVectorProduct = Callable[[Tensor, Any], Tensor]


class SampleState(NamedTuple):
    """Everything the next step needs, for K samples optimised together. Every field is a tensor."""

    samples: Tensor  # (K, d): the current iterates z
    velocity: Tensor  # (K, d): Nesterov momentum buffer; (0, d) after a conjugate-gradient refinement (unused)
    targets: Tensor  # (K, d): theta^n, the centre of each sample's regulariser
    anchor: Tensor  # (R, d): control-variate anchors of the last R rows (R may be 0)
    anchor_product: Tensor  # (R, d): their full-data products M anchor
    step_count: Tensor  # 0-d int64


class SampleInfo(NamedTuple):
    """What a person reads after a step: the minibatch objective and gradient norm of every sample."""

    objective: Tensor  # (K,)
    grad_norm: Tensor  # (K,), before clipping
    step_size: Tensor  # 0-d


def regularizer_targets(prior_sample: Tensor, prior_precision: Tensor, perturbation: Tensor) -> Tensor:
    r""":math:`\theta^n = \theta^0 + A^{-1} \sum_i \phi_i^\top B_i^{1/2} \xi_i` from ``perturbation`` = the sum."""
    return prior_sample + perturbation / prior_precision


def init(targets: Tensor, samples: Tensor | None = None) -> SampleState:
    """Start every row at ``samples`` (default: its regulariser's centre), with no anchors."""
    start = targets.clone() if samples is None else samples.clone()
    none = start.new_zeros((0, start.shape[-1]))
    return SampleState(
        start, torch.zeros_like(start), targets, none, none, torch.zeros((), dtype=torch.long, device=start.device)
    )


def with_anchor(state: SampleState, anchor: Tensor, anchor_product: Tensor) -> SampleState:
    """Anchor the last ``len(anchor)`` rows at ``anchor``, whose full-data products are ``anchor_product``.

    The anchors are copied into the rows below the samples in one buffer (made once, then reused), so that a step
    hands the samples and the anchors to ``ggn_vp`` together without concatenating them; ``anchor`` may be a view of
    the samples.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.linearized.sampling import core
        >>> state = core.init(torch.zeros(3, 4))
        >>> state = core.with_anchor(state, state.samples[-1:], torch.ones(1, 4))
        >>> core.joined_rows(state).shape
        torch.Size([4, 4])

    """
    z = state.samples
    k, r = z.shape[0], anchor.shape[0]
    rows = joined_rows(state) if state.anchor.shape[0] == r else None
    if rows is None:
        rows = z.new_empty((k + r, z.shape[-1]))
        rows[:k] = z
    rows[k:] = anchor
    return state._replace(samples=rows[:k], anchor=rows[k:], anchor_product=anchor_product)


def joined_rows(state: SampleState) -> Tensor | None:
    """The samples and the anchors as one ``(K + R, d)`` tensor, a view, where they lie so in memory; else ``None``.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.linearized.sampling import core
        >>> state = core.init(torch.zeros(3, 4))
        >>> core.joined_rows(state) is state.samples  # no anchors: the samples themselves
        True
        >>> core.joined_rows(state._replace(anchor=torch.zeros(1, 4))) is None  # anchors elsewhere in memory
        True

    """
    z, anchor = state.samples, state.anchor
    if anchor.shape[0] == 0:
        return z
    adjacent = (
        z.is_contiguous()
        and anchor.is_contiguous()
        and z.untyped_storage().data_ptr() == anchor.untyped_storage().data_ptr()
        and anchor.data_ptr() == z.data_ptr() + z.numel() * z.element_size()
    )
    if not adjacent:
        return None
    return z.as_strided((z.shape[0] + anchor.shape[0], z.shape[1]), z.stride(), z.storage_offset())


def step(
    state: SampleState,
    batch: Any,
    ggn_vp: GGNVectorProduct,
    *,
    prior_precision: Tensor,
    data_scale: float,
    step_size: float | Tensor,
    momentum: float = 0.9,
    max_grad_norm: float | None = None,
    inverse_preconditioner: Tensor | None = None,
    inplace: bool = False,
    objective: bool = True,
    check: Callable[[Tensor], None] | None = None,
) -> tuple[SampleState, SampleInfo]:
    """One Nesterov SGD step of every sample on ``batch``.

    Args:
        data_scale: N / |batch|, so that ``data_scale * ggn_vp`` estimates the full-data product without bias.
        max_grad_norm: clip each sample's (preconditioned) step direction to this Euclidean norm (``None``: no
            clipping).
        inverse_preconditioner: ``P⁻¹`` (diagonal, shape ``(d,)``): the step follows ``P⁻¹ ∇`` (``None``: the
            identity).
        inplace: update ``state.samples`` and ``state.velocity`` in place (the returned state holds the same
            tensors): the only ``K x d`` allocation is the product ``ggn_vp`` returns (the anchors' rows with it).
            The arithmetic is the same either way.
        objective: compute ``SampleInfo.objective``; ``False`` gives NaNs.
        check: called with the gradient norms before anything is updated; may raise to keep the state as it was.

    """
    z = state.samples
    k, anchored = z.shape[0], state.anchor.shape[0]
    rows = joined_rows(state)
    gradient = ggn_vp(torch.cat([z, state.anchor]) if rows is None else rows, batch)
    gradient.mul_(data_scale)  # a fresh tensor: the data term of every row, then the anchors' products
    if anchored:
        correction = gradient[k:].neg_().add_(state.anchor_product)  # M anchor - its minibatch estimate
        gradient[k - anchored : k].add_(correction)
        gradient = gradient[:k]
    value = torch.full((k,), math.nan, dtype=z.dtype, device=z.device)
    for part in row_slices(k, z.shape[-1]):  # the prior's term, a slice of rows at a time
        offset = z[part] - state.targets[part]
        if objective:
            data = 0.5 * (z[part] * gradient[part]).sum(-1)
            value[part] = data + 0.5 * (prior_precision * offset.square()).sum(-1)
        gradient[part].addcmul_(offset, prior_precision)
    grad_norm = gradient.norm(dim=-1)
    if check is not None:
        check(grad_norm)
    if inverse_preconditioner is not None:
        gradient.mul_(inverse_preconditioner)
    if max_grad_norm is not None:
        norm = gradient.norm(dim=-1)
        gradient.mul_((max_grad_norm / norm.clamp_min(max_grad_norm)).unsqueeze(-1))
    samples, velocity = (z, state.velocity) if inplace else (z.clone(), state.velocity.clone())
    velocity.mul_(momentum).add_(gradient)
    update = gradient.add_(velocity, alpha=momentum)
    step_size = torch.as_tensor(step_size, dtype=z.dtype, device=z.device)
    samples.sub_(update.mul_(step_size))
    new = state._replace(samples=samples, velocity=velocity, step_count=state.step_count + 1)
    return new, SampleInfo(value.detach(), grad_norm.detach(), step_size)
