r"""``StochasticMCMC`` on several processes under ``torch.distributed`` (launched by ``torchrun``).

The script run by ``torchrun --nproc_per_node=K`` initialises the default process group
(``torch.distributed.init_process_group("gloo")``, or ``"nccl"`` with each rank's data on ``cuda:LOCAL_RANK``) and
then calls ``StochasticMCMC(..., distributed="data" | "chains")`` as usual.

**Data-parallel** (``"data"``): every rank runs every chain. All ranks draw the same minibatch indices (the seed is
broadcast from rank 0 and every rank consumes its generator identically); rank :math:`r` evaluates only its share
:math:`\mathcal{B}_r` (the indices at positions :math:`r, r + K, \ldots` of the plate's :math:`B`),
:math:`n_r = |\mathcal{B}_r|`. The plate scales the share by :math:`N/n_r`, so the rank's estimate
:math:`\hat\ell_r = \log p(\theta) + \frac{N}{n_r}\sum_{i\in\mathcal{B}_r}\log p(y_i\mid\theta)` is unbiased on
its own, and the weighted mean

.. math::

    \sum_r \frac{n_r}{B}\,\hat\ell_r = \log p(\theta) + \frac{N}{B}\sum_{i\in\mathcal{B}}\log p(y_i\mid\theta)

is the one-process estimate on the whole minibatch. Being linear in :math:`\hat\ell`, the gradient and warm-up's
Hessian-vector product combine the same way (one all-reduce, a sum, carries all three). ``diverging`` is the OR
of the ranks' flags and of the pooled values' non-finiteness; ``grad_norm`` is recomputed from the pooled gradient.

The per-example noise estimate pools exactly (Chan, Golub & LeVeque, 1979): rank :math:`r` has the mean
:math:`m_r` of its :math:`n_r` per-example gradients and :math:`\hat V_r = (1 - n_r/N)\,s_r^2/n_r` (see
:mod:`.base`), so with :math:`\bar m = \sum_r n_r m_r / B`

.. math::

    s^2 = \frac{\sum_r (n_r - 1)\,s_r^2 + \sum_r n_r (m_r - \bar m)^2}{B - 1}, \qquad
    \hat V = \Bigl(1 - \frac{B}{N}\Bigr)\frac{s^2}{B},

the sample variance of all :math:`B` per-example gradients. A second all-reduce, once :math:`\bar m` is known, sums
the bracket (centred terms: no cancellation of large raw sums of squares).

The update then draws its noise from a generator seeded and consumed identically on every rank, so every rank takes
the same step: :math:`K` ranks give the chain of one process on the whole minibatch, up to the order of
floating-point sums. Normalising between power iterations is not linear, so a warm-up step with several power
iterations all-reduces each Hessian-vector product before normalising it.

**Chain-parallel** (``"chains"``): rank :math:`r` runs its own contiguous block of the chains (sizes differ by at
most one), starting from the same initial points as a one-process run, with a generator seeded from
``(seed, r)``; there is no communication until the end, when rank 0 gathers every rank's draws and statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from pyro_scalable.bridge.model import Batch, DataPlate, Latents
from pyro_scalable.infer.distributed import all_reduce_sum
from pyro_scalable.infer.gradients import GradientEstimate

__all__ = ["ChainParallel", "DataParallel", "DistributedMode", "Gathered", "normalised_per_chain", "setup"]

DistributedMode = Literal["data", "chains"]
_SEED_STRIDE = 1_000_003  # chain-parallel generators: seed * stride + rank (distinct for any rank < stride)


def setup(
    mode: DistributedMode | None, plates: Mapping[str, DataPlate], num_chains: int, *, sharded: bool
) -> DataParallel | ChainParallel | None:
    """The run's parallel plan on the default process group (``None`` for a one-process run).

    ``sharded=False`` (a ``batches=`` loader feeds the steps): each rank's loader already yields its own share, of
    the same size on every rank.
    """
    if mode is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"distributed={mode!r} needs torch.distributed's default process group: launch with torchrun and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') before run()."
        )
    return DataParallel(plates, sharded=sharded) if mode == "data" else ChainParallel(num_chains)


class Gathered(NamedTuple):
    """The run's draws and statistics after the ranks' gather; a count that changed (``None``: as it was)."""

    draws: dict
    stats: dict
    num_chains: int | None = None
    num_samples: int | None = None


class DataParallel:
    """Split every minibatch across the ranks and all-reduce the gradient estimates; every rank runs every chain.

    Args:
        plates: the model's subsampled plates; the one with the largest ``subsample_size`` is split.
        sharded: ``False`` when a ``batches=`` loader gives each rank its own (equal) share already.

    """

    def __init__(self, plates: Mapping[str, DataPlate], *, sharded: bool = True):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.sharded = sharded
        self.plate = max(plates.values(), key=lambda p: p.subsample_size, default=None)
        if sharded and self.plate is None:
            raise ValueError(
                "distributed='data' splits the minibatch of a subsampled plate, and the model has none: give the "
                "data plate a subsample_size, or use distributed='chains'."
            )
        if sharded and self.plate.subsample_size < self.world_size:
            raise ValueError(
                f"distributed='data' splits plate '{self.plate.name}''s minibatch of {self.plate.subsample_size} "
                f"over {self.world_size} ranks; use subsample_size >= {self.world_size}."
            )
        if sharded:
            self.weight = float(len(range(self.rank, self.plate.subsample_size, self.world_size)))
            self.total = float(self.plate.subsample_size)
        else:
            self.weight, self.total = 1.0, float(self.world_size)

    is_main = property(lambda self: self.rank == 0)

    def noise_seed(self, seed: int) -> int:
        """The seed of the run's generator: the same on every rank."""
        return seed

    def local_chains(self, latents: Latents) -> Latents:
        """Every chain runs on every rank."""
        return latents

    def shard(self, batch: Batch) -> Batch:
        """Cut ``batch`` to this rank's share: every ``world_size``-th index of the split plate, from ``rank``."""
        if not self.sharded:
            return batch
        name = self.plate.name
        return batch._replace(indices={**batch.indices, name: batch.indices[name][..., self.rank :: self.world_size]})

    def reduce(self, estimate: GradientEstimate, population_size: float | None = None) -> GradientEstimate:
        """The whole minibatch's estimate from every rank's (chains stacked on dim 0; the same on every rank).

        ``population_size`` is the N the rank's noise estimate was computed with (``math.inf`` for minibatches
        drawn with replacement: no finite-population correction); needed only where it has one.
        """
        w = self.weight
        linear = [*estimate.grads.values(), estimate.log_posterior, *estimate.hessian_product.values()]
        summed = all_reduce_sum([w * x for x in linear] + [estimate.diverging, estimate.num_examples])
        *summed, flags, count = summed
        mean = [x / self.total for x in summed]
        names = list(estimate.grads)
        grads = dict(zip(names, mean[: len(names)], strict=True))
        log_posterior = mean[len(names)]
        hessian_product = dict(zip(estimate.hessian_product, mean[len(names) + 1 :], strict=True))
        noise_variance = {}
        if estimate.noise_variance:
            if population_size is None:
                raise ValueError("pooling the gradient-noise estimate needs the population_size it was made with.")
            noise_variance = _pool_noise(estimate, grads, count, population_size)
        grad_sq = sum(_per_chain_sum(g.square()) for g in grads.values())
        finite = torch.isfinite(log_posterior) & torch.isfinite(grad_sq)
        for v in noise_variance.values():
            finite = finite & torch.isfinite(v).reshape(v.shape[0], -1).all(1)
        diverging = (flags > 0) | ~finite
        return GradientEstimate(grads, log_posterior, grad_sq.sqrt(), diverging, noise_variance, count, hessian_product)

    def gather(self, draws: dict, stats: dict) -> Gathered:
        """Nothing to gather: every rank holds every chain."""
        return Gathered(draws, stats)


