r"""The check of the filter's posterior against the full data, after its pass: is its mean the mode, its spread right.

A filter linearises each minibatch once, where the data seen before it left the mean; it never revisits them. Once
the pass is over, the full data can say how far that left it. With :math:`(m_0, \Lambda_0)` the Gaussian prior the
filter started from, :math:`E` the passes (``num_epochs``: the data counted :math:`E` times), :math:`m` and
:math:`\Sigma` the filter's result, and :math:`G` the exact full-data GGN at :math:`m`,

.. math::

    b = E\,\nabla\log p(D\mid m) - \Lambda_0 (m - m_0), \qquad H = E\,G + \Lambda_0, \qquad
    \lambda = \sqrt{b^\top H^{-1} b}.

:math:`s = H^{-1}b` is the Newton step to the mode of the (Gauss-Newton) posterior, and by Cauchy-Schwarz
:math:`|s_j| = |e_j^\top H^{-1} b| \le \sqrt{(H^{-1})_{jj}}\,\lambda`: **λ bounds every latent's distance from the
mode, in its marginal posterior sd**. The bound is loose where the latents are strongly correlated (a softmax's logits,
defined up to a constant: λ can be many times any latent's distance from the mode), so the warning reads the step
itself, :math:`\max_j |s_j|/\sqrt{\Sigma_{jj}}`, with :math:`s \approx \alpha\Sigma b`, conjugate gradients' first
iterate preconditioned by the filter's :math:`\Sigma` (:math:`\alpha = b^\top\Sigma b / b^\top\Sigma H\Sigma b`; exact
where :math:`\Sigma = H^{-1}`), and λ itself where the spread check finds :math:`\Sigma` off. λ comes from the MAP
check's conjugate gradients (:func:`~pyro_scalable.infer.linearized.map_check.gauss_newton_gain`, a lower bound on
:math:`\lambda^2/2`) continued from that iterate, stopped early by its upper bound through :math:`\Lambda_0^{-1}`.

**The spread**: with :math:`\Sigma = LL^\top` and :math:`V` orthonormal (``d x k``, :data:`PROBES` random directions;
the identity where :math:`d \le k`), the eigenvalues :math:`\mu` of :math:`(LV)^\top H (LV)` (Rayleigh-Ritz) lie
within those of :math:`L^\top H L`, which are all 1 where :math:`\Sigma = H^{-1}`; along the :math:`\mu`'s
eigenvector the filter's sd is :math:`\sqrt\mu` times the Laplace posterior's at :math:`m`. Where :math:`d \le k`
this is exact, and bounds every marginal's ratio.

The cost: a gradient pass, one batched GGN-vector pass (:math:`\Sigma b` and the :math:`k` probes) and at most
:data:`~pyro_scalable.infer.linearized.map_check.ITERATIONS` single GGN-vector passes. Where the step is above
:data:`MEAN_TOLERANCE` or a :math:`\sqrt\mu` is more than :data:`SPREAD_TOLERANCE` from 1, a warning gives the
figures and the remedy.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.checks import user_stacklevel
from pyro_scalable.infer.linearized.ggn import data_gradient
from pyro_scalable.infer.linearized.map_check import ITERATIONS, gauss_newton_gain
from pyro_scalable.infer.linearized.network import NetworkFunction

__all__ = ["MEAN_TOLERANCE", "PROBES", "SPREAD_TOLERANCE", "PosteriorCheck", "check_posterior", "warn_check"]

MEAN_TOLERANCE = 0.15  # posterior sds from the mode: a near-Gaussian posterior's mean is about 0.05 sd from it
SPREAD_TOLERANCE = 0.1  # an sd more than 10% off the Laplace posterior's at the mean is reported
PROBES = 16  # directions of the spread check (the whole space where d is at most this)


class PosteriorCheck(NamedTuple):
    """The check's figures (module docstring), in posterior sds and sd ratios."""

    mean_error: float  # the largest |s_j| / sqrt(Σ_jj)
    newton_step: float  # λ, a lower bound
    spread_low: float  # the smallest and largest sqrt(μ)
    spread_high: float
    probes: int
    num_params: int


