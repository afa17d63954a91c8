r"""EM for the prior precision of a linear model from posterior samples (MacKay's update).

With the prior :math:`\mathcal N(m, A^{-1})`, :math:`A = \mathrm{diag}(\alpha_{g(k)} s_k)` — one precision
:math:`\alpha_g` per group of parameters (all of them, or one Pyro site each) times a fixed scale :math:`s` (ones,
or the g-prior's :math:`\mathrm{diag}(M)` normalised to mean one per group) — the evidence is stationary in
:math:`\alpha_g` where (MacKay 1992)

.. math::

    \alpha_g = \frac{\gamma_g}{\sum_{k\in g} s_k(\bar\theta_k - m_k)^2}, \qquad
    \gamma_g = \sum_{k\in g}\,[H^{-1}M]_{kk} = d_g - \alpha_g \sum_{k \in g} s_k [H^{-1}]_{kk},

the effective number of parameters of the group that the data determine. The log-determinant the exact evidence
needs is never formed: with zero-mean posterior samples :math:`\zeta_j \sim \mathcal N(0, H^{-1})`,
:math:`\mathbb E[\zeta_j (M\zeta_j)^\top] = H^{-1}M`, so

.. math::

    \hat\gamma_g = \frac1K \sum_{j=1}^K \sum_{k\in g} \zeta_{jk}\,(M\zeta_j)_k

is unbiased. For a single group it is :math:`\frac1K\sum_j \lVert\Phi\zeta_j\rVert^2_B`, the prediction-space
estimate of Antorán et al. (2023), whose variance is small (one sample is often enough). A group's estimate also
carries its samples' coupling to the other groups through :math:`M`, so it is noisier and can leave
:math:`(0, d_g)`, where the true value lies; it is clipped to that interval. The E-step (samples and mean at
:math:`\alpha`) and this M-step alternate; the samples' prior draws are kept and rescaled
(:math:`\theta^0 = A^{-1/2}\varepsilon` with fixed :math:`\varepsilon`), and each solve starts from the last.

**Damping where the iteration oscillates.** With several groups the update is a coupled map whose slope at the fixed
point (in :math:`\log\alpha`) can be near or below :math:`-1`, and on a multi-layer network the layers' :math:`\alpha`
can then alternate about the fixed point (a period-2 cycle) rather than settle. Each group's step in :math:`\log\alpha`
is therefore scaled by :math:`2^{-c}`, :math:`c` the number of sign changes of that group's steps so far: a monotone run
is MacKay's iteration unchanged, and a slope :math:`s < 0` becomes :math:`1 - 2^{-c}(1 - s)`, which stops the sign
changes once :math:`2^{-c} \le 1/(1-s)`. The fixed point is the same. :math:`c` is read from the history of
:math:`\alpha`, so a resumed run needs no more state.

**The noise precision** (``em_noise=True``; a Normal likelihood with one scalar scale :math:`\sigma`,
:math:`\beta = \sigma^{-2}`): the evidence is stationary in :math:`\beta` where (MacKay 1992)

.. math::

    \beta = \frac{n - \gamma}{\lVert y - f_{\rm lin}(\bar\theta)\rVert^2}, \qquad
    \gamma = \sum_g \gamma_g,

with :math:`n` the observed values and :math:`f_{\rm lin}(\bar\theta) = f(\theta_*) + J(\bar\theta - \theta_*)`
the linearised fit at the posterior mean (one JVP pass). A new :math:`\beta` scales the data's curvature
:math:`M`, its gradient :math:`b` and the perturbations' :math:`B^{1/2}` by :math:`\beta/\beta_0`,
:math:`\beta/\beta_0` and :math:`\sqrt{\beta/\beta_0}` exactly, so nothing is recomputed but the next solve.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["damp_oscillation", "effective_dimension", "linearized_sum_squares", "mackay_noise_update", "mackay_update"]


def effective_dimension(samples: Tensor, ggn_samples: Tensor, groups: Tensor, num_groups: int) -> Tensor:
    r""":math:`\hat\gamma_g`, from zero-mean samples ``(K, d)`` and their products ``M ζ`` ``(K, d)``."""
    per_parameter = (samples * ggn_samples).mean(0)
    return torch.zeros(num_groups, dtype=samples.dtype, device=samples.device).index_add(0, groups, per_parameter)


def mackay_update(gamma: Tensor, offset: Tensor, scale: Tensor, groups: Tensor) -> Tensor:
    r"""The new :math:`\alpha_g = \gamma_g / \sum_{k\in g} s_k o_k^2`, with the offset :math:`o = \bar\theta - m`."""
    norms = torch.zeros_like(gamma).index_add(0, groups, scale * offset**2)
    sizes = torch.bincount(groups, minlength=gamma.shape[0]).to(gamma)
    # gamma_g lies in (0, d_g); a group's estimate can leave it (the cross-group terms of M are noisy), the total
    # cannot fall below 0
    return gamma.clamp(min=1e-3, max=None).minimum(sizes) / norms


def mackay_noise_update(gamma: Tensor, sum_squares: Tensor, num_observations: Tensor) -> Tensor:
    r"""The new noise scale :math:`\sigma = (\lVert y - f\rVert^2 / (n - \gamma))^{1/2}` (:math:`n - \gamma \ge 1`)."""
    dof = (num_observations - gamma).clamp(min=1.0)
    return (sum_squares / dof).sqrt()


def linearized_sum_squares(net: Any, theta: Tensor, step: Tensor, batches: list[Any]) -> Tensor:
    """``[Σ w ‖y − f(θ*) − J step‖², Σ w]`` over ``batches`` (observed outputs, weighted): one JVP per batch."""
    total = theta.new_zeros(2)
    for batch in batches:
        out = net.outputs(theta, batch)
        f, tangent = net.jvp(theta, step.unsqueeze(0), batch)
        likelihood = out.likelihood
        keep = likelihood.weight_outputs(f)
        residual = likelihood.flatten(out.value) - (f + tangent[0]).detach()
        total = total + torch.stack([(keep * residual**2).sum(), keep.sum()])
    return total


def damp_oscillation(history: list[Tensor], proposal: Tensor) -> Tensor:
    """The next ``alpha`` per group: the step from ``history[-1]`` to ``proposal`` in log space, halved per sign change.

    ``history`` holds every ``alpha`` so far ``(groups,)`` each, ``proposal`` MacKay's update.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.linearized.sampling.em import damp_oscillation
        >>> history = [torch.tensor([1.0]), torch.tensor([4.0])]  # one step up ...
        >>> damp_oscillation(history, torch.tensor([1.0]))  # ... then a proposal back down: half the step in log
        tensor([2.])

    """
    logs = torch.stack(history).log()
    step = proposal.log() - logs[-1]
    steps = torch.cat([logs.diff(dim=0), step.unsqueeze(0)])
    changes = (steps[1:] * steps[:-1] < 0).sum(0)
    return (logs[-1] + step * 0.5**changes).exp()
