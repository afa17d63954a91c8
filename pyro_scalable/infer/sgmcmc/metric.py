r"""Warm-up's metric: the posterior's scale and correlations learnt from the chains, as an affine change of variables.

A stochastic-gradient sampler's step is bounded by the stiffest direction of the posterior (warm-up's curvature
bound, :mod:`.tuning`), so a posterior whose sds differ by a factor :math:`\sqrt\kappa` needs about
:math:`\sqrt\kappa` (momentum samplers) to :math:`\kappa` (Langevin) steps per independent draw in its widest
direction. NUTS adapts a mass matrix for this; here warm-up learns the same thing for every kernel at once, as a
change of variables. With :math:`\hat\mu` and :math:`\hat\Sigma = LL^\top` the mean and covariance of the chains'
positions over a window of warm-up (pooled over chains and steps), the kernels run on

.. math::

    z = L^{-1}(\theta - \hat\mu), \qquad \log\tilde p(z) = \log p(\hat\mu + Lz) + \log\lvert\det L\rvert,

whose covariance is about the identity: every direction is as stiff as every other, and warm-up's step size,
friction and noise correction, measured again in :math:`z`, fit them all. Every gradient, per-example gradient
(the noise estimate) and Hessian-vector product in :math:`z` is :math:`L^\top` times the one in :math:`\theta`, so
the calibration arguments of :mod:`.base` and :mod:`.tuning` hold unchanged; the draws are mapped back,
:math:`\theta = \hat\mu + Lz`. For a kernel with a diagonal mass :math:`M` this is the same as running it in
:math:`\theta` with the (dense) mass :math:`M' = L^{-\top} M L^{-1}`, i.e. :math:`\hat\Sigma^{-1}` for unit
:math:`M`: HMC's choice (Neal 2011, §4.1); for SGLD, the preconditioner :math:`\hat\Sigma`.

**Schedule** (Stan's windowed adaptation, in stages): warm-up runs in stages ending at
:data:`STAGES` of ``num_warmup``; each stage is a full warm-up of its own (burn-in, then calibrated steps in the
current metric), and its calibrated half's positions (pooled over chains, mean :math:`\hat\mu`, covariance
:math:`S`) give the next stage's metric. The last stage chooses the step size that sampling keeps.

**Dense metrics come from the curvature, bounded by the positions.** A stochastic-gradient chain moves by a random walk,
so in a window of a few hundred steps chains that have not yet mixed explore a fraction of the posterior's slow
directions — the ones the metric is for — and :math:`S` is too narrow there, on a hierarchy by orders of magnitude in
variance. So a dense stage takes the Hessian :math:`H = V\,\mathrm{diag}(h)\,V^\top` of the negative log joint at
:math:`\hat\mu` (a large minibatch) and uses

.. math::

    \hat\Sigma = V\,\mathrm{diag}(1/h'_k)\,V^\top, \qquad
    h'_k = \max\big(\lvert h_k\rvert,\ 1 / (C\, v_k^\top S v_k)\big), \qquad C = 100
    \ (:data:`SPREAD_LIMIT`):

the inverse Hessian (exact for a Gaussian posterior, whatever the chains explored) wherever it is at most :math:`C`
times wider than the window's spread; a flat or negative-curvature direction (a funnel's neck, a saddle) is bounded by
the positions instead of made arbitrarily wide. Where that inverse is not positive definite to the precision of a float
(a funnel's neck, where the curvature in a hierarchy's log scale grows without bound), the stage takes the window's
pooled covariance instead. ``metric="dense"`` does this at every stage; ``"diagonal"`` uses the diagonal of :math:`S`
(Stan's regularisation towards a small multiple of the identity); ``"auto"`` is dense up to :data:`DENSE_LIMIT`
unconstrained dimensions, diagonal otherwise, and is on only where warm-up chooses the step size and has at least
:data:`LEAST_WARMUP` steps, and only where the first metric's condition number reaches :data:`WORTHWHILE`: on a
well-conditioned posterior warm-up then goes on exactly as without a metric (the first stage is the whole warm-up's
first part; nothing random is drawn for the metric). The threshold is low: a posterior only moderately ill-conditioned,
sampled without a metric, can come out with its sds too small at any length (a bias of the step, not a lack of draws).
It is not zero: on a well-conditioned posterior a metric learnt from a short window only adds that window's error, and a
control variate centred at warm-up's means then loses much of its larger step (more than 3 times the plain run's without
a metric on a well-conditioned regression: ``tests/infer/sgmcmc/test_control_variates.py``). The Hessian is the metric
at every stage, rather than the pooled positions after the first: on a partial-pooling regression the positions of a
short window give a metric far from the posterior's scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.infer.full_data import point_hessian
from pyro_scalable.infer.gradients.whitened import AffineMap, WhitenedDensity
from pyro_scalable.infer.linearized.layout import ParameterLayout

__all__ = ["MetricSchedule", "check_metric"]

CHOICES = ("auto", "unit", "diagonal", "dense")
STAGES = (0.15, 0.3, 0.55)  # warm-up's metric changes after these shares of num_warmup
DENSE_LIMIT = 100
LEAST_WARMUP = 200
WORTHWHILE = 3.0  # "auto" keeps the unit metric where the first one's condition number is below this
SPREAD_LIMIT = 100.0  # a dense metric's variance along a Hessian eigenvector is at most this × the window's spread
_SHRINK = 5.0  # Stan's regularisation: (n / (n + 5)) S + (5 / (n + 5)) 1e-3 (here relative to the mean variance)


def check_metric(metric: str) -> str:
    """Validate the driver's ``metric=`` option."""
    if metric not in CHOICES:
        raise ValueError(f"metric must be one of {CHOICES}, got {metric!r}.")
    return metric


