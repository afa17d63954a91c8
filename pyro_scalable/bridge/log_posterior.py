r"""A bridge's log posterior as an engine's ``log_posterior_fn``, able to split a minibatch into groups of examples.

The gradient-noise estimate needs the spread of the minibatch gradient. With :math:`B` examples split into :math:`G`
groups of :math:`m = B/G` (consecutive positions of a minibatch drawn in random order, so a random partition), each
group's estimate :math:`\log p(\theta) + \frac{N}{m}\sum_{i\in g}\log p(y_i\mid\theta)` has gradient :math:`h_g`, the
mean of its :math:`g_i`. Over random partitions :math:`\mathbb{E}[\sum_g (h_g - \bar h)^2] = (G - 1)\,s^2/m`
(:math:`s^2` the sample variance of the :math:`B` per-example gradients), so :math:`m\,\mathrm{var}_G(h_g)` estimates
:math:`s^2` without bias from :math:`G` gradients instead of :math:`B`. Per example (:math:`m = 1`) costs :math:`B`
gradients of one example each, on a network many times the cost of the minibatch gradient; :math:`G` groups cost a few
times it. The fewer degrees of freedom (:math:`G - 1` instead of :math:`B - 1`) are averaged away by the engines' moving
average of the noise over about 50 steps. A minibatch of at most :data:`MAX_GROUPS` examples, or one whose size has no
divisor between :data:`MIN_GROUPS` and :data:`MAX_GROUPS`, is split into single examples.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.records import Batch, Latents

if TYPE_CHECKING:
    from pyro_scalable.bridge.model import ModelBridge

__all__ = ["MAX_GROUPS", "MIN_GROUPS", "PARTS", "Examples", "LogPosterior", "group_size"]

MAX_GROUPS = 32  # groups per minibatch for the noise estimate (at most 31 degrees of freedom per step)
MIN_GROUPS = 16  # fewer than this and the split is per example
PARTS = ("prior", "data")  # the log posterior's terms, apart (ModelBridge.log_posterior_part)


class Examples(NamedTuple):
    """A minibatch split for ``torch.func.vmap``, each part an estimate of the log joint on its own.

    ``batches`` stacked along ``in_dims``, each of ``group_size`` examples drawn from ``population_size`` data
    points (``inf`` for draws with replacement).
    """

    batches: Batch
    in_dims: Batch
    population_size: float
    group_size: int = 1


def group_size(batch_size: int) -> int:
    """Examples per group of a minibatch of ``batch_size`` (module docstring).

    1, or ``batch_size / G`` with ``G`` the largest divisor of ``batch_size`` not above :data:`MAX_GROUPS`, when
    that is at least :data:`MIN_GROUPS`.
    """
    if batch_size <= MAX_GROUPS:
        return 1
    groups = next(g for g in range(MAX_GROUPS, 0, -1) if batch_size % g == 0)
    return batch_size // groups if groups >= MIN_GROUPS else 1


class LogPosterior:
    """A bridge's log posterior as an engine's ``log_posterior_fn``, with the grouped split of a minibatch.

    ``examples(batch)`` splits the subsampled plate's ``B`` indices into ``G`` groups of ``m`` (:func:`group_size`;
    ``m = 1`` for small minibatches), stacked on a leading dimension, so that ``torch.func.vmap`` evaluates
    ``log p(θ) + (N/m) Σ_{i∈g} log p(y_i | θ)`` for every group at once: the group gradients whose spread estimates the
    minibatch gradient's noise (module docstring). ``terms`` are the prior's terms and the data's, which sum to it:
    the prior's are the same for every group, so the noise estimate evaluates them once, not once per group. It is
    the engines' :class:`~pyro_scalable.infer.gradients.MinibatchDensity` of a Pyro model; ``replacement`` (minibatches
    drawn with replacement: no finite-population correction) is fixed when it is made.
    """

    def __init__(self, bridge: ModelBridge, *, replacement: bool = False):
        self.bridge = bridge
        self.replacement = replacement  # minibatches drawn with replacement: no finite-population correction
        self.terms = tuple(partial(bridge.log_posterior_part, part) for part in PARTS)

    def __call__(self, latents: Latents, batch: Batch) -> Tensor:
        return self.bridge.log_posterior(latents, batch)

    @staticmethod
    def batched_gradient(
        latents: Latents, batch: Batch, dims: list | None = None, *, create_graph: bool = False
    ) -> None:
        """None: every point's gradient is nested vmaps of the density and one backward pass (the engines' own)."""
        return None

    def examples(self, batch: Batch) -> Examples | None:
        """The subsampled plate's minibatch split into groups of :func:`group_size` examples, for ``torch.func.vmap``.

        ``None`` where no plate is subsampled (the gradient has no noise); N is ``inf`` for minibatches drawn
        with replacement (no finite-population correction).
        """
        plates = list(self.bridge.plates.values())
        if not plates and self.bridge.given_plates:
            name = next(iter(self.bridge.given_plates))
            raise ModelError(
                f"estimating the gradient noise needs per-example gradients, but plate '{name}' takes its minibatch "
                "from the model's arguments (`subsample=idx`, a `batches=` loader), which cannot be split into "
                "single examples. Use pyro.plate(..., subsample_size=B) and pass the full data to run(), or give a "
                "step_size with gradient_noise='ignore' (uncorrected: the draws come out too wide at small B)."
            )
        if not plates:
            return None  # no subsampling: the gradient is exact
        if len(plates) != 1:
            names = ", ".join(f"'{p.name}'" for p in plates) or "none"
            raise ModelError(
                "estimating the gradient noise needs exactly one subsampled plate (found: "
                f"{names}); give only the data plate a subsample_size, or switch the noise estimate off."
            )
        plate = plates[0]
        indices = batch.indices.get(plate.name)
        if indices is None:
            raise ModelError(
                f"estimating the gradient noise needs the minibatch indices of plate '{plate.name}', which a "
                "`batches=` loader does not give; use pyro.plate(..., subsample_size=B) instead of a DataLoader."
            )
        if indices.shape[-1] < 2:
            raise ModelError(
                f"plate '{plate.name}' has a minibatch of {indices.shape[-1]} point; estimating the gradient noise "
                "needs subsample_size >= 2."
            )
        size = indices.shape[-1]
        group = group_size(size)
        split = {**batch.indices, plate.name: indices.reshape(*indices.shape[:-1], size // group, group)}
        in_dims = Batch({name: 0 if name == plate.name else None for name in split}, None, None)
        population = math.inf if self.replacement else plate.size
        return Examples(Batch(split, batch.args, batch.kwargs), in_dims, population, group)
