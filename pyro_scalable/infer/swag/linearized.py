r"""SWAG's linearised predictive: the network linearised at the SWA mean, pushed through SWAG's Gaussian.

With :math:`\bar\theta` one run's SWA mean and :math:`\Sigma = D + AA^\top` its covariance over the sites the
network's output depends on — :math:`D = \tfrac12\mathrm{diag}(\sigma^2)`, :math:`A = \hat D/\sqrt{2(K-1)}` (the
last K deviations) for ``covariance="low_rank"``; :math:`D = \mathrm{diag}(\sigma^2)` and no :math:`A` for
``"diagonal"`` — the linearised network :math:`f(x,\theta) \approx f(x,\bar\theta) + J(x)(\theta-\bar\theta)` has
the Gaussian output law

.. math::

    f(x) \sim \mathcal N\!\big(f(x,\bar\theta),\ J D J^\top + (JA)(JA)^\top\big).

:math:`JDJ^\top` is assembled from the per-layer Jacobian factors, as for the Laplace ``diag`` structure, and
:math:`JA` from K Jacobian-vector products, so no ``(points, outputs, d)`` Jacobian is formed for the layers the
linearisation floor records. The law of ``y`` follows as for the Laplace posterior: closed form for a Normal
likelihood, probit or Monte Carlo for classification and counts (``infer/linearized/likelihoods.py``). Immer et al.
(2021, "Improving predictions of Bayesian neural nets via local linearization") argue for this GLM predictive over
the sampled-weights one for Gaussian posteriors of networks; here the Gaussian is SWAG's, not a Laplace's.

Latent sites the output does not depend on, and a scalar Normal noise scale, are held at their SWA-mean values (a
plug-in noise). One run at a time: a MultiSWAG mixture has one linearisation point per run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pyro_scalable.bridge.model import Batch
from pyro_scalable.infer.linearized.glm import GLMPredictive, Moments, glm_predictive
from pyro_scalable.infer.linearized.jacobians import OutputJacobian, layer_plan
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.likelihoods import LinkApprox
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sites import choose_sites, observed_site

if TYPE_CHECKING:
    from pyro_scalable.infer.swag.posterior import SWAGPosterior

__all__ = ["linearized_predictive"]


def linearized_predictive(
    posterior: SWAGPosterior,
    run: int,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    link_approx: LinkApprox,
    num_samples: int,
    generator: torch.Generator | None,
) -> GLMPredictive:
    """Run ``run``'s linearised predictive at the model's inputs ``args`` (none: the training data)."""
    bridge = posterior.bridge
    site = observed_site(bridge, "SWAG's linearised predictive")
    latents = {k: v.detach() for k, v in posterior.layout.unflatten(posterior.mean[run]).items()}
    latents = {name: value.to(bridge.sites[name].dtype) for name, value in latents.items()}
    chosen, heteroscedastic, _, _ = choose_sites(bridge, site, latents, None)
    layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
    theta = layout.flatten(latents).detach()
    net = NetworkFunction(bridge, site, layout, theta, latents, heteroscedastic=heteroscedastic)
    plans, rest = layer_plan(net, theta)
    slots = posterior.layout.slots
    index = torch.cat([torch.arange(slots[n].start, slots[n].stop, device=theta.device) for n in chosen])
    diagonal, factor = posterior.covariance_factors(run)
    diagonal, factor = diagonal[index].to(theta.dtype), factor[index].T.contiguous().to(theta.dtype)  # (K, d)

    def moments(batch: Batch) -> Moments:
        jacobian = OutputJacobian(net, theta, plans, rest, batch)
        covariance = jacobian.diagonal_covariance(diagonal)
        if factor.shape[0]:
            _, products = net.jvp(theta, factor, batch)
            products = products.detach()
            covariance = covariance + torch.einsum("kpm,kpn->pmn", products, products)
        return jacobian.f, covariance, jacobian.likelihood

    batches = list(net.batches()) if not args and not kwargs else list(net.batches(args, kwargs))
    return glm_predictive(batches, moments, link_approx=link_approx, num_samples=num_samples, generator=generator)