class MetricSchedule:
    """The driver's side: stage boundaries, the window's pooled moments, and the map of the stage running now."""

    def __init__(self, kind: str, num_warmup: int, latents: Latents):
        self.layout = ParameterLayout({name: x.shape[1:] for name, x in latents.items()})
        self.num_warmup = num_warmup
        self.ends = sorted({max(1, int(round(share * num_warmup))) for share in STAGES})
        self.kind = kind
        self.stage = 0
        self.affine: AffineMap | None = None
        self.window_mean: Tensor | None = None  # the last window's mean (next_map), where "warmup" recentres
        self._reset()

    @classmethod
    def for_run(cls, metric: str, kernel: Any, num_warmup: int, latents: Latents) -> MetricSchedule | None:
        """The schedule ``metric`` asks for, or ``None`` (``"unit"``, a given step size, a short warm-up)."""
        if metric == "unit" or kernel.step_size is not None or not kernel.adapts:
            return None
        if metric == "auto" and num_warmup < LEAST_WARMUP:
            return None
        return cls(metric, num_warmup, latents)

    def stage_start(self) -> int:
        """The step the running stage began at."""
        return 0 if self.stage == 0 else self.ends[self.stage - 1]

    def stage_length(self, stage: int) -> int:
        start = 0 if stage == 0 else self.ends[stage - 1]
        return (self.ends[stage] if stage < len(self.ends) else self.num_warmup) - start

    def _reset(self) -> None:
        self.count = 0
        self.total: Tensor | float = 0.0
        self.outer: Tensor | float = 0.0

    def in_window(self, step: int) -> bool:
        """Whether ``step`` is in the calibrated half of the running stage (the last stage's too)."""
        return step - self.stage_start() >= self.stage_length(self.stage) // 2

    def observe(self, step: int, theta: Latents) -> None:
        """Add the chains' positions (θ, chain dim first) of a step in the calibrated half of the running stage.

        Kept per chain, so that :meth:`next_map` can pool the chains that reached the bulk and leave out a straggler
        (:mod:`.stragglers`).
        """
        if self.stage >= len(self.ends) or not self.in_window(step):
            return
        flat = self.layout.flatten(theta, batch_dims=1).detach().double()
        self.count += 1
        self.total = self.total + flat
        dense = self.kind == "dense" or (self.kind == "auto" and self.layout.num_params <= DENSE_LIMIT)
        self.outer = self.outer + (flat[:, :, None] * flat[:, None, :] if dense else flat.square())

    def hessian(self, log_posterior_fn: Callable, batch: Batch) -> Callable[[Tensor], Tensor]:
        """The Hessian of ``-log_posterior_fn`` on ``batch`` (θ-space) at a flat point, for :meth:`next_map`."""

        def negative(flat: Tensor) -> Tensor:
            return -log_posterior_fn(self.layout.unflatten(flat), batch)

        return lambda flat: point_hessian(negative, flat)

    def due(self, step: int) -> bool:
        """Whether the running stage ends after ``step``."""
        return self.stage < len(self.ends) and step + 1 == self.ends[self.stage]

    def next_map(
        self, like: Tensor, hessian: Callable[[Tensor], Tensor] | None = None, keep: Tensor | None = None
    ) -> AffineMap | None:
        """The window's metric (then the next stage runs in it); moments reset.

        ``keep``: the chains whose positions are pooled (default all; :mod:`.stragglers` leaves out chains behind).

        A dense metric, where ``hessian`` (of the negative log density, at a flat θ) is given, is the inverse
        Hessian at the window's mean with each eigenvalue floored by the window's spread along its eigenvector
        (module docstring): chains that have not mixed within the window have not explored its slow directions,
        which the metric is for, while a flat or saddle direction of the Hessian is bounded by the positions.
        Without it (or a diagonal metric), the window's pooled covariance.
        """
        total, outer = self.total, self.outer
        if keep is not None:
            total, outer = total[keep.to(total.device)], outer[keep.to(total.device)]
        n = self.count * total.shape[0]
        total, outer = total.sum(0), outer.sum(0)
        mean = total / n
        self.window_mean = mean.to(like)
        if outer.dim() == 2:
            covariance = (outer - n * torch.outer(mean, mean)) / max(n - 1, 1)
        else:
            covariance = (outer - n * mean.square()) / max(n - 1, 1)
        variances = covariance.diagonal() if covariance.dim() == 2 else covariance
        floor = 1e-3 * variances.clamp(min=0).mean().clamp(min=1e-30)
        weight = n / (n + _SHRINK)
        if covariance.dim() == 2:
            covariance = weight * covariance + (1 - weight) * floor * torch.eye(
                len(mean), dtype=mean.dtype, device=mean.device
            )
        if covariance.dim() == 2 and hessian is not None:
            values, vectors = torch.linalg.eigh(hessian(self.window_mean).double())
            spread = ((covariance @ vectors) * vectors).sum(0)  # the window's variance along each eigenvector
            values = torch.maximum(values.abs(), 1.0 / (SPREAD_LIMIT * spread))
            if self.stage == 0 and self.kind == "auto" and float(values.max() / values.min()) < WORTHWHILE:
                return self._stop()
            inverse = (vectors / values) @ vectors.T
            scale, failed = torch.linalg.cholesky_ex(0.5 * (inverse + inverse.T))
            if not bool(failed):
                return self._advance(scale.to(like))
            # not positive definite to a float's precision: the window's pooled covariance, as without a Hessian
        use_dense = covariance.dim() == 2 and (self.kind == "dense" or n >= 10 * self.layout.num_params)
        if use_dense:
            scale = torch.linalg.cholesky(covariance)
        else:
            scale = torch.sqrt(weight * variances.clamp(min=0) + (1 - weight) * floor)
        if self.stage == 0 and self.kind == "auto" and not use_dense:
            spread = scale.square()
            if float(spread.max() / spread.min()) < WORTHWHILE:
                return self._stop()
        return self._advance(scale.to(like))

    def _advance(self, scale: Tensor) -> AffineMap:
        """The next stage runs in θ = window mean + scale z; its window starts empty."""
        self.stage += 1
        self._reset()
        self.affine = AffineMap(self.window_mean, scale)
        return self.affine

    def _stop(self) -> None:
        """No metric after all (``"auto"`` on a well-conditioned posterior): warm-up goes on as if it had none."""
        self.ends = []
        self._reset()
        return None

    def to_theta(self, latents: Latents) -> Latents:
        """The chains' unconstrained latents from the running stage's z (as they are in the unit metric)."""
        if self.affine is None:
            return latents
        return self.layout.unflatten(self.affine.to_theta(self.layout.flatten(latents, batch_dims=1)))

    def to_z(self, latents: Latents) -> Latents:
        """The running stage's z of the chains' unconstrained latents."""
        if self.affine is None:
            return latents
        return self.layout.unflatten(self.affine.to_z(self.layout.flatten(latents, batch_dims=1)))

    def wrap(self, log_posterior_fn: Callable) -> Callable:
        """``log_posterior_fn`` in the running stage's z."""
        if self.affine is None:
            return log_posterior_fn
        return WhitenedDensity(log_posterior_fn, self.layout, self.affine)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the stage, its map and the window's moments so far (references: cheap)."""
        affine = None if self.affine is None else {"mean": self.affine.mean, "scale": self.affine.scale}
        return {
            "stage": self.stage,
            "ends": list(self.ends),
            "affine": affine,
            "count": self.count,
            "total": self.total,
            "outer": self.outer,
        }

    def load_state_dict(self, state: dict[str, Any], device: Any) -> None:
        """Go on in the checkpointed stage, with its window's moments."""
        self.stage, self.count, self.total, self.outer = state["stage"], state["count"], state["total"], state["outer"]
        self.ends = list(state["ends"])
        affine = state["affine"]
        self.affine = None if affine is None else AffineMap(affine["mean"].to(device), affine["scale"].to(device))
