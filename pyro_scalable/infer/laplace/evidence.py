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

from collections.abc import Callable

import torch
from torch import Tensor

from pyro_scalable.infer.laplace.curvature import CurvatureError

__all__ = ["maximize_evidence"]


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
