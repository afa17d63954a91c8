r"""The rows' log-likelihood to second order at a reference point, per group: the sweep's proxy on tall data.

Group :math:`k`'s rows contribute :math:`R_k(\theta, b_k) = \sum_{g(i)=k} \log p(y_i \mid \theta, b_k)` to the log
joint; only these terms grow with the number of rows :math:`N`. At a reference point :math:`(\bar\theta, \bar b)`
(each chain's own, renewed at warm-up's window ends), with :math:`\delta = \theta - \bar\theta` and
:math:`\Delta_k = b_k - \bar b_k`, the proxy is the second-order Taylor expansion

.. math::

    q_k(\theta, b_k) = g_k^\top \Delta_k + \tfrac12 \Delta_k^\top \Big(H_k + \sum_j T_{kj}\delta_j\Big)
    \Delta_k + \Delta_k^\top C_k \delta, \qquad q_0(\theta) = \gamma^\top \delta + \tfrac12 \delta^\top
    \Gamma \delta,

:math:`R(\theta, b) \approx \sum_k R_k(\bar\theta, \bar b_k) + q_0(\theta) + \sum_k q_k(\theta, b_k)`, with
:math:`g_k = \nabla_{b_k} R`, :math:`H_k = \nabla^2_{b_k} R`, :math:`C_k = \nabla_{b_k}\nabla_\theta R` (each
group's own blocks: :math:`b_k` enters only its rows), :math:`T_{kj} = \partial_{\theta_j} H_k` and the globals'
totals :math:`\gamma = \nabla_\theta R`, :math:`\Gamma = \nabla^2_\theta R`, all at the reference. The one
third-order term kept, :math:`T`, is the one that grows with the number of groups: a global that scales every
group's rows (a noise scale) changes every group's curvature, and without it the proxy's error would be of order
:math:`G\,|\delta|`; what is left is of order :math:`G|\delta|^2 + N|\delta|^3` and the groups' own third
derivatives. :func:`fit` gets them by autodiff in one gradient, :math:`d + p` Hessian-vector products and
:math:`dp` third-order products (every group's block at once: the blocks are independent); evaluating the proxy costs
:math:`O(G p^2 d)`, nothing per row.

The proxy is HMCECS's (a Taylor expansion of the log-likelihood at a reference), summed by group instead of by
row. It is never the target: the sweep's moves run on it and then correct to the exact density in a second,
delayed-acceptance stage (:func:`~.mala.hmc`'s ``correct``), which reads every row once, forward only. The priors
(global and per group) are evaluated exactly; only the rows' terms are expanded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.func import grad

from pyro_scalable.infer.multilevel.rows import wide
from pyro_scalable.infer.multilevel.small import matvec

__all__ = ["Taylor", "fit"]


class Taylor(NamedTuple):
    """One chain's proxy coefficients (module docstring), in double precision."""

    theta: Tensor  # (d,): the reference globals
    b: Tensor  # (G, p): the reference locals
    gamma: Tensor  # (d,)
    big_gamma: Tensor  # (d, d)
    g: Tensor  # (G, p)
    h: Tensor  # (G, p, p)
    c: Tensor  # (G, p, d)
    t: Tensor  # (G, p, p, d)

    def curvature(self, theta: Tensor) -> Tensor:
        r"""Each group's :math:`H_k + \sum_j T_{kj}\delta_j` at ``theta`` (``(G, p, p)``)."""
        return self.h + self.t @ (wide(theta) - self.theta)

    def groups(self, theta: Tensor, b: Tensor) -> Tensor:
        r"""Each group's :math:`q_k(\theta, b_k)` (``(G,)``; ``b`` may hold a subset's rows with this proxy's)."""
        delta, change = wide(theta) - self.theta, wide(b) - self.b
        curvature = matvec(self.curvature(theta), change)  # (G, p): H_k(theta) Delta_k
        return (change * (self.g + 0.5 * curvature + self.c @ delta)).sum(-1)

    def globals(self, theta: Tensor) -> Tensor:
        r"""The globals' part :math:`q_0(\theta)`."""
        delta = wide(theta) - self.theta
        return self.gamma @ delta + 0.5 * delta @ self.big_gamma @ delta

    def gradient_b(self, theta: Tensor, b: Tensor) -> Tensor:
        r""":math:`\nabla_{b_k} q_k` at ``(theta, b)`` (``(G, p)``): the groups' proxy gradient in their locals."""
        delta, change = wide(theta) - self.theta, wide(b) - self.b
        return self.g + matvec(self.curvature(theta), change) + self.c @ delta

    def subset(self, drawn: Tensor) -> Taylor:
        """The proxy of the groups ``drawn`` only."""
        return self._replace(b=self.b[drawn], g=self.g[drawn], h=self.h[drawn], c=self.c[drawn], t=self.t[drawn])


def fit(rows: Callable[[Tensor, Tensor], Tensor], theta: Tensor, b: Tensor, read: list[int] | None = None) -> Taylor:
    """The proxy of ``rows`` (one chain's ``(theta, b) -> (G,)`` group sums of the rows' terms) at ``(theta, b)``.

    ``read``: the globals the rows read (default: all); the others' columns are zero without a product each.
    """
    total = lambda t, x: rows(t, x).sum()  # noqa: E731
    gamma, g = grad(total, argnums=(0, 1))(theta, b)
    d, p = theta.shape[-1], b.shape[-1]
    zero = (theta.new_zeros(d), b.new_zeros(b.shape), b.new_zeros(b.shape + (p,)))
    rows_of_gamma, c_columns, t_columns = [], [], []
    for j in range(d):  # reverse over reverse: column j of Gamma and of every C_k
        if read is not None and j not in read:
            rows_of_gamma.append(zero[0])
            c_columns.append(zero[1])
            t_columns.append(zero[2])
            continue
        along = lambda t, x, j=j: grad(total, argnums=0)(t, x)[j]  # noqa: E731
        column, block = grad(along, argnums=(0, 1))(theta, b)
        rows_of_gamma.append(column)
        c_columns.append(block)
        third = []  # and once more along e_m in every group's block: T_k[:, m, j]
        for m in range(p):
            once_more = lambda t, x, m=m, along=along: grad(along, argnums=1)(t, x)[..., m].sum()  # noqa: E731
            third.append(grad(once_more, argnums=1)(theta, b))
        t_columns.append(torch.stack(third, -1))
    h_columns = []
    for j in range(p):  # the tangent e_j in every group's block at once: column j of every H_k
        along = lambda t, x, j=j: grad(total, argnums=1)(t, x)[..., j].sum()  # noqa: E731
        h_columns.append(grad(along, argnums=1)(theta, b))
    empty = b.new_zeros(b.shape + (0,))
    return Taylor(
        wide(theta),
        wide(b),
        wide(gamma),
        wide(torch.stack(rows_of_gamma, -1)) if d else wide(theta.new_zeros(0, 0)),
        wide(g),
        wide(torch.stack(h_columns, -1)),
        wide(torch.stack(c_columns, -1)) if d else wide(empty),
        wide(torch.stack(t_columns, -1)) if d else wide(empty.unsqueeze(-2).expand(*b.shape, p, 0)),
    )
