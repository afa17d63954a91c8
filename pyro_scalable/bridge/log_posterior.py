"""A bridge's log posterior as an engine's ``log_posterior_fn``, able to split a minibatch into single examples."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import Tensor

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.records import Batch, Latents

if TYPE_CHECKING:
    from pyro_scalable.bridge.model import ModelBridge

__all__ = ["LogPosterior"]


class LogPosterior:
    """A bridge's log posterior as an engine's ``log_posterior_fn``, with the per-example split of a minibatch.

    ``examples(batch)`` turns the subsampled plate's ``B`` indices into ``B`` batches of one index each, stacked on
    a leading dimension, so that ``torch.func.vmap`` evaluates ``log p(θ) + N log p(y_i | θ)`` for every example at
    once: the per-example gradients whose spread is the minibatch gradient's noise.
    """

    def __init__(self, bridge: ModelBridge, *, replacement: bool = False):
        self.bridge = bridge
        self.replacement = replacement  # minibatches drawn with replacement: no finite-population correction

    def __call__(self, latents: Latents, batch: Batch) -> Tensor:
        return self.bridge.log_posterior(latents, batch)

    def examples(self, batch: Batch) -> tuple[Batch, Batch, float] | None:
        """``(examples, in_dims, N)``: one batch per example of the subsampled plate, for ``torch.func.vmap``.

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
        split = {**batch.indices, plate.name: indices.unsqueeze(-1)}
        in_dims = Batch({name: 0 if name == plate.name else None for name in split}, None, None)
        return Batch(split, batch.args, batch.kwargs), in_dims, math.inf if self.replacement else plate.size
