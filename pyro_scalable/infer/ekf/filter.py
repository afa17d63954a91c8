r"""The iterated extended Kalman filter's update on one minibatch: pure functions over a Gaussian state.

The state is :math:`\mathcal N(m, \Sigma)` over the flat unconstrained latents, :math:`\Sigma` dense (``d x d``,
float64) or diagonal (``d``). For a minibatch :math:`B` with log-likelihood :math:`\ell_B`, the filter predicts
:math:`\Sigma \leftarrow \Sigma + q^2 I` (``transition_sd=q``; 0: the latents do not drift), then finds the mode of
:math:`\varphi(\theta) = \ell_B(\theta) - \tfrac12 (\theta-m)^\top\Sigma^{-1}(\theta-m)` by Gauss-Newton steps (the
iterated EKF: Bell & Cathey 1993, "The iterated Kalman filter update as a Gauss-Newton method"), from
:math:`\theta_0 = m`:

.. math::

    A_k = \Sigma^{-1} + G(\theta_k), \qquad
    s_k = A_k^{-1}\big(\nabla\ell_B(\theta_k) - \Sigma^{-1}(\theta_k - m)\big), \qquad \theta_{k+1} = \theta_k + s_k,

with :math:`G = R^\top R` the minibatch's GGN, :math:`R` its rows :math:`J_i^\top L_i e_c` (``curvature="ggn"``:
the Kalman filter's own), or its empirical Fisher, :math:`R` the per-example scores (``"ef"``); the diagonal
filter keeps :math:`\mathrm{diag}\,G`. The iterations stop once the step is short, :math:`\sqrt{s_k^\top A_k s_k}`
(its length in posterior sds) at most ``tolerance``, or after ``iterations`` evaluations; then
:math:`m \leftarrow \theta_k + s_k`, :math:`\Sigma \leftarrow A_k^{-1}`. A step that lowers :math:`\varphi` is
halved (each try counts as an iteration): far from the data's fit a full Gauss-Newton step can overshoot (a
Poisson's exponential rate).

The dense update never inverts a ``d x d`` matrix where :math:`R` has :math:`k < d` rows: Woodbury gives
:math:`A_k^{-1} = \Sigma - W^\top W` with :math:`W = C^{-1} R\Sigma`, :math:`CC^\top = I + R\Sigma R^\top`
(:math:`2d^2k` flops: the Kalman gain's form), and :math:`\Sigma^{-1}(\theta_k - m)` is carried along the
iterations (:math:`\Sigma^{-1}s_k = r_k - G s_k`) rather than solved for.

One iteration is the plain EKF, which Ollivier (2018, "Online natural gradient as a Kalman filter") shows to be
online natural-gradient descent: it linearises each minibatch at the mean it arrives at, and on a model whose
posterior mean lies far from the prior's (many sds of a posterior that narrows like :math:`1/\sqrt N`) the first
minibatches' linearisation is never revisited. Iterating linearises each minibatch at its own posterior mode. For a
model linear in its latents with a Normal likelihood, the dense filter is the Kalman filter and exact in one step
(the second evaluation finds a zero step and stops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["BatchTerms", "EKFInfo", "EKFState", "init", "update"]


class EKFState(NamedTuple):
    """Everything the next minibatch's update needs. Every field is a tensor."""

    mean: Tensor  # (d,), the model's dtype
    covariance: Tensor  # (d, d) float64 (dense) or the variances (d,)
    step_count: Tensor  # 0-d int64: the minibatches seen


class EKFInfo(NamedTuple):
    """What one update did: its evaluations of the minibatch, and the last step's length in posterior sds."""

    iterations: Tensor  # 0-d int64
    step: Tensor  # 0-d: sqrt(s^T A s) of the last Gauss-Newton step
    log_likelihood: Tensor  # 0-d: the minibatch's log-likelihood at the last accepted point


class BatchTerms(NamedTuple):
    r"""The minibatch at one point: its log-likelihood, its gradient, and its curvature's rows or diagonal.

    ``curvature``: the rows :math:`R` ``(k, d)`` float64 of :math:`G = R^\top R` (the dense filter), or
    :math:`\mathrm{diag}\,G` ``(d,)`` (the diagonal one).
    """

    log_likelihood: Tensor
    gradient: Tensor
    curvature: Tensor


def init(mean: Tensor, covariance: Tensor) -> EKFState:
    """The state at the prior: its mean and covariance (``(d, d)``: the dense filter; ``(d,)``: the diagonal)."""
    return EKFState(mean.detach(), covariance.detach(), torch.zeros((), dtype=torch.long, device=mean.device))


