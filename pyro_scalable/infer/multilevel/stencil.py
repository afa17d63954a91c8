r"""Central differences of many independent ``p``-dimensional functions at once: their gradients and Hessians.

For a function :math:`f` of :math:`x \in \mathbb{R}^p` and widths :math:`w`, the :func:`stencil` holds the centre,
:math:`\pm e_j` and :math:`\pm(e_j + e_l)` for :math:`j < l` (:math:`1 + p + p^2` points, scaled by :math:`w` where
used). From the changes :math:`\Delta(s) = f(x + w \odot s) - f(x)` at its points, :func:`derivatives` gives

.. math::

    \partial_j f \approx \frac{\Delta(e_j) - \Delta(-e_j)}{2 w_j}, \qquad
    \partial_j^2 f \approx \frac{\Delta(e_j) + \Delta(-e_j)}{w_j^2}, \qquad
    \partial_j \partial_l f \approx \frac{\Delta(e_j + e_l) + \Delta(-e_j - e_l) - \sum_{\pm}
    [\Delta(\pm e_j) + \Delta(\pm e_l)]}{2 w_j w_l},

each exact for a quadratic :math:`f`, with an error of order :math:`w^2` otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["derivatives", "stencil"]


def stencil(p: int, like: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
    """The stencil's points ``(1 + p + p^2, p)`` (the centre first; dtype and device of ``like``) and its pairs."""
    eye = torch.eye(p, dtype=like.dtype, device=like.device)
    pairs = [(j, k) for j in range(p) for k in range(j + 1, p)]
    steps = [eye[0] * 0] + [s * eye[j] for j in range(p) for s in (1, -1)]
    steps += [s * (eye[j] + eye[k]) for j, k in pairs for s in (1, -1)]
    return torch.stack(steps), pairs


def derivatives(changes: Tensor, width: Tensor, pairs: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """Gradients ``(G, p)`` and Hessians ``(G, p, p)`` from the changes ``(S - 1, G)`` at the stencil's other points.

    ``width``: ``(G, p)``, in the changes' dtype.
    """
    p = width.shape[-1]
    single, pair = changes[: 2 * p], changes[2 * p :]
    plus, minus = single[0::2].T, single[1::2].T  # (G, p): moved up and down along each coordinate
    gradient = (plus - minus) / (2 * width)
    hessian = torch.diag_embed((plus + minus) / width**2)
    for n, (j, k) in enumerate(pairs):
        both = pair[2 * n] + pair[2 * n + 1] - plus[:, j] - minus[:, j] - plus[:, k] - minus[:, k]
        unit = torch.zeros_like(hessian[0])  # the symmetric pair (j, k), (k, j)
        unit[j, k] = unit[k, j] = 1.0
        hessian = hessian + (both / (2 * width[:, j] * width[:, k]))[:, None, None] * unit
    return gradient, hessian
