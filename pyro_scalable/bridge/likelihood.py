"""Full-data pointwise log-likelihood of many draws, in chunks of data and of draws.

ArviZ's ``log_likelihood`` group (for ``az.loo``/``az.waic``) needs ``log p(y_i | θ_s)`` for every data point i
and draw s. A minibatch would bias every criterion, so this evaluates the whole data set, but never all of it at
once: the first subsampled plate is walked in chunks (other subsampled plates run in full), and draws are
vectorised with ``torch.func.vmap`` in groups, falling back to a loop for models vmap cannot batch.

The model runs in its data's dtype; each chunk's values are written straight into one preallocated output (of
``out_dtype``), so the peak memory is that output, ``S × N × itemsize``, plus one chunk's work, about
``draws_chunk_size × data_chunk_size`` values per intermediate of the model (2^20 by default). Where the output has
:data:`PROGRESS_VALUES` values or more, a progress bar counts the chunks and names the output's size.

Points a model masks out (``poutine.mask``, ``dist.mask``) are not observed: the log density there is no term of
the likelihood, and a criterion over the pointwise log-likelihood must not count them. :func:`observed_masks` says
which points each observed site observes, read from one trace of the model on the full data (a mask that depends
on the data only, as masks of missing values do).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from pyro.distributions.torch_distribution import MaskedDistribution
from torch import Tensor
from torch.func import vmap
from tqdm.auto import tqdm

from pyro_scalable.bridge.minibatches import chunks
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge

__all__ = [
    "CHUNK_VALUES",
    "PROGRESS_VALUES",
    "chunk_dim",
    "data_batches",
    "full_data_log_likelihood",
    "log_likelihood_pieces",
    "observed_masks",
]

CHUNK_VALUES = 2**20  # draws x data points per chunk by default: a few MB per intermediate, few calls of the model
PROGRESS_VALUES = 10**8  # an output this large (0.4-0.8 GB) takes long enough to show a progress bar


def full_data_log_likelihood(
    bridge: ModelBridge,
    latents: Latents,
    *,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
    out_device: torch.device | str = "cpu",
    out_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """``{observed site: (S, *batch_shape)}`` for unconstrained ``latents`` with a leading draw dimension S.

    ``data_chunk_size`` defaults to ``max(B, 1024, CHUNK_VALUES / draws_chunk_size)`` points; ``out_dtype`` is the
    output's dtype (default: the model's, that is the data's).
    """
    num_draws = next(iter(latents.values())).shape[0]
    plate = next(iter(bridge.plates.values()), None)
    values_out = num_draws * (plate.size if plate is not None else 1)
    itemsize = torch.empty((), dtype=out_dtype or torch.get_default_dtype()).element_size()
    batches = data_batches(bridge, data_chunk_size, draws_chunk_size)
    bar = tqdm(
        total=len(batches),
        desc=f"log-likelihood ({values_out * itemsize / 2**30:.1f} GB per site)",
        disable=values_out < PROGRESS_VALUES,
    )
    out: dict[str, Tensor] = {}
    for batch in batches:
        for offset, start, values in log_likelihood_pieces(bridge, latents, batch, draws_chunk_size):
            for name, value in values.items():
                dim = chunk_dim(bridge, name)
                if name not in out:
                    shape = list(value.shape)
                    if dim is not None:
                        shape[dim] = plate.size
                    shape[0] = num_draws
                    out[name] = torch.empty(shape, dtype=out_dtype or value.dtype, device=out_device)
                target = out[name][start : start + value.shape[0]]
                if dim is not None:
                    target = target.narrow(dim, offset, value.shape[dim])
                target.copy_(value)
        bar.update()
    bar.close()
    return out


def data_batches(bridge: ModelBridge, data_chunk_size: int | None = None, draws_chunk_size: int = 64) -> list[Batch]:
    """The full data as batches of ``data_chunk_size`` points of the first subsampled plate (one batch without one).

    ``data_chunk_size`` defaults to ``max(B, 1024, CHUNK_VALUES / draws_chunk_size)``.
    """
    plate = next(iter(bridge.plates.values()), None)
    full = bridge.full_batch()
    if plate is None:
        return [full]
    size = data_chunk_size or max(plate.subsample_size, 1024, CHUNK_VALUES // draws_chunk_size)
    return [
        Batch({**full.indices, plate.name: idx}, full.args, full.kwargs)
        for idx in chunks(plate.size, size, bridge.device)
    ]


def log_likelihood_pieces(
    bridge: ModelBridge, latents: Latents, batch: Batch, draws_chunk_size: int = 64
) -> Iterator[tuple[int, int, dict[str, Tensor]]]:
    """``(offset, start, {site: (draws, *batch)})`` for each group of ``draws_chunk_size`` draws on ``batch``.

    ``offset`` is the batch's first point along the chunked plate (a site's dimension :func:`chunk_dim`), ``start``
    the group's first draw. A site outside that plate comes with the first batch only (offset 0).
    """
    plate = next(iter(bridge.plates.values()), None)
    offset = int(batch.indices[plate.name][0]) if plate is not None else 0
    num_draws = next(iter(latents.values())).shape[0]
    for start in range(0, num_draws, draws_chunk_size):
        group = {name: x[start : start + draws_chunk_size].to(bridge.device) for name, x in latents.items()}
        values = _pointwise(bridge, group, batch)
        yield (
            offset,
            start,
            {k: v.detach() for k, v in values.items() if offset == 0 or chunk_dim(bridge, k) is not None},
        )


def chunk_dim(bridge: ModelBridge, site: str) -> int | None:
    """The (negative) dimension of ``site``'s pointwise values along which the data is chunked, or ``None``."""
    return _plate_dim(bridge, site, next(iter(bridge.plates.values()), None))


def _plate_dim(bridge: ModelBridge, site: str, plate) -> int | None:
    if plate is None:
        return None
    for dim, name in bridge.observed[site].items():
        if name == plate.name:
            return dim
    return None


def _pointwise(bridge: ModelBridge, latents: Latents, batch: Batch) -> dict[str, Tensor]:
    with torch.no_grad():
        try:
            return vmap(bridge.pointwise_log_likelihood, in_dims=(0, None))(latents, batch)
        except RuntimeError:
            draws = next(iter(latents.values())).shape[0]
            rows = [bridge.pointwise_log_likelihood({k: v[s] for k, v in latents.items()}, batch) for s in range(draws)]
            return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}


def observed_masks(bridge: ModelBridge) -> dict[str, Tensor]:
    """``{observed site: bool (*batch_shape)}``, True where the point is observed, for the sites that mask points.

    A site's mask is the product of its ``poutine.mask`` and a masked distribution's mask (``dist.mask(m)``),
    broadcast to the shape of its pointwise log-likelihood; sites that observe every point are left out.
    """
    trace = bridge.trace_at({})
    masks = {}
    for name in bridge.observed:
        node = trace.nodes[name]
        fn, value = node["fn"], node["value"]
        shape = torch.broadcast_shapes(fn.batch_shape, value.shape[: value.dim() - fn.event_dim])
        mask = torch.ones(shape, dtype=torch.bool, device=value.device)
        for part in (node["mask"], fn._mask if isinstance(fn, MaskedDistribution) else None):
            if part is not None:
                mask = mask & torch.as_tensor(part, dtype=torch.bool, device=value.device)
        if not bool(mask.all()):
            masks[name] = mask.expand(shape)
    return masks
