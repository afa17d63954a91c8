r"""Sample-then-optimise on several processes under ``torch.distributed`` (launched by ``torchrun``).

The counterpart of :mod:`pyro_scalable.infer.distributed` (SG-MCMC) for ``SampleThenOptimize(...,
distributed="samples" | "data")``. Every rank seeds its generator with rank 0's seed
and consumes it exactly as one process would (the linearisation point, the step size's power iterations, the
minibatch indices), so everything that is not split is the same on every rank.

**Sample-parallel** (``"samples"``): rank :math:`r` solves its contiguous block of the :math:`K` sample rows (sizes
differ by at most one). Every rank draws the prior noise :math:`\varepsilon` of all :math:`K` rows, and each data
chunk's :math:`\xi_i` of all :math:`K` rows, and keeps its block's: the union of the blocks is exactly the draws
of one process (a transient :math:`K \times d` tensor, as in one process). The mean row is one more row of the
batched solve on every rank; rank 0's is broadcast after each solve, so that every rank centres its draws on, and
takes the EM step from, the same :math:`\bar\theta`. EM's estimate :math:`\hat\gamma_g = \frac1K\sum_j
\sum_{k\in g}\zeta_{jk}(M\zeta_j)_k` is a sum over the samples: each rank sums its block per group and one
all-reduce (a sum) completes it, so every rank applies the same prior-precision update. At the end rank 0 gathers
every rank's rows, diagnostics and trace.

**Data-parallel** (``"data"``): every rank solves every row. Each minibatch, and each chunk of a full-data pass,
is cut into shares (the indices at positions :math:`r, r + R, \ldots` of the batch, :math:`R` ranks); rank
:math:`r` evaluates its share's sum :math:`\sum_{i} J_i^\top\Lambda_i J_i v` (or, in the data pass,
:math:`\sum_i J_i^\top(\Lambda_i^{1/2}\xi_i, \nabla_f \log p_i)`, with :math:`\xi` drawn for the whole chunk
and cut the same way) and an all-reduce adds the shares. The products are sums over points, so the result is the
one-process product up to the order of floating-point sums, and every rank takes the same steps. The MAP search,
the linearity check and the g-prior's diagonal run whole on every rank.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pyro_scalable.bridge.model import DataPlate
from pyro_scalable.infer.distributed import broadcast_seed
from pyro_scalable.infer.linearized.sampling import core
from pyro_scalable.infer.linearized.sampling.plan import OneProcess

__all__ = ["DataShards", "DistributedMode", "SampleBlocks", "setup"]

DistributedMode = Literal["samples", "data"]


def setup(mode: DistributedMode | None, num_samples: int, plate: DataPlate | None) -> OneProcess:
    """The run's parallel plan on the default process group (:class:`OneProcess` for ``None``)."""
    if mode is None:
        return OneProcess(num_samples)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"distributed={mode!r} needs torch.distributed's default process group: launch with torchrun and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') before run()."
        )
    return SampleBlocks(num_samples) if mode == "samples" else DataShards(num_samples, plate)


class SampleBlocks(OneProcess):
    """Split the K sample rows across the ranks in contiguous blocks; gather them on rank 0."""

    def __init__(self, num_samples: int):
        super().__init__(num_samples)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if num_samples < self.world_size:
            raise ValueError(
                f"distributed='samples' splits num_samples={num_samples} over {self.world_size} ranks; use "
                f"num_samples >= {self.world_size}, or distributed='data'."
            )
        sizes = [num_samples // self.world_size + (r < num_samples % self.world_size) for r in range(self.world_size)]
        start = sum(sizes[: self.rank])
        self.rows = slice(start, start + sizes[self.rank])

    def seed(self, seed: int, device: torch.device) -> int:
        return broadcast_seed(seed, device)

    def mean_over_samples(self, x: Tensor, local: int) -> Tensor:
        return _sum(x * local) / self.num_samples

    def agree(self, state: core.SampleState) -> core.SampleState:
        mean = state.samples[-1:].clone()
        dist.broadcast(mean, src=0)
        state.samples[-1:] = mean  # in place: the rows keep their buffer (core.with_anchor)
        return state

    def gather(self, state: core.SampleState, stats: dict[str, Tensor], trace: dict[str, list[Tensor]]):
        """Rows ``[:-1]`` of every rank in rank order, then rank 0's mean row (the same on every rank)."""
        anchored_rows = state.anchor.shape[0] > 1  # variance_reduction="all": one anchor per row
        mine = {
            "state": {k: v.detach().cpu() for k, v in state._asdict().items()},
            "stats": {k: v.cpu() for k, v in stats.items()},
            "trace": {k: torch.stack(v).cpu() if v else None for k, v in trace.items()},
        }
        parts: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(mine, parts, dst=0)
        if not self.is_main:
            return state, stats, trace
        device = state.samples.device

        def rows(values: list[Tensor], dim: int = 0) -> Tensor:
            blocks = [v.narrow(dim, 0, v.shape[dim] - 1) for v in values]
            return torch.cat([*blocks, values[0].narrow(dim, values[0].shape[dim] - 1, 1)], dim).to(device)

        fields = dict(state._asdict())
        per_row = ("samples", "targets") + (("velocity",) if state.velocity.numel() else ())  # none after CG
        per_row += ("anchor", "anchor_product") if anchored_rows else ()
        for name in per_row:
            fields[name] = rows([p["state"][name] for p in parts])
        stats = {k: torch.cat([p["stats"][k] for p in parts]).to(device) for k in stats}
        trace = {
            k: [] if v is None else list(rows([p["trace"][k] for p in parts], dim=1).cpu().unbind(0))
            for k, v in mine["trace"].items()
        }
        return core.SampleState(**fields), stats, trace


class DataShards(OneProcess):
    """Cut every batch of points into one share per rank and all-reduce the sums; every rank solves every row."""

    def __init__(self, num_samples: int, plate: DataPlate | None):
        super().__init__(num_samples)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if plate is None:
            raise ValueError(
                "distributed='data' splits the data plate's minibatches, and the model has no subsampled plate: "
                "give the data plate a subsample_size, or use distributed='samples'."
            )
        if plate.subsample_size < self.world_size:
            raise ValueError(
                f"distributed='data' splits plate '{plate.name}''s minibatch of {plate.subsample_size} over "
                f"{self.world_size} ranks; use subsample_size >= {self.world_size}."
            )
        self.share = slice(self.rank, None, self.world_size)

    def seed(self, seed: int, device: torch.device) -> int:
        return broadcast_seed(seed, device)

    def sum_over_data(self, x: Tensor) -> Tensor:
        return _sum(x)


def _sum(x: Tensor) -> Tensor:
    total = x.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total
