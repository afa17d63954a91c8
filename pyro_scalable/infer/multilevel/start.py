r"""Warm-up's start: each chain's globals at the mode of their Laplace marginal, then a draw from its Gaussian.

A chain started where Pyro's initialisation puts it (uniform in :math:`[-2, 2]` on the unconstrained scale) can be
hundreds of posterior sds from the bulk on a tall data set: at :math:`2 \cdot 10^5` rows an observation scale
:math:`e^{-1.7}` times the true one is about a thousand sds off in :math:`\log\sigma`. Warm-up then adapts its
steps and metric to a region whose curvature is orders of magnitude above the bulk's, its steps collapse, and its
windows end before the chain arrives. So, before warm-up, each chain climbs to the mode of the globals' **Laplace
marginal** (the groups integrated out as the sweep's map does it, :mod:`.conditionals`),

.. math::

    \log \hat p(\theta \mid y) = \log \pi\bigl(\theta, m(\theta)\bigr) - \sum_k \log\det L_k(\theta)
    + \text{const},

the transformed density of :mod:`.sweep` at :math:`\varepsilon = 0`, which is the exact marginal wherever every
group's conditional is Gaussian in :math:`b_k` (then :math:`\log\pi(\theta, b) = \log\pi(\theta, m) -
\tfrac12 (b - m)^\top P (b - m)` and integrating out :math:`b` leaves :math:`-\tfrac12\log\det P_k = -\log\det
L_k` per group). The climb is Newton's method on the Hessian's absolute eigenvalues, floored
(:func:`~.mala.precision_factor`), each step no longer in any coordinate than a trust radius (doubled after a whole
step, set to the length taken after a halved one) and halved until the marginal rises; after each step the map's
reference point moves to the groups' centres :math:`m(\theta)` (for a non-Gaussian conditional the map's single
Newton step is then taken where it is accurate). It stops where the Newton decrement :math:`g^\top(-H)^{-1}g` (the
squared distance to the mode in posterior sds) is below :data:`TOLERANCE`.

Each chain then starts from one draw of the Laplace approximation, :math:`\theta \sim \mathcal{N}(\hat\theta,
(-H)^{-1})` and :math:`b_k = m_k(\theta) + L_k(\theta)^{-\top}\varepsilon_k`, :math:`\varepsilon_k \sim
\mathcal{N}(0, I)`: approximately a posterior draw, each chain from its own climb and its own draw (so the chains
still start apart at the posterior's scale, and :math:`\hat R` still compares chains that did not share a start).
Nothing here enters the kept draws' law: it only chooses where warm-up begins.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad_and_value, jacrev, vmap

from pyro_scalable.infer.multilevel.mala import precision_factor

__all__ = ["MAX_NEWTON", "TOLERANCE", "climb", "laplace_start"]

MAX_NEWTON = 50  # Newton steps at most
TOLERANCE = 0.01  # the Newton decrement (squared sds to the mode) at which the climb stops
HALVINGS = 30  # halvings of a step that does not raise the marginal, before a chain stops climbing


def climb(sweep, theta: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each chain's mode of the globals' Laplace marginal by Newton's method (module docstring).

    ``sweep``: a :class:`~.sweep.Sweep` whose reference point, widths and fallback factors were set where the chains
    are (:meth:`~.sweep.Sweep.adapt_to`); its reference point moves to the groups' centres at the mode. ``theta``
    ``(C, d)``, ``b`` ``(C, G, p)``: where the chains are. Returns each chain's mode, the Cholesky factor of the
    marginal's negative Hessian there (eigenvalues floored), and the marginal's value (not finite for a chain whose
    marginal is not finite where it starts: that chain stays where it is).
    """
    d = sweep.layout.global_size
    offset = torch.zeros_like(b[0])

    def marginal(x: Tensor, b_ref: Tensor, width: Tensor, fallback: Tensor):
        value, (_, _, centre, _) = sweep._transformed(x, offset, offset, b_ref, width, fallback)
        return value, centre

    evaluate = vmap(grad_and_value(marginal, has_aux=True))
    hessian = vmap(jacrev(jacrev(lambda *a: marginal(*a)[0])))
    fixed = (sweep.width, sweep.fallback)
    per_evaluation = len(sweep.stencil) * sweep.map_share + 1  # passes over the rows
    passes = per_evaluation
    gradient, (value, centre) = evaluate(theta, sweep.b_ref, *fixed)
    x, climbing = theta, torch.isfinite(value)
    radius = torch.ones_like(value)  # each chain's trust radius: the largest move of one coordinate it tries
    for _ in range(MAX_NEWTON):
        factor = precision_factor(-hessian(x, sweep.b_ref, *fixed), absolute=True).to(x.dtype)
        passes += 3 * d * per_evaluation
        direction = torch.cholesky_solve(gradient.unsqueeze(-1), factor).squeeze(-1)
        climbing &= (gradient * direction).sum(-1) > TOLERANCE
        if not climbing.any():
            break
        longest = direction.abs().amax(-1).to(radius.dtype)
        scale, moved = (radius / longest).clamp_max(1.0), ~climbing
        for _ in range(HALVINGS):
            trial = x + scale.to(x.dtype)[:, None] * direction
            new_gradient, (new_value, new_centre) = evaluate(trial, sweep.b_ref, *fixed)
            passes += per_evaluation
            better = ~moved & torch.isfinite(new_value) & (new_value > value)
            x = torch.where(better[:, None], trial, x)
            gradient = torch.where(better[:, None], new_gradient, gradient)
            value = torch.where(better, new_value, value)
            centre = torch.where(better[:, None, None], new_centre, centre)
            moved |= better
            if bool(moved.all()):
                break
            scale = torch.where(moved, scale, 0.5 * scale)
        # a step taken whole widens the trust radius; a step that had to be halved sets it to the length it took
        whole = scale * longest >= radius
        radius = torch.where(whole, 2 * radius, (scale * longest).clamp_min(1e-3 * radius))
        climbing &= moved
        sweep.b_ref = centre  # the map recentred at the groups' centres: its Newton step taken where it is accurate
        gradient, (value, centre) = evaluate(x, sweep.b_ref, *fixed)
        passes += per_evaluation
    factor = precision_factor(-hessian(x, sweep.b_ref, *fixed).to(x.dtype))
    passes += 3 * d * per_evaluation
    sweep.rows_read += theta.shape[0] * passes * sweep.rows.all.shape[0]
    return x, factor, value


def laplace_start(sweep, theta: Tensor, b: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Each chain's start: one draw of the Laplace approximation at its climb's mode (module docstring).

    Arguments as :func:`climb`'s; draws from ``generator``. A model without globals starts where it is.
    """
    if not sweep.layout.global_size:
        return theta, b
    mode, factor, value = climb(sweep, theta, b)
    noise = torch.randn(mode.shape, generator=generator, dtype=mode.dtype, device=mode.device)
    spread = torch.linalg.solve_triangular(factor.transpose(-1, -2), noise.unsqueeze(-1), upper=True).squeeze(-1)
    finite = torch.isfinite(value)
    start_theta = torch.where(finite[:, None], mode + spread, theta)
    eps = torch.randn(b.shape, generator=generator, dtype=b.dtype, device=b.device)
    transformed = vmap(sweep._transformed)(
        start_theta, torch.zeros_like(b), eps, sweep.b_ref, sweep.width, sweep.fallback
    )
    sweep.rows_read += theta.shape[0] * (len(sweep.stencil) * sweep.map_share + 1) * sweep.rows.all.shape[0]
    return start_theta, torch.where(finite[:, None, None], transformed[1][1], b)