class ChainParallel:
    """Split the chains across the ranks (no communication while sampling); gather the draws on rank 0."""

    def __init__(self, num_chains: int):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if num_chains < self.world_size:
            raise ValueError(
                f"distributed='chains' splits num_chains={num_chains} over {self.world_size} ranks; use "
                f"num_chains >= {self.world_size}, or distributed='data'."
            )
        sizes = [num_chains // self.world_size + (r < num_chains % self.world_size) for r in range(self.world_size)]
        self.start = sum(sizes[: self.rank])
        self.stop = self.start + sizes[self.rank]

    is_main = property(lambda self: self.rank == 0)

    def noise_seed(self, seed: int) -> int:
        """Seed this rank's generator distinctly, so that its chains draw their own minibatches and noise."""
        return (seed * _SEED_STRIDE + self.rank) % 2**63

    def local_chains(self, latents: Latents) -> Latents:
        """Keep this rank's chains' initial points (the same as those chains' in a one-process run)."""
        return {name: x[self.start : self.stop] for name, x in latents.items()}

    def shard(self, batch: Batch) -> Batch:
        return batch

    def gather(self, draws: dict, stats: dict) -> Gathered:
        """Rank 0 receives every rank's draws and statistics, in chain order; other ranks keep their own chains.

        A rank stopped early by a divergence has fewer draws: every rank's are cut to the shortest.
        """
        parts = [None] * self.world_size if self.is_main else None
        dist.gather_object((draws, stats), parts, dst=0)
        if not self.is_main:
            return Gathered(draws, stats, num_chains=self.stop - self.start)
        kept = min(next(iter(d.values())).shape[1] for d, _ in parts)
        names = set.intersection(*(set(s) for _, s in parts))
        draws = {k: torch.cat([d[k][:, :kept] for d, _ in parts]) for k in draws}
        stats = {k: torch.cat([s[k][:, :kept] for _, s in parts]) for k in stats if k in names}
        return Gathered(draws, stats, num_samples=kept)


def _pool_noise(estimate: GradientEstimate, mean: Latents, count: Tensor, population: float) -> Latents:
    """The noise estimate of all ``count`` examples from each rank's (module docstring; a second all-reduce)."""
    n_r = estimate.num_examples
    spread = []
    for name, v in estimate.noise_variance.items():
        n = _like(n_r, v)
        local_var = v * n / (1.0 - n / population)  # s_r^2 from V_r = (1 - n_r/N) s_r^2 / n_r
        spread.append((n - 1.0) * local_var + n * (estimate.grads[name] - mean[name]).square())
    pooled = all_reduce_sum(spread)
    result = {}
    for name, s in zip(estimate.noise_variance, pooled, strict=True):
        n = _like(count, s)
        result[name] = (1.0 - n / population) * s / ((n - 1.0) * n)
    return result


def _per_chain_sum(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1).sum(1)


def _like(per_chain: Tensor, x: Tensor) -> Tensor:
    """A per-chain ``(C,)`` tensor shaped to broadcast against ``x`` of shape ``(C, ...)``."""
    return per_chain.to(x.dtype).reshape(per_chain.shape + (1,) * (x.dim() - per_chain.dim()))


def normalised_per_chain(vector: Latents) -> Latents:
    """Each chain's slice of ``vector`` (sites stacked on dim 0) scaled to unit norm over all sites."""
    norm = sum(_per_chain_sum(p.square()) for p in vector.values()).sqrt()
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return {name: p / _like(safe, p) for name, p in vector.items()}
