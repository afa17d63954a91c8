r"""The checks of a linearisation point, for every linearised engine: is it a MAP, and can σ be fitted there.

**Is it a MAP?** The Gauss-Newton gain.

Let :math:`b` be the gradient of the log joint at :math:`\theta_*` and :math:`H = G + P` the posterior precision,
with :math:`G` the exact generalised Gauss-Newton matrix over the full data. One Gauss-Newton step from
:math:`\theta_*` would gain :math:`g = \tfrac12 b^\top H^{-1} b` nats of the linearised log joint: zero at a MAP.

The check solves :math:`H s = b` by preconditioned conjugate gradients with the exact :math:`H` (one full-data
GGN-vector product per iteration). For every point :math:`s` the quadratic model's gain

.. math:: q(s) = b^\top s - \tfrac12 s^\top H s = \tfrac12 (b + r)^\top s, \qquad r = b - H s,

is at most :math:`g`, with equality at :math:`s = H^{-1} b`, and CG's iterates increase it monotonically. So a few
iterations give a *lower bound* on :math:`g` — what the check reports and warns on — which is already :math:`g`
where the preconditioner is good: the Laplace structure's own :math:`H` (exact for ``"full"``, so one iteration),
or sample-then-optimise's solved Newton step as the starting point (then no iteration at all).

It also has an upper bound, free: :math:`g - q(s) = \tfrac12 r^\top H^{-1} r \le \tfrac12 r^\top P^{-1} r`, since
:math:`H \succeq P` (the GGN is positive semi-definite). The check stops as soon as that bound is at most the
threshold: no warning could follow, whatever further iterations found (at :math:`s = 0`, where
:math:`\tfrac12 b^\top P^{-1} b` is at most the threshold, it takes no GGN product at all); once the lower bound
is above it, the warning is certain. With both bounds the iterations go on past the usual :data:`ITERATIONS` until
one of them decides, up to :data:`DECIDING_ITERATIONS`: a fixed count of three would stay quiet at a point whose
gain it had not yet reached (the lower bound grows with the iterations, and on a network trained by Adam and L-BFGS it
can pass the threshold only after several more). The returned lower bound is where the iterations stopped.

The Laplace guide, whatever its structure, and sample-then-optimise thus give one verdict on one point.

**Can σ be fitted?** With :math:`\gamma = \sum_j (1 - P_j (H^{-1})_{jj})` the number of parameters the data
determine (MacKay 1992), the evidence's optimum in a Normal's σ satisfies :math:`\sigma^2 \approx
\mathrm{RSS}/(N - \gamma)`: only :math:`N - \gamma` of the :math:`N` observations measure the noise. Where a
network's MAP interpolates its training data (:math:`\gamma \to N`, residuals near zero) that ratio is 0/0, and σ
is set by everything but the data: it can come out several times the targets' own sd, so that every test interval
covers and the test NLL is worse than a model-free Normal's. A structure that overcounts :math:`\gamma`
(``"diag"``; ``"kron"`` less so) does the same on a MAP that does not interpolate, leaving a few of the points to
σ and fitting it several times too large. ``"low_rank"`` counts at most ``rank``.

:func:`check_noise_fit` warns when fewer than :data:`NOISE_POINTS` of the observations are left:
at the Laplace fit (but for ``"diag"``), after ``optimize_prior_precision`` and after a sample-then-optimise run.
The remedy is the prior: a tighter weight prior (e.g. sd 0.3 rather than 1 on a small regression network) keeps
the MAP from interpolating and leaves most of the observations to σ, for every structure.
A last-layer Laplace cannot see an interpolating MAP: its γ counts the last layer only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import user_stacklevel

__all__ = [
    "DECIDING_ITERATIONS",
    "GAIN_THRESHOLD",
    "ITERATIONS",
    "NOISE_POINTS",
    "check_noise_fit",
    "gauss_newton_gain",
    "warn_not_map",
]

GAIN_THRESHOLD = 1.0  # nats: a Gauss-Newton step that would gain more than this means θ* is not a MAP
ITERATIONS = 3  # CG iterations at most (each one full-data GGN-vector product)
DECIDING_ITERATIONS = 12  # at most, where the upper bound is at hand: until a bound decides the verdict
NOISE_POINTS = 0.1  # the share of the observations that must be left (N - γ) to fit σ


def gauss_newton_gain(
    matvec: Callable[[Tensor], Tensor],
    gradient: Tensor,
    *,
    solve: Callable[[Tensor], Tensor] | None = None,
    start: Tensor | None = None,
    start_product: Tensor | None = None,
    iterations: int | None = None,
    floor_solve: Callable[[Tensor], Tensor] | None = None,
    threshold: float | None = None,
) -> float:
    r"""A lower bound on :math:`\tfrac12 b^\top H^{-1} b` (nats): the best :math:`q(s)` over CG's iterates.

    Args:
        matvec: :math:`v \mapsto H v` for a flat ``v``.
        gradient: :math:`b`, flat.
        solve: the preconditioner :math:`M^{-1} r` (an approximation of :math:`H^{-1}`); identity when ``None``.
        start: the first iterate (default 0); ``start_product`` its :math:`H s` where already computed.
        iterations: CG iterations at most (default :data:`ITERATIONS`; :data:`DECIDING_ITERATIONS` where both
            bounds are at hand); they stop early once the residual is below a millionth of :math:`b`'s.
        floor_solve: :math:`v \mapsto F^{-1} v` (on float64) for an :math:`F \preceq H` (the prior precision); with
            ``threshold`` the iterations stop once :math:`q(s) + \tfrac12 r^\top F^{-1} r`, an upper bound on the
            gain, is at most ``threshold`` (the verdict "not above the threshold" is then certain).
        threshold: after :data:`ITERATIONS`, the iterations also stop once the lower bound is above it (the verdict
            "above" is then certain; the first :data:`ITERATIONS` sharpen the bound the warning reports).

    Example:
        >>> import torch
        >>> H = torch.tensor([[2.0, 0.5], [0.5, 1.0]]); b = torch.tensor([1.0, -1.0])
        >>> exact = 0.5 * float(b @ torch.linalg.solve(H, b))
        >>> round(gauss_newton_gain(lambda v: H @ v, b, iterations=2), 5) == round(exact, 5)
        True
        >>> gauss_newton_gain(lambda v: H @ v, b, iterations=1) <= exact  # a lower bound after any iteration
        True

    """
    if iterations is None:
        iterations = DECIDING_ITERATIONS if floor_solve is not None and threshold is not None else ITERATIONS
    b = gradient.detach().double()
    apply = lambda v: matvec(v.to(gradient.dtype)).detach().double()  # noqa: E731
    precondition = (lambda r: solve(r.to(gradient.dtype)).detach().double()) if solve is not None else (lambda r: r)
    if start is None:
        s, residual = torch.zeros_like(b), b.clone()
    else:
        s = start.detach().double()
        residual = b - (start_product.detach().double() if start_product is not None else apply(s))
    best = 0.5 * float((b + residual) @ s)

    def decided(gain: float, residual: Tensor) -> bool:  # the upper bound shows the gain is not above threshold
        if floor_solve is None or threshold is None:
            return False
        return gain + 0.5 * float(residual @ floor_solve(residual).detach().double()) <= threshold

    if decided(best, residual):
        return best
    z = precondition(residual)
    direction, rz = z, residual @ z
    floor = 1e-6 * float(b.norm())
    for done in range(1, iterations + 1):
        if float(residual.norm()) <= floor or rz <= 0:
            break
        product = apply(direction)
        curvature = direction @ product
        if not torch.isfinite(curvature) or curvature <= 0:
            break
        alpha = rz / curvature
        s = s + alpha * direction
        residual = residual - alpha * product
        gain = 0.5 * float((b + residual) @ s)
        best = max(best, gain)
        if decided(best, residual) or (threshold is not None and best > threshold and done >= ITERATIONS):
            break  # settled: below by the upper bound, or above by the lower one after the usual iterations
        z = precondition(residual)
        rz_next = residual @ z
        direction, rz = z + (rz_next / rz) * direction, rz_next
    return best


def warn_not_map(gain: float, gradient_norm: float, consequence: str, *, threshold: float = GAIN_THRESHOLD) -> None:
    """The one warning of both engines when the linearisation point is not a MAP (``gain`` > ``threshold`` nats)."""
    if gain <= threshold:
        return
    warnings.warn(
        f"the linearisation point is not a MAP of the model: the gradient of the log joint there has norm "
        f"{gradient_norm:.3g} "
        f"and a Gauss-Newton step would gain at least {gain:.3g} nats. Train the MAP longer (or finish with full-batch "
        f"steps at a smaller learning rate). {consequence}",
        stacklevel=user_stacklevel(),
    )


def check_noise_fit(
    gamma: float,
    num_observations: int,
    sum_squares: float,
    noise: float,
    site: str | None,
    source: str,
    *,
    fitted_by: str | None = None,
) -> bool:
    """Warn when σ = ``noise`` has too few observations left to measure it (module docstring); whether it warned.

    ``source`` names what γ comes from (``"the 'kron' Laplace posterior"``); ``fitted_by`` what fitted σ
    (``"the evidence"``, ``"EM"``), ``None`` for the MAP's value.
    """
    left = num_observations - gamma
    if left >= NOISE_POINTS * num_observations:
        return False
    name = f"'{site}'" if site is not None else "σ"
    rms = math.sqrt(max(sum_squares, 0.0) / num_observations)
    what = f"{fitted_by} fitted the noise scale" if fitted_by else "the MAP's noise scale is"
    cause = (
        "Either the MAP interpolates the training data or the structure counts too many parameters ('diag', and "
        "less so 'kron', count more than the exact GGN; structure='full' measures γ exactly where it fits in memory)"
        if "Laplace" in source
        else "The MAP interpolates the training data"
    )
    warnings.warn(
        f"{what} {name} = {noise:.3g}, but {source} has γ = {gamma:.1f} effective parameters, which leave "
        f"N − γ = {left:.1f} of the N = {num_observations} observations to measure it (σ² ≈ RSS/(N − γ); the "
        f"residuals have rms {rms:.3g}). {cause}. Do not trust this "
        "σ or the predictive intervals built on it: retrain the MAP with a larger prior precision on the weights (a "
        "smaller prior sd) or a smaller network, until N − γ is most of N.",
        stacklevel=user_stacklevel(),
    )
    return True