def update(
    state: EKFState,
    evaluate: Callable[[Tensor], BatchTerms],
    *,
    transition_sd: float = 0.0,
    iterations: int = 10,
    tolerance: float = 0.01,
) -> tuple[EKFState, EKFInfo]:
    """Filter one minibatch, whose log-likelihood ``evaluate(theta)`` gives with its gradient and curvature."""
    covariance = state.covariance
    if transition_sd:
        noise = transition_sd**2
        covariance = covariance + (
            noise if covariance.dim() == 1 else noise * torch.eye(covariance.shape[0]).to(covariance)
        )
    mean = state.mean
    offset = torch.zeros_like(mean, dtype=torch.float64)  # δ = θ - m
    pulled = torch.zeros_like(offset)  # Σ^{-1} δ
    terms = evaluate(mean)
    objective = terms.log_likelihood.double()
    step, pulled_step, posterior, size = _step(covariance, terms, pulled)
    used = 1
    while used < iterations and size > tolerance:
        moved, moved_pulled = offset + step, pulled + pulled_step
        at = evaluate(mean + moved.to(mean.dtype))
        used += 1
        value = at.log_likelihood.double() - 0.5 * (moved * moved_pulled).sum()
        # rounding of the log-likelihood's sum: a step this small is not worse, only unmeasured
        if bool(value >= objective - 1e-9 * (1 + objective.abs())):
            offset, pulled, terms, objective = moved, moved_pulled, at, value
            step, pulled_step, posterior, size = _step(covariance, terms, pulled)
        else:
            step, pulled_step, size = step / 2, pulled_step / 2, size / 2
    info = EKFInfo(
        torch.tensor(used, device=mean.device),
        torch.tensor(size, dtype=torch.float64, device=mean.device),
        terms.log_likelihood,
    )
    return EKFState((mean + (offset + step).to(mean.dtype)).detach(), posterior(), state.step_count + 1), info


def _step(covariance: Tensor, terms: BatchTerms, pulled: Tensor) -> tuple[Tensor, Tensor, Callable[[], Tensor], float]:
    r"""The Gauss-Newton step :math:`s = A^{-1}r`, :math:`\Sigma^{-1}s`, :math:`A^{-1}` on demand, the step's length."""
    residual = terms.gradient.double() - pulled
    solve, posterior = _posterior(covariance, terms.curvature)
    step = solve(residual)
    pulled_step = residual - _curvature_times(terms.curvature, step)  # A s = r, so Σ^{-1} s = r - G s
    return step, pulled_step, posterior, float((residual * step).sum().clamp_min(0).sqrt())


def _posterior(covariance: Tensor, curvature: Tensor) -> tuple[Callable[[Tensor], Tensor], Callable[[], Tensor]]:
    r""":math:`v \mapsto A^{-1}v` and :math:`A^{-1} = (\Sigma^{-1} + G)^{-1}` itself (only the last iteration's).

    By Woodbury where the rows are fewer than ``d``, else through the precision.
    """
    if covariance.dim() == 1:
        posterior = (covariance.reciprocal() + curvature.to(covariance.dtype)).reciprocal()
        return (lambda v: posterior * v), (lambda: posterior)
    rows = curvature.to(covariance.dtype)
    k, d = rows.shape
    if k >= d:
        precision = torch.cholesky_inverse(_cholesky(covariance)) + rows.T @ rows
        factor = _cholesky(precision)
        return (lambda v: torch.cholesky_solve(v[:, None], factor)[:, 0]), (lambda: torch.cholesky_inverse(factor))
    gain = covariance @ rows.T  # Σ Rᵀ, (d, k)
    capacitance = rows @ gain
    capacitance.diagonal().add_(1.0)
    factor = _cholesky(capacitance)

    def solve(v: Tensor) -> Tensor:
        return covariance @ v - gain @ torch.cholesky_solve((gain.T @ v)[:, None], factor)[:, 0]

    def posterior() -> Tensor:
        whitened = torch.linalg.solve_triangular(factor, gain.T, upper=False)  # C^{-1} R Σ
        matrix = covariance - whitened.T @ whitened
        return 0.5 * (matrix + matrix.T)  # the subtraction's rounding is not symmetric

    return solve, posterior


def _curvature_times(curvature: Tensor, vector: Tensor) -> Tensor:
    if curvature.dim() == 1:
        return curvature.double() * vector
    rows = curvature.to(vector.dtype)
    return rows.T @ (rows @ vector)


def _cholesky(matrix: Tensor) -> Tensor:
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) > 0:
        raise FloatingPointError(
            "the EKF's covariance lost positive definiteness (rounding in a badly conditioned posterior); "
            "run the model in float64 or use covariance='diagonal'."
        )
    return factor
