"""The kernel Stein discrepancy of any result's draws: ours, Pyro's NUTS, a guide's, or a peer's as a dict of draws.

:func:`kernel_stein_discrepancy` reads its draws as the ArviZ converter does (:mod:`pyro_scalable.sources`), so the
draws of every sampler on one model are scored the same way, from the model's full-data score; the maths, the
kernel and its metric are in :mod:`pyro_scalable.infer.stein`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from pyro_scalable.arguments import check_count, fork_rng
from pyro_scalable.infer.stein import BETA, BLOCK_SIZE, OFFSET, SteinDiscrepancy, stein_discrepancy
from pyro_scalable.sources import run_record

__all__ = ["SteinDiscrepancy", "kernel_stein_discrepancy"]


def kernel_stein_discrepancy(
    source: Any,
    model: Callable | None = None,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_samples: int = 1000,
    thin: int = 1,
    seed: int | None = None,
    scale: str | float | Tensor = "sd",
    c: float = OFFSET,
    beta: float = BETA,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
    block_size: int = BLOCK_SIZE,
) -> SteinDiscrepancy:
    """The IMQ kernel Stein discrepancy of ``source``'s draws against the model's posterior on all its data.

    Lower is better, down to ``floor`` (what as many independent exact draws give); compare draws of one model on
    one kernel (the same ``scale``) and in equal numbers, never values across models. Costs the full-data gradient
    at every draw (``draws_chunk_size`` of them per pass over the data) and :math:`O(n^2 d)` for n draws of d
    unconstrained coordinates (``thin=`` or ``num_samples=`` for fewer).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.ksd import kernel_stein_discrepancy
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
        >>> y = torch.zeros(100)                          # the posterior of mu: about N(0, 0.1²)
        >>> exact = {"mu": 0.1 * torch.randn(1000, generator=torch.Generator().manual_seed(0))}
        >>> shifted = {"mu": exact["mu"] + 0.1}           # one posterior sd off
        >>> good = kernel_stein_discrepancy(exact, model, args=(y,))
        >>> bad = kernel_stein_discrepancy(shifted, model, args=(y,), scale=good.scale)
        >>> bool(good.ksd < 2 * good.floor), bool(bad.ksd > 5 * good.ksd)
        (True, True)

    Args:
        source: what :func:`~pyro_scalable.inference_data.to_inference_data` converts: a finished
            ``StochasticMCMC`` or ``SampleThenOptimize``, a Laplace, SWAG or EKF posterior (``num_samples``
            draws), a finished ``pyro.infer.MCMC``, a Pyro guide, or a dict of constrained draws
            ``{site: (num_draws, ...)}`` with ``model`` (``mcmc.get_samples()``, a peer's draws).
        model: the Pyro model, for a dict of draws or a guide that does not know it.
        args: the model's positional arguments on the full data (a DataLoader run, a dict of draws).
        kwargs: its keyword arguments on the full data.
        num_samples: draws to take from a Gaussian posterior or a guide.
        thin: score every ``thin``-th draw of each chain.
        seed: seeds those draws.
        scale: the kernel's length scale per unconstrained coordinate: ``"sd"`` (the draws' own sd), a number
            (1.0: Gorham and Mackey's Euclidean kernel) or a ``(d,)`` tensor, e.g. a reference's ``.scale``.
        c: the IMQ kernel's offset, in units of ``scale``.
        beta: its exponent, in (-1, 0).
        data_chunk_size: data points per chunk of the full-data passes.
        draws_chunk_size: draws vectorised together in those passes.
        block_size: draws per block of the pairwise sum (memory: a few float64 block × block matrices).

    Returns:
        a :class:`~pyro_scalable.infer.stein.SteinDiscrepancy`: ``ksd`` (pooled), ``per_chain``, the unbiased
        ``ksd_squared_unbiased``, the exact-draws ``floor`` and the ``scale`` used.

    """
    check_count("thin", thin)
    check_count("draws_chunk_size", draws_chunk_size)
    check_count("block_size", block_size)
    check_count("data_chunk_size", data_chunk_size, optional=True)
    with fork_rng(seed):
        record, _ = run_record(source, model, args, kwargs, num_samples=num_samples, seed=seed)
    if thin > 1:
        record = dataclasses.replace(record, draws={k: v[:, ::thin] for k, v in record.draws.items()})
    if record.full_bridge is None:
        raise ValueError(
            "this run was given no full data (run(batches=...) only), and the KSD needs the full-data score: pass "
            "the full data as args=(x, y)."
        )
    with torch.no_grad():
        return stein_discrepancy(
            record.full_bridge,
            record.draws,
            scale=scale,
            c=c,
            beta=beta,
            data_chunk_size=data_chunk_size,
            draws_chunk_size=draws_chunk_size,
            block_size=block_size,
        )
