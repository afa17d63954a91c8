r"""Minibatch indices for the engine-controlled plates, and the full data in chunks.

Each chain walks through its own random permutation of ``range(N)`` in slices of B (reshuffling when fewer than
B indices remain), as a shuffled ``DataLoader`` would: every point is visited once per epoch, which gives a lower
gradient variance than drawing with replacement. On a GPU all chains' permutations come from one sort
(:func:`permutations`). Indices live on the data's device and come from the engine's
generator, so a seeded run is reproducible on CPU and CUDA alike.

With ``replacement=True`` each minibatch is instead B indices drawn uniformly with replacement, independently
of every other minibatch. The gradient noise is then independent from step to step with covariance
:math:`\mathrm{Cov}_i(g_i)/B`, which is what a noise correction can subtract; an epoch's minibatches are
negatively correlated (at a fixed point their gradients sum to the full-data gradient), so a slowly moving
chain sees less noise than one minibatch's spread suggests, and a correction computed from it over-corrects.

With ``shared=True`` every chain gets the same minibatch each step (a ``(B,)`` index tensor instead of ``(C, B)``):
the vectorised step then gathers the rows once and multiplies them with every chain's parameters in one batched
product, instead of gathering ``C × B`` rows. Each chain is still a valid sampler; their gradient noise is the
same draw, so the chains are not independent given the data, which between-chain diagnostics assume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.bridge.records import DataPlate

__all__ = ["CHUNK_BYTES", "CHUNK_SIZE", "EpochSampler", "chunks", "data_passes", "permutations", "points_per_chunk"]

CHUNK_SIZE = 2**16  # data points per chunk of a full-data pass (enough that the bridge's cost per chunk is small)
CHUNK_BYTES = 2**26  # ... and fewer where the data's rows of a chunk would take more than this


class EpochSampler:
    """Per-chain shuffled minibatch indices for each subsampled plate: ``next(sampler) -> {plate: (C, B)}``.

    ``shared=True``: one stream for all chains, ``next(sampler) -> {plate: (B,)}``.
    """

    def __init__(
        self,
        plates: dict[str, DataPlate],
        num_chains: int,
        generator: torch.Generator,
        device: torch.device,
        *,
        replacement: bool = False,
        shared: bool = False,
    ):
        self.plates = plates
        self.replacement = replacement
        self.shared = shared
        self.num_chains = 1 if shared else num_chains
        self.generator = generator
        self.device = device
        self._orders: dict[str, Tensor] = {}
        self._position: dict[str, int] = {}
        for plate in plates.values():
            self._shuffle(plate)

    def _shuffle(self, plate: DataPlate) -> None:
        self._orders[plate.name] = permutations(plate.size, self.num_chains, self.generator, self.device)
        self._position[plate.name] = 0

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return self

    def __next__(self) -> dict[str, Tensor]:
        batch = {}
        for plate in self.plates.values():
            if self.replacement:
                shape = (self.num_chains, plate.subsample_size)
                batch[plate.name] = torch.randint(plate.size, shape, generator=self.generator, device=self.device)
                continue
            start = self._position[plate.name]
            if start + plate.subsample_size > plate.size:
                self._shuffle(plate)
                start = 0
            batch[plate.name] = self._orders[plate.name][:, start : start + plate.subsample_size]
            self._position[plate.name] = start + plate.subsample_size
        return {name: idx[0] for name, idx in batch.items()} if self.shared else batch

    def larger(self, size: int) -> dict[str, Tensor]:
        """``{plate: (1, m)}``: about ``size`` indices evenly spread over each plate (at least its minibatch).

        Deterministic, and draws nothing from the generator: the run's minibatches after it are unchanged.
        """
        batch = {}
        for plate in self.plates.values():
            stride = max(1, plate.size // max(size, plate.subsample_size))
            batch[plate.name] = torch.arange(0, plate.size, stride, device=self.device)[None]
        return batch

    def state_dict(self) -> dict[str, dict]:
        """The current permutations and positions (the generator's state is its owner's to save)."""
        return {"orders": dict(self._orders), "position": dict(self._position)}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Continue from :meth:`state_dict`: the same minibatches follow, given the same generator state."""
        self._orders = {name: order.to(self.device) for name, order in state["orders"].items()}
        self._position = {name: int(position) for name, position in state["position"].items()}


def permutations(
    size: int, count: int, generator: torch.Generator, device: torch.device, *, batched: bool | None = None
) -> Tensor:
    """``count`` independent uniform random permutations of ``range(size)``: the rows of a ``(count, size)`` tensor.

    On a GPU (``batched`` by default) one argsort of random 62-bit keys makes them all, where a ``randperm`` per chain
    would cost host time for each chain. On the CPU a ``randperm`` each is cheaper than a sort. Ties among the keys,
    which would make the order depend on the sort, have probability below size² / 2⁶² per row.

    Example:
        >>> import torch
        >>> orders = permutations(5, 3, torch.Generator().manual_seed(0), torch.device("cpu"), batched=True)
        >>> orders.shape, bool((orders.sort(dim=1).values == torch.arange(5)).all())
        (torch.Size([3, 5]), True)

    """
    if batched is None:
        batched = device.type == "cuda"
    if not batched:
        return torch.stack([torch.randperm(size, generator=generator, device=device) for _ in range(count)])
    keys = torch.randint(0, 2**62, (count, size), generator=generator, device=device)
    return keys.argsort(dim=1)


def chunks(size: int, chunk_size: int, device: torch.device) -> Iterator[Tensor]:
    """Consecutive index chunks covering ``range(size)``."""
    for start in range(0, size, chunk_size):
        yield torch.arange(start, min(start + chunk_size, size), device=device)


def points_per_chunk(bridge: Any, requested: int | None = None) -> int:
    """Points per chunk of a pass over the first subsampled plate of ``bridge`` (a ``ModelBridge``).

    ``requested``, else :data:`CHUNK_SIZE` capped so that the data's rows (the arguments whose leading dimension is
    the plate's size) take at most :data:`CHUNK_BYTES`; never fewer than the plate's minibatch.
    """
    plate = next(iter(bridge.plates.values()), None)
    if plate is None:
        return CHUNK_SIZE
    if requested is None:
        tensors = [*bridge.args, *bridge.kwargs.values()]
        row = sum(
            t[:1].numel() * t.element_size()
            for t in tensors
            if isinstance(t, Tensor) and t.ndim and len(t) == plate.size
        )
        requested = min(CHUNK_SIZE, max(1, CHUNK_BYTES // max(row, 1)))
    return max(requested, plate.subsample_size)


def data_passes(plates: dict[str, DataPlate], steps: int, *, loader: bool = False) -> float | None:
    """The full-data passes ``steps`` steps make: ``steps`` B/N for one subsampled plate, ``steps`` for none.

    With no subsampled plate every step reads all of the data (a full-batch run), unless a loader feeds the steps
    (``loader``: their size is not known here); several subsampled plates: ``None``.

    Example:
        >>> from types import SimpleNamespace
        >>> data_passes({"data": SimpleNamespace(size=1000, subsample_size=100)}, steps=50)
        5.0
        >>> data_passes({}, steps=50)  # full batch: a pass per step
        50.0

    """
    if not plates:
        return None if loader else float(steps)
    if len(plates) != 1:
        return None
    (plate,) = plates.values()
    return steps * plate.subsample_size / plate.size
