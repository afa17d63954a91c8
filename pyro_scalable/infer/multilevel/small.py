r"""Linear algebra on many small blocks (a group's ``p x p`` curvature) as elementwise arithmetic.

The sweep factors, solves and multiplies one ``p x p`` block per group and chain, ``p`` a group's latents (1 to a
few). Batched LAPACK calls (``torch.linalg.cholesky_ex``, ``solve_triangular``, ``cholesky_solve``, ``bmm``) treat
each of the :math:`C \times G` blocks as its own small problem, and on the CPU their per-block cost, forward and
backward, was about half of a proxy evaluation of the globals' density at 1,000 groups. Written instead as
arithmetic on the ``(..., )`` tensors of the blocks' entries, a factorisation of all blocks is :math:`O(p^3)`
vectorised operations, whatever the number of blocks, and autodiff and :func:`torch.func.vmap` pass through them as
through any arithmetic. Blocks larger than :data:`UNROLL` go to LAPACK.

The Cholesky factor :math:`A = LL^\top` is the textbook recurrence,

.. math::

    L_{jj} = \Bigl(A_{jj} - \sum_{k<j} L_{jk}^2\Bigr)^{1/2}, \qquad
    L_{ij} = \Bigl(A_{ij} - \sum_{k<j} L_{ik}L_{jk}\Bigr) / L_{jj} \quad (i > j),

and a block is positive definite exactly where every pivot under the square root is positive. Where one is not,
the block is factored as the identity instead and reported (``ok`` false), so that no infinite or undefined value
enters the computation and its gradient (the caller substitutes its own factor there).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["UNROLL", "cholesky", "cholesky_solve", "matvec", "solve_lower", "solve_lower_transposed"]

UNROLL = 4  # blocks up to this size are factored and solved elementwise


def matvec(a: Tensor, v: Tensor) -> Tensor:
    """``a @ v`` for a batch of matrices ``(..., m, n)`` and vectors ``(..., n)``, broadcasting."""
    return (a * v.unsqueeze(-2)).sum(-1)


def _pivots(a: Tensor) -> tuple[list[list[Tensor | None]], Tensor]:
    p = a.shape[-1]
    entries: list[list[Tensor | None]] = [[None] * p for _ in range(p)]
    ok = torch.ones(a.shape[:-2], dtype=torch.bool, device=a.device)
    for j in range(p):
        pivot = a[..., j, j] - sum((entries[j][k] ** 2 for k in range(j)), torch.zeros_like(a[..., j, j]))
        ok = ok & (pivot > 0)
        diagonal = pivot.clamp_min(torch.finfo(a.dtype).tiny).sqrt()
        entries[j][j] = diagonal
        for i in range(j + 1, p):
            inner = sum((entries[i][k] * entries[j][k] for k in range(j)), torch.zeros_like(a[..., i, j]))
            entries[i][j] = (a[..., i, j] - inner) / diagonal
    return entries, ok


def cholesky(a: Tensor) -> tuple[Tensor, Tensor]:
    """Lower Cholesky factors of symmetric ``(..., p, p)`` blocks, and which blocks are positive definite.

    A block that is not gets the identity's factor (module docstring).
    """
    p = a.shape[-1]
    if p > UNROLL:
        factor, info = torch.linalg.cholesky_ex(a)
        return factor, info == 0
    _, ok = _pivots(a.detach())
    eye = torch.eye(p, dtype=a.dtype, device=a.device)
    entries, _ = _pivots(torch.where(ok[..., None, None], a, eye))
    zero = torch.zeros_like(a[..., 0, 0])
    rows = [torch.stack([entries[i][j] if j <= i else zero for j in range(p)], -1) for i in range(p)]
    return torch.stack(rows, -2), ok


def solve_lower(factor: Tensor, b: Tensor) -> Tensor:
    """``x`` with ``L x = b`` for lower-triangular ``L`` ``(..., p, p)`` and ``b`` ``(..., p)``."""
    p = factor.shape[-1]
    if p > UNROLL:
        return torch.linalg.solve_triangular(factor, b.unsqueeze(-1), upper=False).squeeze(-1)
    x: list[Tensor] = []
    for i in range(p):
        inner = sum((factor[..., i, k] * x[k] for k in range(i)), torch.zeros_like(b[..., i]))
        x.append((b[..., i] - inner) / factor[..., i, i])
    return torch.stack(x, -1)


def solve_lower_transposed(factor: Tensor, b: Tensor) -> Tensor:
    """``x`` with ``L^T x = b`` for lower-triangular ``L`` ``(..., p, p)`` and ``b`` ``(..., p)``."""
    p = factor.shape[-1]
    if p > UNROLL:
        return torch.linalg.solve_triangular(factor.transpose(-1, -2), b.unsqueeze(-1), upper=True).squeeze(-1)
    x: list[Tensor | None] = [None] * p
    for i in reversed(range(p)):
        inner = sum((factor[..., k, i] * x[k] for k in range(i + 1, p)), torch.zeros_like(b[..., i]))
        x[i] = (b[..., i] - inner) / factor[..., i, i]
    return torch.stack(x, -1)


def cholesky_solve(b: Tensor, factor: Tensor) -> Tensor:
    """``x`` with ``L L^T x = b``: ``b`` ``(..., p)``, ``L`` ``(..., p, p)`` lower triangular."""
    return solve_lower_transposed(factor, solve_lower(factor, b))
