"""Helpers for runs on several processes under ``torch.distributed`` (launched by ``torchrun``).

What every engine's distributed mode shares: the seed broadcast from rank 0, and a sum over the ranks of many
tensors in one collective. The engines' own plans are :mod:`pyro_scalable.infer.sgmcmc.distributed`
(``StochasticMCMC(..., distributed="data" | "chains")``) and
:mod:`pyro_scalable.infer.sample_then_optimize.distributed`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_sum", "broadcast_seed"]


def broadcast_seed(seed: int, device: torch.device) -> int:
    """Rank 0's seed, on every rank (``device``: where the backend communicates, e.g. ``cuda:LOCAL_RANK``)."""
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(value, src=0)
    return int(value.item())


def all_reduce_sum(tensors: list[Tensor]) -> list[Tensor]:
    """Sum each tensor over the ranks, in one collective (flattened into one buffer of the first's dtype)."""
    dtype = tensors[0].dtype
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].reshape(t.shape))
        start += t.numel()
    return out
