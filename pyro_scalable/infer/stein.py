r"""The kernel Stein discrepancy of draws against a model's posterior, from the full-data score.

For draws :math:`x_1, \dots, x_n` of the unconstrained latents and the posterior's score
:math:`s(x) = \nabla_x \log p(x \mid \mathcal{D})` (the log joint's gradient over **all** the data, the change of
variables' log-Jacobian included: the draws' density in the coordinates they live in), the Langevin Stein kernel of
a base kernel :math:`k` is

.. math::

    k_p(x, y) = \nabla_x\!\cdot\!\nabla_y k(x, y) + \nabla_x k(x, y)\cdot s(y) + \nabla_y k(x, y)\cdot s(x)
        + k(x, y)\, s(x)\cdot s(y),

whose mean under the posterior is zero in each argument, and the kernel Stein discrepancy is the V-statistic
:math:`\mathrm{KSD} = \sqrt{n^{-2}\sum_{i,j} k_p(x_i, x_j)}` (Gorham & Mackey 2017, "Measuring sample quality with
kernels", ICML; Liu, Lee & Jordan 2016). The base kernel is the inverse multiquadric
:math:`k(x, y) = (c^2 + \lVert x - y\rVert^2)^\beta` with :math:`c = 1`, :math:`\beta = -1/2`, Gorham and Mackey's
choice: for :math:`\beta \in (-1, 0)` its KSD detects non-convergence (draws that do not converge to the posterior
have a KSD bounded away from 0) for distantly dissipative targets, log-concave posteriors among them, where a Gaussian
kernel's does not (its KSD can go to 0 for draws that drift off to infinity). With
:math:`q = c^2 + r^2`, :math:`r = \lVert x - y\rVert`, in d dimensions,

.. math::

    k_p(x, y) = -2\beta d\, q^{\beta-1} - 4\beta(\beta-1)\, q^{\beta-2} r^2
        + 2\beta\, q^{\beta-1} (x - y)\cdot(s(y) - s(x)) + q^{\beta}\, s(x)\cdot s(y).

**The metric.** The KSD is not scale-invariant: :math:`c = 1` sets the distance on which two draws are compared,
so in raw coordinates a coordinate whose posterior sd is 10⁻³ sees a flat kernel and one whose sd is 10 a needle.
The draws are therefore standardised first, :math:`z = (x - \bar x)/\ell` per coordinate (the shift changes nothing;
the score of :math:`z` is :math:`\ell \odot s`), i.e. the kernel's metric is :math:`\Lambda = \mathrm{diag}(\ell^2)`,
with :math:`\ell` the draws' own sd per coordinate by default (``scale="sd"``). The KSD is then dimensionless and
unchanged when a coordinate is rescaled (its units). To compare samplers, score them all on one kernel: pass the
same ``scale`` (a reference run's ``SteinDiscrepancy.scale``) to each; ``scale=1.0`` is Gorham and Mackey's
Euclidean kernel on the unconstrained coordinates.

**U and V.** The V-statistic above is what :attr:`SteinDiscrepancy.ksd` holds: never negative (a squared norm in the
kernel's RKHS), so its root exists, but biased upwards: for n independent exact draws its square has mean
:math:`\mathbb{E}\,k_p(x, x)/n` (the off-diagonal terms have mean zero), so it does not go below about
:math:`\sqrt{\overline{k_p(x_i, x_i)}/n}` (:attr:`SteinDiscrepancy.floor`; about :math:`\sqrt{2d/n}` for a posterior
near a Gaussian with a near-diagonal covariance, :math:`k_p(x, x) = -2\beta d c^{2\beta-2} + c^{2\beta}\lVert
s(x)\rVert^2`). The U-statistic, the mean over :math:`i \ne j` only, estimates :math:`\mathrm{KSD}^2` without bias and
can be negative (:attr:`SteinDiscrepancy.ksd_squared_unbiased`). Correlated draws (a chain) raise the V-statistic
above the floor as fewer independent draws would.

**Cost.** The scores take one full-data pass per group of ``draws_chunk_size`` draws (the gradient at each of
them), the data in chunks of the subsampled plate (chunk :math:`C` of :math:`N` points weighted by :math:`C/N`, as
:func:`~pyro_scalable.infer.full_data.full_data_gradient` sums them; :func:`torch.func.vmap` over the draws, a
loop for a model it cannot batch), the gradients summed in float64. The pairwise sum is :math:`O(n^2 d)` in blocks of
``block_size`` × ``block_size`` draws (matrix products, float64, on the device of the model's data, where the draws
are moved in groups), so 10⁴ draws take a few blocks' memory, not :math:`n^2` values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.func import grad, vmap

from pyro_scalable.bridge.likelihood import data_batches
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.infer.linearized.layout import ParameterLayout

__all__ = [
    "BETA",
    "BLOCK_SIZE",
    "OFFSET",
    "SteinDiscrepancy",
    "full_data_scores",
    "stein_discrepancy",
    "stein_kernel_sums",
]

BETA = -0.5  # the IMQ kernel's exponent (Gorham & Mackey 2017: any beta in (-1, 0))
OFFSET = 1.0  # its c, in the metric's units (posterior sds with scale="sd")
BLOCK_SIZE = 1024  # draws per block of the pairwise sum: a few float64 (block x block) matrices at a time


class SteinDiscrepancy(NamedTuple):
    r"""The kernel Stein discrepancy of some draws, pooled and per chain (module docstring).

    ``ksd``: the pooled V-statistic; ``per_chain``: each chain's own, ``(chains,)``; ``ksd_squared_unbiased``: the
    pooled U-statistic of KSD² (may be negative); ``floor``: the V-statistic's expected value for as many
    independent exact draws, :math:`\sqrt{\overline{k_p(x_i, x_i)}/n}`; ``scale``: the length scale of each flat
    unconstrained coordinate (sites in the model's order), to pass as ``scale=`` when scoring other draws on the
    same kernel. All float64, on the CPU.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.bridge import ModelBridge
        >>> def model(y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with pyro.plate("data", len(y)):
        ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
        >>> bridge = ModelBridge(model, (torch.zeros(100),))  # the posterior of mu: about N(0, 0.1²)
        >>> draws = {"mu": 0.1 * torch.randn(2, 500, generator=torch.Generator().manual_seed(0))}  # 2 chains
        >>> result = stein_discrepancy(bridge, draws)
        >>> result.per_chain.shape, bool(result.ksd < 2 * result.floor)
        (torch.Size([2]), True)

    """

    ksd: Tensor
    per_chain: Tensor
    ksd_squared_unbiased: Tensor
    floor: Tensor
    scale: Tensor


def full_data_scores(
    bridge: ModelBridge,
    latents: Latents,
    *,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
) -> Tensor:
    """∇ of the full-data log joint at each of S unconstrained draws ``{site: (S, *shape)}``: ``(S, d)``, float64.

    The latents' log-Jacobian is included (it is part of the bridge's log joint); sites are flattened in the bridge's
    order. ``data_chunk_size`` defaults as for the log-likelihood
    (:func:`~pyro_scalable.bridge.likelihood.data_batches`).
    """
    layout = ParameterLayout({name: site.unconstrained_shape for name, site in bridge.sites.items()})
    num_draws = next(iter(latents.values())).shape[0]
    scores = torch.zeros(num_draws, layout.num_params, dtype=torch.float64, device=bridge.device)
    plate = next(iter(bridge.plates.values()), None)
    for batch in data_batches(bridge, data_chunk_size, draws_chunk_size):
        weight = 1.0 if plate is None else len(batch.indices[plate.name]) / plate.size
        for start in range(0, num_draws, draws_chunk_size):
            group = {name: latents[name][start : start + draws_chunk_size].to(bridge.device) for name in layout.names}
            gradients = layout.flatten(_gradients(bridge, group, batch), batch_dims=1)
            scores[start : start + gradients.shape[0]] += weight * gradients.double()
    return scores


def _gradients(bridge: ModelBridge, latents: Latents, batch: Batch) -> Latents:
    score = grad(bridge.log_posterior)
    try:
        return vmap(score, in_dims=(0, None))(latents, batch)
    except RuntimeError:  # a model vmap cannot batch: one draw at a time
        num_draws = next(iter(latents.values())).shape[0]
        rows = [score({k: v[i] for k, v in latents.items()}, batch) for i in range(num_draws)]
        return {name: torch.stack([row[name] for row in rows]) for name in latents}


def stein_kernel_sums(
    z: Tensor,
    scores: Tensor,
    chain: Tensor,
    num_chains: int,
    *,
    c: float = OFFSET,
    beta: float = BETA,
    block_size: int = BLOCK_SIZE,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sums of the IMQ Stein kernel over the pairs of n draws ``z`` ``(n, d)`` with scores ``(n, d)``.

    Returns the sum over all n² pairs, the sum over the pairs within each chain (``chain``: each draw's chain index,
    ``(n,)``) and the sum of the n diagonal terms. Symmetric blocks are computed once.
    """
    n, d = z.shape
    chain = chain.to(z.device)
    squares, products = (z * z).sum(1), (z * scores).sum(1)
    members = torch.nn.functional.one_hot(chain, num_chains).to(z.dtype)  # (n, chains)
    total = z.new_zeros(())
    per_chain = z.new_zeros(num_chains)
    for a in range(0, n, block_size):
        for b in range(a, n, block_size):
            i, j = slice(a, a + block_size), slice(b, b + block_size)
            za, sa, zb, sb = z[i], scores[i], z[j], scores[j]
            r2 = torch.addmm(squares[i, None] + squares[None, j], za, zb.T, alpha=-2).clamp_min_(0)
            # (z_i - z_j) . (s_j - s_i), expanded into products of the blocks
            cross = torch.addmm(torch.addmm(-products[i, None] - products[None, j], za, sb.T), sa, zb.T)
            inverse = (r2 + c * c).reciprocal_()
            kernel = inverse.pow(-beta)  # q^beta: one pow per block, the other powers by products
            first = kernel * inverse  # q^(beta - 1)
            values = first * (2 * beta * cross - 2 * beta * d)
            values -= 4 * beta * (beta - 1) * first * inverse * r2
            values += kernel * (sa @ sb.T)
            if a == b:  # the exact diagonal: r = 0 and the cross term vanish (the expansion leaves rounding there)
                values.diagonal().copy_(-2 * beta * d * c ** (2 * beta - 2) + c ** (2 * beta) * (sa * sa).sum(1))
            twice = 1 if a == b else 2
            total = total + twice * values.sum()
            if num_chains > 1:  # each row's sum over the column draws of its own chain
                by_chain = values @ members[j]
                per_chain.index_add_(0, chain[i], twice * by_chain.gather(1, chain[i, None]).squeeze(1))
    if num_chains == 1:
        per_chain = total.reshape(1)
    diagonal = (-2 * beta * d * c ** (2 * beta - 2) + c ** (2 * beta) * (scores * scores).sum(1)).sum()
    return total, per_chain, diagonal


def stein_discrepancy(
    bridge: ModelBridge,
    draws: Latents,
    *,
    scale: str | float | Tensor = "sd",
    c: float = OFFSET,
    beta: float = BETA,
    data_chunk_size: int | None = None,
    draws_chunk_size: int = 64,
    block_size: int = BLOCK_SIZE,
) -> SteinDiscrepancy:
    """The KSD of unconstrained ``draws`` ``{site: (chains, draws, *shape)}`` against ``bridge``'s full-data posterior.

    ``scale``: ``"sd"`` (each coordinate's sd over all the draws), a number, or a ``(d,)`` tensor of length scales of
    the flat unconstrained coordinates (a reference's :attr:`SteinDiscrepancy.scale`).
    """
    if not isinstance(c, (int, float)) or not c > 0:
        raise ValueError(f"c must be a positive number, got {c!r}.")
    if not isinstance(beta, (int, float)) or not -1 < beta < 0:
        raise ValueError(f"beta must be in (-1, 0) (Gorham and Mackey's range for the IMQ kernel), got {beta!r}.")
    layout = ParameterLayout({name: site.unconstrained_shape for name, site in bridge.sites.items()})
    num_chains, per = next(iter(draws.values())).shape[:2]
    flat = {name: draws[name].reshape((num_chains * per,) + draws[name].shape[2:]) for name in layout.names}
    scores = full_data_scores(bridge, flat, data_chunk_size=data_chunk_size, draws_chunk_size=draws_chunk_size)
    if not torch.isfinite(scores).all():
        bad = int((~torch.isfinite(scores).all(1)).sum())
        raise ValueError(
            f"the posterior's score is not finite at {bad} of the {len(scores)} draws (a log density of -inf or an "
            "overflow there): the KSD is not defined for them."
        )
    x = layout.flatten({k: v.to(bridge.device) for k, v in flat.items()}, batch_dims=1).double()
    length = _length_scales(scale, x, layout)
    z = (x - x.mean(0)) / length
    chain = torch.arange(num_chains, device=x.device).repeat_interleave(per)
    total, within, diagonal = stein_kernel_sums(
        z, scores * length, chain, num_chains, c=c, beta=beta, block_size=block_size
    )
    n = len(z)
    unbiased = (total - diagonal) / (n * (n - 1)) if n > 1 else total.new_tensor(float("nan"))
    return SteinDiscrepancy(
        ksd=(total.clamp_min(0) / n**2).sqrt().cpu(),
        per_chain=(within.clamp_min(0) / per**2).sqrt().cpu(),
        ksd_squared_unbiased=unbiased.cpu(),
        floor=(diagonal / n**2).sqrt().cpu(),
        scale=length.cpu(),
    )


def _length_scales(scale: str | float | Tensor, x: Tensor, layout: ParameterLayout) -> Tensor:
    d = layout.num_params
    if isinstance(scale, str):
        if scale != "sd":
            raise ValueError(f"scale must be 'sd', a positive number or a ({d},) tensor, got {scale!r}.")
        length = x.std(0, correction=0)
        flat = (length > 0).logical_not().nonzero().flatten().tolist()
        if flat:
            sites = sorted({layout.site_of(i) for i in flat})
            raise ValueError(
                f"{len(flat)} coordinate(s) of site(s) {sites} do not vary across the draws, so scale='sd' has no "
                "length for them: pass scale=1.0 (the Euclidean kernel) or a reference's SteinDiscrepancy.scale."
            )
        return length
    length = torch.as_tensor(scale, dtype=torch.float64, device=x.device)
    if length.shape not in ((), (d,)):
        raise ValueError(
            f"scale must be a number or a ({d},) tensor of length scales, got shape {tuple(length.shape)}."
        )
    length = length.expand(d)
    if not (torch.isfinite(length) & (length > 0)).all():
        raise ValueError(f"scale must hold positive finite length scales, got {scale!r}.")
    return length
