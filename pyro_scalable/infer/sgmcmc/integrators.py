r"""The SG-MCMC update rules as pure functions, as BlackJAX's ``sgmcmc/diffusions.py``.

Each function takes latents (or momenta, dicts by site), the minibatch gradient :math:`\hat g` of the log joint,
the step size :math:`\epsilon`, the variance to inject (already corrected for the gradient noise, see
:func:`~.base.injected_variance`) and standard normal noise :math:`\xi`, and returns the moved values. No Pyro, no
warm-up, no divergence handling: the kernels (:mod:`.sgld`, :mod:`.sghmc`, ...) put them together and document the
maths they implement.

* :func:`langevin`: :math:`\theta + \epsilon G \hat g + \sqrt{v}\,\xi` (SGLD; pSGLD with the metric :math:`G`).
* :func:`momentum`: :math:`d\,p + \epsilon \hat g + \sqrt{v}\,\xi` with the per-step decay :math:`d` of the
  friction (SGHMC's :math:`1 - \epsilon\alpha/m`, SGNHT's :math:`1 - \epsilon\xi`).
* :func:`drift`: :math:`\theta + s\,p` (SGHMC's :math:`s = \epsilon/m`, SGNHT's :math:`\epsilon`).
* :func:`thermostat`: :math:`\xi + \epsilon (p^\top p / d - T)` (SGNHT).
* :func:`kick`, :func:`ornstein_uhlenbeck`, :func:`baoab_position`: BAOAB's B, O and its two A's.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["baoab_position", "drift", "kick", "langevin", "momentum", "ornstein_uhlenbeck", "thermostat"]

Latents = dict[str, Tensor]


def langevin(
    latents: Latents,
    grads: Latents,
    step_size: Tensor,
    variance: Latents,
    noise: Latents,
    metric: Latents | None = None,
) -> Latents:
    """Langevin: ``θ + ε G ĝ + √v ξ`` (``metric=None``: G = I)."""
    if metric is None:
        return {name: x + step_size * grads[name] + variance[name].sqrt() * noise[name] for name, x in latents.items()}
    return {
        name: x + step_size * metric[name] * grads[name] + variance[name].sqrt() * noise[name]
        for name, x in latents.items()
    }


def momentum(
    momenta: Latents,
    grads: Latents,
    step_size: Tensor,
    decay: Tensor | Latents,
    variance: Latents | None,
    noise: Latents,
    *,
    std: Latents | None = None,
) -> Latents:
    """A momentum step with friction: ``d p + ε ĝ + √v ξ`` (``decay`` d a scalar or per site; ``std``: √v if known)."""
    if std is None:
        std = {name: v.sqrt() for name, v in variance.items()}
    return {
        name: (decay[name] if isinstance(decay, dict) else decay) * p
        + step_size * grads[name]
        + std[name] * noise[name]
        for name, p in momenta.items()
    }


def drift(latents: Latents, momenta: Latents, scale: Tensor | Latents) -> Latents:
    """The position step ``θ + s p`` (``scale`` s a scalar or per site: ε or ε / m)."""
    return {
        name: x + (scale[name] if isinstance(scale, dict) else scale) * momenta[name] for name, x in latents.items()
    }


def thermostat(xi: Tensor, momenta: Latents, step_size: Tensor, temperature: Tensor) -> Tensor:
    """The Nosé–Hoover thermostat step ``ξ + ε (pᵀp / d - T)``, d the number of coordinates."""
    dimension = sum(p.numel() for p in momenta.values())
    kinetic = sum(p.square().sum() for p in momenta.values()) / dimension
    return xi + step_size * (kinetic - temperature)


def kick(momenta: Latents, grads: Latents, size: Tensor) -> Latents:
    """B: ``p + h ĝ`` (BAOAB's two half-kicks at one point in one, ``h`` their summed step)."""
    return {name: p + size * grads[name] for name, p in momenta.items()}


def ornstein_uhlenbeck(momenta: Latents, decay: Tensor | Latents, variance: Latents, noise: Latents) -> Latents:
    """O, the exact Ornstein–Uhlenbeck step: ``c p + √v ξ`` (``c`` a scalar or per site)."""
    return {
        name: (decay[name] if isinstance(decay, dict) else decay) * p + variance[name].sqrt() * noise[name]
        for name, p in momenta.items()
    }


def baoab_position(latents: Latents, kicked: Latents, momenta: Latents, step_size: Tensor, mass: Latents) -> Latents:
    """A, O, A's positions: ``θ + (ε/2m) p' + (ε/2m) p̃`` (``kicked`` p' before O, ``momenta`` p̃ after it)."""
    return {
        name: x + (0.5 * step_size / mass[name]) * kicked[name] + (0.5 * step_size / mass[name]) * momenta[name]
        for name, x in latents.items()
    }
