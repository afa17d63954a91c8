r"""Maximising the Laplace evidence over the prior precision (and a Normal's noise scale) by L-BFGS.

The evidence :math:`\log Z(P, \sigma)` (:mod:`~pyro_scalable.infer.laplace.posterior`) is smooth in
:math:`\log P` and :math:`\log\sigma`; the precision is tied within groups (one for all parameters, one per
Laplace site, or one per parameter), each group starting at the mean of its current log precisions. L-BFGS with a
strong-Wolfe line search handles a trial step that overflows (the evidence skips its argument checks then), or
whose :math:`H` cannot be factorised (an infinite loss there, so the search steps back).

When σ cannot be fitted (too few observations left beyond the effective parameters), the fit says so:
:func:`~pyro_scalable.infer.linearized.map_check.check_noise_fit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, Self

import torch
from torch import Tensor

from pyro_scalable.arguments import check_choice, check_count, check_flag, check_number, check_tensor
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.laplace.curvature import CurvatureError
from pyro_scalable.infer.linearized.map_check import check_noise_fit

__all__ = ["LaplaceEvidence", "maximize_evidence", "prior_times"]


def maximize_evidence(
    log_evidence: Callable[[Tensor, Tensor | None], Tensor],
    groups: Tensor,
    prior_precision: Tensor,
    noise: Tensor | None,
    *,
    max_iter: int,
) -> tuple[Tensor, Tensor | None]:
    """The prior precision (tied within ``groups``) and noise (when given) that maximise ``log_evidence``."""
    counts = torch.bincount(groups).to(prior_precision.dtype)
    start = torch.zeros(counts.shape, dtype=prior_precision.dtype, device=prior_precision.device)
    start = start.index_add(0, groups, prior_precision.log()) / counts
    log_precision = start.clone().requires_grad_(True)
    variables = [log_precision]
    log_noise = None
    if noise is not None:
        log_noise = noise.log().clone().requires_grad_(True)
        variables.append(log_noise)
    optimizer = torch.optim.LBFGS(
        variables, max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12
    )

    def closure():
        optimizer.zero_grad()
        try:
            loss = -log_evidence(log_precision[groups].exp(), log_noise.exp() if log_noise is not None else None)
        except (torch.linalg.LinAlgError, CurvatureError):
            # a trial step so far out that H cannot be factorised: an infinite loss, which the line search shrinks
            return torch.full((), float("inf"), dtype=start.dtype, device=start.device)
        loss.backward()
        return loss

    optimizer.step(closure)
    return log_precision.detach()[groups].exp(), None if log_noise is None else log_noise.detach().exp()


class LaplaceEvidence:
    """The evidence part of :class:`~pyro_scalable.infer.laplace.posterior.LaplacePosterior`, a mixin of it.

    The closed form (:mod:`~pyro_scalable.infer.laplace.posterior`'s docstring), its maximisation over the prior
    precision and a Normal's σ, and the effective number of parameters; it reads the posterior's fit, prior and
    precision.
    """

    def log_marginal_likelihood(
        self, prior_precision: Tensor | float | None = None, observation_noise: Tensor | float | None = None
    ) -> Tensor:
        r"""The Laplace evidence :math:`\log Z(P, \sigma)` of the linearised model (differentiable)."""
        theta = self.theta_star
        if prior_precision is not None and not _traced(prior_precision):
            check_tensor("prior_precision", prior_precision, positive=True, shape=theta.shape)
        if observation_noise is not None and not _traced(observation_noise):
            check_number("observation_noise", observation_noise, positive=True)
        precision = self._prior_precision if prior_precision is None else prior_precision
        if not isinstance(precision, Tensor) or precision.dim() != 2:
            precision = torch.as_tensor(precision, dtype=theta.dtype, device=theta.device)
            precision = torch.broadcast_to(precision, theta.shape)
        noise = (
            self._observation_noise
            if observation_noise is None
            else torch.as_tensor(observation_noise, dtype=theta.dtype, device=theta.device)
        )
        if observation_noise is not None and self._map_noise is None:
            raise ModelError("observation_noise applies to a Normal likelihood with one scalar scale only.")
        if noise is not None:
            n = self.fit.num_observations
            log_likelihood = -0.5 * n * torch.log(2 * math.pi * noise**2) - 0.5 * self.fit.sum_squares / noise**2
        else:
            log_likelihood = self.fit.log_likelihood
        own = prior_precision is None and observation_noise is None  # the posterior's: its cached factorisation
        H = self.precision if own else self._precision(precision, noise)
        r = theta - self.prior_mean
        evidence = log_likelihood - 0.5 * (r * prior_times(precision, r)).sum() + 0.5 * _prior_logdet(precision)
        evidence = evidence - 0.5 * H.logdet()
        if self.recenter:
            b = self._log_joint_gradient(precision, noise)
            evidence = evidence + 0.5 * (b * H.solve(b)).sum()
        return evidence

    def optimize_prior_precision(
        self,
        method: Literal["scalar", "site", "diagonal"] = "scalar",
        *,
        observation_noise: bool | None = None,
        max_iter: int = 200,
        em_steps: int = 8,
    ) -> Self:
        """Maximise the evidence over the prior precision (and σ of a Normal likelihood) by L-BFGS.

        With ``structure="sampled"`` there is no evidence: ``em_steps`` MacKay updates from the samples instead
        (``"scalar"`` or ``"site"``; σ stays fixed), re-running the sampler with warm starts.

        Args:
            method: one precision for every parameter, one per Laplace site, or one per parameter.
            observation_noise: also fit σ (default: whenever the likelihood is a Normal with one scalar scale).

        """
        check_choice("method", method, ("scalar", "site", "diagonal"))
        check_flag("observation_noise", observation_noise, optional=True)
        check_count("max_iter", max_iter)
        check_count("em_steps", em_steps, 0)
        if self._prior_precision.dim() == 2:
            raise ModelError(
                "the prior is a previous posterior (as_prior): its precision is the last episode's, not a "
                "hyper-parameter to tune. Tune the prior precision in the first episode."
            )
        if not self._structure.has_evidence:
            curvature = self.fit.curvature.tune_prior(method, observation_noise, em_steps, self._prior_precision)
            self.fit = self.fit.with_curvature(curvature)
            self.prior_precision = curvature.prior_precision
            return self
        theta = self.theta_star
        if method == "diagonal" and not self._structure.per_parameter_prior:
            raise ValueError(
                "structure='kron' keeps a layer's prior precision equal across its outputs; use method='scalar' or "
                "'site', or structure='diag'/'full' for a per-parameter prior precision."
            )
        groups, _ = self.net.layout.groups(method, theta.device)
        fit_noise = self._map_noise is not None if observation_noise is None else observation_noise
        if fit_noise and self._map_noise is None:
            raise ModelError("observation_noise=True needs a Normal likelihood with one scalar scale.")
        precision, noise = maximize_evidence(
            self.log_marginal_likelihood,
            groups,
            self._prior_precision,
            self._observation_noise if fit_noise else None,
            max_iter=max_iter,
        )
        self.prior_precision = precision
        if noise is not None:
            self.observation_noise = noise
            self.check_noise(fitted=True)
        return self

    def check_noise(self, *, fitted: bool = False) -> None:
        """Warn when a Normal's σ has too few observations left to measure it (N − γ; see :mod:`.map_check`)."""
        given = self._noise_site is None and not fitted  # a constant σ in the model: nothing was fitted
        if self._map_noise is not None and not given and self._prior_precision.dim() == 1:
            fit, gamma, source = self.fit, self.effective_parameters(), f"the {self.structure!r} Laplace posterior"
            args = (int(fit.num_observations), float(fit.sum_squares), float(self._observation_noise), self._noise_site)
            check_noise_fit(gamma, *args, source, fitted_by="the evidence" if fitted else None)

    def effective_parameters(self) -> float:
        r"""MacKay's :math:`\gamma = \sum_j (1 - P_j (H^{-1})_{jj})` in the fitted structure's H (diagonal priors).

        How many parameters the data determine: at most the number of observations under the exact GGN.
        """
        if self._prior_precision.dim() == 2:
            raise ModelError("effective_parameters needs a diagonal prior precision; this one is a previous posterior.")
        inverse = self.precision.inverse_diagonal()
        return float(inverse.numel() - (self._prior_precision * inverse).sum())


def prior_times(precision: Tensor, v: Tensor) -> Tensor:
    """The prior precision (a diagonal, or a dense matrix from ``as_prior``) times ``v``."""
    return v @ precision if precision.dim() == 2 else precision * v


def _prior_logdet(precision: Tensor) -> Tensor:
    if precision.dim() == 2:
        return (2 * torch.linalg.cholesky(precision.double()).diagonal().log().sum()).to(precision.dtype)
    return precision.log().sum()


def _traced(value: Any) -> bool:
    # inside the evidence optimiser: a line search may try an overflowing step, which L-BFGS itself handles
    return isinstance(value, Tensor) and value.requires_grad
