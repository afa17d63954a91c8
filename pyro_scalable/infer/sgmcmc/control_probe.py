r"""After a run whose control variate ``"auto"`` chose, measure what it bought at the chains' last draws.

The controlled minibatch gradient (:mod:`.control_variates`) is the plain one minus the same minibatch's gradient
at the centre θ̂, plus the full-data gradient there; its noise is the spread over minibatches of
:math:`\nabla\ell_B(\theta) - \nabla\ell_B(\hat\theta)`. Where the posterior is concentrated and locally quadratic that
is about ``d/N`` of the plain estimate's noise. Where the chains sit in other modes than θ̂, as a neural network's do
(its hidden units can be permuted and their signs flipped), it is about as large as the plain noise: the control variate
then bought nothing for its mode search and its second gradient per step. ``"auto"`` cannot see that before the search
(the chains are not yet where the posterior's mass is, and the search's length does not tell the two kinds apart), so it
is measured after the run.

:func:`controlled_noise_share` measures it at each chain's final draw, on :data:`PROBE_BATCHES` fresh minibatches
drawn by its own generator (the run, its draws and its checkpoint are untouched): the per-coordinate variances over
those minibatches of the controlled and the plain gradient, summed over the coordinates and the chains, and their
ratio. :func:`warn_wasted_control_variate` warns where it is over :data:`WORTH`: for twice the
gradient work per step the control variate must at least halve the noise, and the warning says to pass
``control_variate=None``, with what the search cost.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from pyro_scalable.bridge.checks import user_stacklevel
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.infer.full_data import point_gradient_and_value
from pyro_scalable.infer.gradients import ControlledDensity, MinibatchDensity

__all__ = ["PROBE_BATCHES", "WORTH", "controlled_noise_share", "warn_wasted_control_variate"]

PROBE_BATCHES = 32  # minibatches, the same for the plain and the controlled gradient and for every chain
WORTH = 0.5  # the controlled noise's largest share of the plain noise for which twice the work per step pays


def controlled_noise_share(
    controlled: MinibatchDensity, bridge: ModelBridge, latents: Latents, seed: int
) -> float | None:
    """The controlled minibatch gradient's noise as a share of the plain one's, at each chain of ``latents``.

    ``controlled`` is the run's density, a :class:`~pyro_scalable.infer.gradients.ControlledDensity` (its ``inner``
    the plain log posterior); ``latents`` the chains' final draws (unconstrained, a leading chain dimension). Returns
    the share pooled over the chains (the variances summed over coordinates and chains); ``None`` where there is
    nothing to measure (no centre, no subsampled plate, several of them, or a minibatch of one point) or where the plain
    gradient does not vary or a gradient is not finite.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> from pyro_scalable.infer.gradients import ControlledDensity
        >>> from pyro_scalable.infer.sgmcmc.control_variates import full_data_gradient
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y), subsample_size=10) as idx:
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])
        >>> bridge = ModelBridge(model, (torch.randn(1000),))
        >>> centre = full_data_gradient(bridge, {"mu": torch.tensor(0.0)})
        >>> controlled = ControlledDensity(bridge.log_posterior_fn, centre)
        >>> share = controlled_noise_share(controlled, bridge, {"mu": torch.tensor([0.5, -0.3])}, seed=0)
        >>> share < 1e-9  # the gradient is linear in mu: the centre's minibatch gradient cancels all its noise
        True

    """
    plates = list(bridge.plates.values())
    if (
        not isinstance(controlled, ControlledDensity)
        or controlled.control is None
        or len(plates) != 1
        or plates[0].subsample_size < 2
    ):
        return None
    plain_fn, chains = controlled.inner, next(iter(latents.values())).shape[0]
    generator = torch.Generator(device=bridge.device).manual_seed(seed + 3)  # never the run's generator
    sampler = EpochSampler(bridge.plates, 1, generator, bridge.device, shared=True)
    batches = [Batch(next(sampler), bridge.args, bridge.kwargs) for _ in range(PROBE_BATCHES)]
    plain_spread = controlled_spread = 0.0
    for c in range(chains):
        at = {name: x[c].detach() for name, x in latents.items()}
        plain, controlled_grads = [], []
        for batch in batches:
            # plain autograd: a gradient transform would import torch._dynamo into the user's process
            plain.append(_flat(point_gradient_and_value(plain_fn, at, batch)[0]))
            controlled_grads.append(_flat(point_gradient_and_value(controlled, at, batch)[0]))
        plain_spread += float(torch.stack(plain).var(0).sum())
        controlled_spread += float(torch.stack(controlled_grads).var(0).sum())
    if not (plain_spread > 0 and math.isfinite(plain_spread) and math.isfinite(controlled_spread)):
        return None
    return controlled_spread / plain_spread


def _flat(grads: Latents) -> torch.Tensor:
    return torch.cat([g.detach().reshape(-1).double() for g in grads.values()])


def warn_wasted_control_variate(share: float | None, search: Any) -> None:
    """Warn where the control variate ``"auto"`` chose left over :data:`WORTH` of the plain noise (module docstring).

    ``search``: the run's :class:`~pyro_scalable.infer.mode_search.ModeSearch` (``None``: the centre was read back
    from a checkpoint).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_wasted_control_variate(0.02, None)  # a regression's share: worth its cost, nothing said
        ...     warn_wasted_control_variate(0.93, None)
        >>> [str(w.message)[:60] for w in caught]
        ["control_variate='auto' centred a control variate at the post"]

    """
    if share is None or share <= WORTH:
        return
    cost = ""
    if search is not None:
        cost = f" (its mode search: {search.full_passes} passes over the data, {search.seconds:.1f} s)"
    warnings.warn(
        "control_variate='auto' centred a control variate at the posterior mode, but at the chains' final draws it "
        f"left {share:.0%} of the minibatch gradient's noise: the chains are not near that mode (a posterior with "
        "several modes, as a neural network's, or whose mode lies outside its bulk, as a non-centred hierarchy's), "
        f"so it bought little or nothing for its second gradient per step{cost}. The draws are not affected. Pass "
        "control_variate=None for this model.",
        stacklevel=user_stacklevel(),
    )