def check_posterior(
    net: NetworkFunction,
    mean: Tensor,
    covariance: Tensor,
    prior_mean: Tensor,
    prior_precision: Tensor,
    *,
    epochs: int = 1,
    generator: torch.Generator | None = None,
) -> PosteriorCheck:
    """The figures of the module docstring for the filter's ``mean`` and ``covariance`` (``(d, d)`` or ``(d,)``)."""
    dense_prior = prior_precision.dim() == 2
    prior = prior_precision.double()
    prior_root = torch.linalg.cholesky(prior) if dense_prior else None

    def prior_times(v: Tensor) -> Tensor:  # v: (d,) or (k, d); the precision is symmetric
        return v.double() @ prior if dense_prior else prior * v.double()

    def matvec(vectors: Tensor) -> Tensor:
        with torch.no_grad():
            products = net.ggn_vp(mean, vectors.to(mean.dtype))
        return epochs * products.double() + prior_times(vectors)

    def solve(r: Tensor) -> Tensor:
        return covariance.to(r.dtype) @ r if covariance.dim() == 2 else covariance.to(r.dtype) * r

    def floor_solve(r: Tensor) -> Tensor:
        r = r.double()
        return torch.cholesky_solve(r[:, None], prior_root)[:, 0] if dense_prior else r / prior

    gradient = epochs * data_gradient(net, mean).double() - prior_times(mean - prior_mean)
    d = mean.numel()
    like = {"dtype": torch.float64, "device": mean.device}
    if d <= PROBES:
        probes = torch.eye(d, **like)
    else:
        probes = torch.linalg.qr(torch.randn(d, PROBES, generator=generator, **like)).Q
    root = torch.linalg.cholesky(covariance.double()) if covariance.dim() == 2 else covariance.double().sqrt()[:, None]
    directions = (root @ probes if covariance.dim() == 2 else root * probes).T  # (k, d)
    first = solve(gradient)  # the filter's own Newton step, Σb
    products = matvec(torch.cat([first[None], directions]))  # one batched pass: HΣb and the probes'
    # CG's first iterate: Σb scaled to the quadratic model's best, α = bᵀΣb / bᵀΣHΣb (its gain is αbᵀΣb/2)
    alpha = float(gradient @ first) / max(float(first @ products[0]), 1e-300)
    step = alpha * first
    sds = (covariance.diagonal() if covariance.dim() == 2 else covariance).double().sqrt()
    gain = gauss_newton_gain(
        lambda v: matvec(v[None])[0],
        gradient,
        solve=solve,
        start=step,
        start_product=alpha * products[0],
        iterations=ITERATIONS,
        floor_solve=floor_solve,
        threshold=0.5 * MEAN_TOLERANCE**2,
    )
    compressed = directions @ products[1:].T
    ratios = torch.linalg.eigvalsh(0.5 * (compressed + compressed.T)).clamp_min(0).sqrt()
    return PosteriorCheck(
        float((step.abs() / sds).max()),
        math.sqrt(2 * max(gain, 0.0)),
        float(ratios.min()),
        float(ratios.max()),
        probes.shape[1],
        d,
    )


def warn_check(check: PosteriorCheck, *, dense: bool, curvature: str, iterations: int, batch_size: int) -> bool:
    """Warn where the check's figures are off (module docstring), with the remedy; whether it warned."""
    if iterations == 1:
        remedies = "iterations=10 (Gauss-Newton steps to each minibatch's mode; now 1)"
    else:  # each minibatch's likelihood is approximated at its own mode: fewer minibatches, fewer approximations
        remedies = f"larger minibatches (the plate's subsample_size, now {batch_size})"
    if not dense:
        size = 8 * check.num_params**2 / 2**20
        remedies += ", covariance='dense'" + (f" ({size:.3g} MiB of float64 matrix)" if size >= 1 else "")
    remedies += ", or, for one data set, AutoLinearizedLaplace at the MAP or an SG-MCMC kernel"
    spread_off = not 1 / (1 + SPREAD_TOLERANCE) <= check.spread_low <= check.spread_high <= 1 + SPREAD_TOLERANCE
    # the per-latent figure reads the filter's own sds; where they are off, the step's length decides
    mean_off = check.mean_error > MEAN_TOLERANCE or (spread_off and check.newton_step > MEAN_TOLERANCE)
    if mean_off:
        warnings.warn(
            f"the EKF's mean is off the posterior's mode: a Newton step on the full data is {check.newton_step:.2g} "
            f"posterior sds long (at least; this bounds every latent's error in its marginal sd) and moves a latent "
            f"{check.mean_error:.2g} of its sds (above {MEAN_TOLERANCE}): the filter linearised its minibatches away "
            f"from the posterior. Use {remedies}.",
            stacklevel=user_stacklevel(),
        )
    if spread_off:
        where = "every direction" if check.probes == check.num_params else f"{check.probes} random directions"
        cause = "the filter took each minibatch's curvature where its mean then was"
        if not dense:
            cause += "; a diagonal covariance ignores the posterior's correlations"
        if curvature == "ef":
            cause += "; the empirical Fisher (curvature='ef') is the curvature only near the mode"
        warnings.warn(
            f"the EKF's sds are off: checked along {where} of the latents, its sd is {check.spread_low:.2f} to "
            f"{check.spread_high:.2f} times the Laplace posterior's at its mean (the full-data GGN and the prior), "
            f"more than {SPREAD_TOLERANCE:.0%} off: {cause}. Use {remedies}.",
            stacklevel=user_stacklevel(),
        )
    return mean_off or spread_off
