"""Divergence handling: a step whose log density or gradient is not finite is rejected.

The kernels' updates (:mod:`.integrators`) compute a proposal unconditionally; these select, per chain, the proposal
where the step's estimate was finite and the last finite point (``checked_latents``, momenta zeroed) where it was
not (:mod:`.base` describes the contract). A plain CPU step outside ``vmap`` that is known finite skips the
selection (three ``torch.where`` per site per step, a noticeable share of a large network's step on a CPU). Inside
``vmap`` (no per-chain Python flag) and on a GPU (asking would
synchronise the device every step) the selection always runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.bridge.traced import under_transform
from pyro_scalable.infer.gradients.estimate import flag
from pyro_scalable.infer.sgmcmc.base import Latents

__all__ = ["keep_where_finite", "zero_where_diverging"]


def keep_where_finite(diverging: Tensor, new: Latents, old: Latents) -> Latents:
    """Select ``new`` where the step was finite and ``old`` where it diverged.

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.sgmcmc.divergence import keep_where_finite
        >>> keep_where_finite(torch.tensor([True, False]), {"w": torch.tensor([9.0, 1.0])}, {"w": torch.zeros(2)})
        {'w': tensor([0., 1.])}

    """
    if _finite_here(diverging):
        return dict(new)
    return {name: torch.where(diverging, old[name], new[name]) for name in new}


def zero_where_diverging(diverging: Tensor, momenta: Latents) -> Latents:
    """Momenta zeroed where the step diverged (the chain restarts at rest from its last finite point).

    Example:
        >>> import torch
        >>> from pyro_scalable.infer.sgmcmc.divergence import zero_where_diverging
        >>> zero_where_diverging(torch.tensor(False), {"w": torch.ones(2)})  # a finite CPU step: kept as it is
        {'w': tensor([1., 1.])}

    """
    if _finite_here(diverging):
        return momenta
    return {name: torch.where(diverging, p.new_zeros(()), p) for name, p in momenta.items()}


_last: tuple = (None, False)  # the last flag asked about and the answer: a step asks three times about one flag


def _finite_here(diverging: Tensor) -> bool:
    """Whether a plain CPU step is known finite, so that its rejection can be skipped (no device sync on a GPU)."""
    global _last
    if torch.compiler.is_compiling():  # a compiled step keeps the rejection in its graph: no host read
        return False
    if diverging is flag(False, diverging.device):  # evaluate's shared flag: read on the host already
        return True
    last, finite = _last  # one read of the pair: safe where threads step chains side by side
    if last is diverging:
        return finite
    finite = diverging.device.type == "cpu" and not under_transform(diverging) and not bool(diverging.any())
    _last = (diverging, finite)
    return finite
