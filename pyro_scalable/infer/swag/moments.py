r"""SWAG's Gaussian from the snapshots of constant-step SGD (Maddox, Izmailov, Garipov, Vetrov & Wilson 2019).

Run SGD with momentum at a constant (or cyclical) step on minibatches from a trained point and take a snapshot
:math:`\theta_1, \dots, \theta_T` of the flat unconstrained parameters every so many steps (by default once per
epoch). SWAG keeps, per run, the first and second moments and the last :math:`K` snapshots:

.. math::

    \bar\theta = \frac1T\sum_t \theta_t, \qquad
    \sigma^2 = \frac1T\sum_t (\theta_t - \bar\theta)^2, \qquad
    D = [\theta_{T-K+1} - \bar\theta, \dots, \theta_T - \bar\theta] \in \mathbb R^{d\times K},

and approximates the posterior by :math:`\mathcal N(\bar\theta, \Sigma)` with

* ``covariance="diagonal"`` (SWAG-Diagonal): :math:`\Sigma = \mathrm{diag}(\sigma^2)`;
* ``covariance="low_rank"`` (SWAG): :math:`\Sigma = \tfrac12\,\mathrm{diag}(\sigma^2) + \tfrac{1}{2(K-1)} D D^\top`.

A draw is :math:`\bar\theta + \tfrac{1}{\sqrt2}\sigma\odot z_1 + \tfrac{1}{\sqrt{2(K-1)}} D z_2` with
:math:`z_1 \sim \mathcal N(0, I_d)`, :math:`z_2 \sim \mathcal N(0, I_K)`: :math:`O(Kd)` per draw, no
:math:`d\times d` matrix. The moments are accumulated online (Welford, in float64), so a run holds
:math:`2d` float64s and :math:`Kd` parameters per run, whatever the number of snapshots.

The deviations are taken from the final mean :math:`\bar\theta`, so that :math:`DD^\top/(K-1)` is the sample
covariance of the last :math:`K` snapshots (the paper subtracts the running mean at each snapshot, which biases
the early columns toward the start point; with the final mean, on a quadratic the estimate is unbiased for the
stationary covariance of the SGD iterates up to their autocorrelation, which the tests check against the closed
form).

**MultiSWAG** (Wilson & Izmailov 2020) is :math:`R` independent runs, one Gaussian each, and the posterior is their
equal-weight mixture; draws are spread evenly over the runs (draw ``s`` from run ``s mod R``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["MomentAccumulator", "SWAGMoments", "covariance_factors", "dense_covariance", "sample_flat"]


class SWAGMoments(NamedTuple):
    """Per run: the mean ``(R, d)``, the diagonal variance ``(R, d)``, the deviations ``(R, K, d)``, snapshots."""

    mean: Tensor
    variance: Tensor
    deviations: Tensor
    num_snapshots: int


class MomentAccumulator:
    """Running mean and variance (Welford, float64) and a ring buffer of the last ``rank`` snapshots, per run."""

    def __init__(self, like: Tensor, rank: int):
        runs, d = like.shape
        self.count = 0
        self.rank = rank
        self.mean = torch.zeros(runs, d, dtype=torch.float64, device=like.device)
        self.squares = torch.zeros_like(self.mean)  # sum of squared deviations from the running mean
        self.buffer = torch.zeros(runs, rank, d, dtype=like.dtype, device=like.device)

    def add(self, theta: Tensor) -> None:
        """One snapshot ``(R, d)`` of every run."""
        self.buffer[:, self.count % self.rank].copy_(theta)
        self.count += 1
        delta = theta.double() - self.mean
        self.mean.add_(delta / self.count)
        self.squares.add_(delta * (theta.double() - self.mean))

    def state(self) -> dict[str, Tensor | int]:
        return {"count": self.count, "mean": self.mean, "squares": self.squares, "buffer": self.buffer}

    def load(self, state: dict) -> None:
        self.count = int(state["count"])
        self.mean.copy_(state["mean"])
        self.squares.copy_(state["squares"])
        self.buffer.copy_(state["buffer"])

    def finish(self) -> SWAGMoments:
        """The moments so far (at least two snapshots): deviations of the last ``min(count, rank)`` snapshots."""
        if self.count < 2:
            raise ValueError(f"SWAG needs at least 2 snapshots to estimate a covariance; it has {self.count}.")
        kept = min(self.count, self.rank)
        order = [(self.count - kept + j) % self.rank for j in range(kept)]  # oldest first
        mean = self.mean.to(self.buffer.dtype)
        deviations = self.buffer[:, order] - mean.unsqueeze(1)
        variance = (self.squares / self.count).clamp_min(0.0).to(self.buffer.dtype)
        return SWAGMoments(mean, variance, deviations, self.count)


def sample_flat(
    moments: SWAGMoments, num_samples: int, covariance: str, generator: torch.Generator | None = None
) -> Tensor:
    """``num_samples`` flat draws ``(S, d)`` of the SWAG Gaussian (a mixture: draw ``s`` from run ``s mod R``)."""
    mean, variance, deviations = moments.mean, moments.variance, moments.deviations
    runs, d = mean.shape
    run = torch.arange(num_samples, device=mean.device) % runs
    like = {"dtype": mean.dtype, "device": mean.device, "generator": generator}
    z = torch.randn(num_samples, d, **like)
    if covariance == "diagonal":
        return mean[run] + variance[run].sqrt() * z
    k = deviations.shape[1]
    low = torch.randn(num_samples, k, **like)
    spread = torch.einsum("sk,skd->sd", low, deviations[run]) / (2 * (k - 1)) ** 0.5
    return mean[run] + (variance[run] / 2).sqrt() * z + spread


def covariance_factors(moments: SWAGMoments, covariance: str, run: int = 0) -> tuple[Tensor, Tensor]:
    r"""One run's SWAG covariance as :math:`\mathrm{diag}(D) + AA^\top`: ``D`` ``(d,)`` and ``A`` ``(d, K)``.

    ``covariance="diagonal"``: ``A`` is ``(d, 0)``.
    """
    variance, deviations = moments.variance[run], moments.deviations[run]
    if covariance == "diagonal":
        return variance, deviations.new_zeros(variance.shape[0], 0)
    return 0.5 * variance, deviations.T / math.sqrt(2 * (deviations.shape[0] - 1))


def dense_covariance(moments: SWAGMoments, covariance: str, run: int = 0) -> Tensor:
    """One run's SWAG covariance as a ``(d, d)`` matrix (for small models and tests)."""
    diagonal, factor = covariance_factors(moments, covariance, run)
    return torch.diag(diagonal) + factor @ factor.T
