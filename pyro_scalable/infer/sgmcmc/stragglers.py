r"""Warm-up's check that every chain reached the posterior's bulk: a chain left behind restarts from a healthy one.

Warm-up chooses each chain's step from the curvature where that chain is. A chain that starts at a stiff point (a
noise scale drawn near zero, say) takes tiny steps, and may still be far from the bulk when the other chains have
settled. Left alone it harms the whole run twice: warm-up's metric pools the chains' positions of a window, so one
distant chain stretches the metric of every chain (the window mean and spread are its), and at sampling it drags
r_hat and the pooled moments (on a regression with a latent noise scale, one chain started at a small
:math:`\sigma` can end a run far outside the bulk, with every chain's metric built around it).

So at the end of each window of warm-up (each metric stage, and the last stage's calibrated half) the driver asks,
per chain, for the mean :math:`\bar\ell_c` and sd :math:`s_c` of its log density over the window's calibrated steps,
and for its diverging steps there. A chain is **left behind** where

.. math::

    \bar\ell_c < \operatorname{median}_k \bar\ell_k - G \cdot \operatorname{median}_k s_k, \qquad G = 4
    \ (:data:`GAP`),

or where it diverged in the window. Chains sampling one posterior have window means within a fraction of a within-chain
sd of one another (the sd of a mean over a window of many steps); a chain :math:`G` sds below the median chain is not in
the same bulk. The median, not the best chain, is the yardstick: a minority of chains far below is restarted, never the
majority. With an even number of chains it is the upper of the two middle chains, so up to half of them may be restarted
(where two of four chains are stuck, the lower middle chain is one of them: as the yardstick it would keep itself, and
sample far from the bulk); with two chains only a diverged one is. Chains that are not left behind are the donors; each
straggler starts again from a donor's state (position, momenta, what warm-up learnt there) and goes on with its own
noise and minibatches, so the two separate within a few relaxation times. A chain in a distinct mode whose log density
is as high as the others' is not touched: this check is about chains that are stuck, not about modes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["GAP", "WindowLog", "copy_chains", "donors_for", "left_behind"]

GAP = 4.0  # a chain whose window mean log density is this many within-chain sds below the median chain's is behind


class WindowLog:
    """Per-chain sums of the log density and the diverging steps over the running window of warm-up.

    Example:
        >>> import torch
        >>> window = WindowLog()
        >>> for step in range(50):  # the third chain sits far below the others
        ...     wobble = torch.tensor([1.0, -1.0, 0.5]) * (-1) ** step
        ...     window.observe(torch.tensor([-10.0, -11.0, -300.0]) + wobble, torch.zeros(3, dtype=torch.bool))
        >>> behind, (restarted, donors) = window.close()
        >>> behind.tolist(), restarted.tolist(), donors.tolist()
        ([False, False, True], [2], [0])

    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.count = 0
        self.total: Tensor | float = 0.0
        self.squares: Tensor | float = 0.0
        self.diverged: Tensor | float = 0.0

    def observe(self, log_posterior: Tensor, diverging: Tensor) -> None:
        """Add one step of every chain (``log_posterior``, ``diverging``: one value per chain)."""
        finite = torch.isfinite(log_posterior) & ~diverging
        value = torch.where(finite, log_posterior, torch.zeros_like(log_posterior)).double()
        self.count += 1
        self.total = self.total + value
        self.squares = self.squares + value.square()
        self.diverged = self.diverged + (~finite).to(torch.int64)

    def left_behind(self) -> Tensor | None:
        """The chains :func:`left_behind` finds in this window (``None`` before any step was observed)."""
        if self.count == 0:
            return None
        mean = self.total / self.count
        spread = (self.squares / self.count - mean.square()).clamp(min=0).sqrt()
        return left_behind(mean, spread, self.diverged > 0)

    def close(self, restarts: bool = True) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None]:
        """End the window: the chains left behind, and the restarts :func:`donors_for` makes (if ``restarts``)."""
        behind = self.left_behind()
        self.reset()
        return behind, (donors_for(behind) if restarts and behind is not None else None)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the window."""
        return {"count": self.count, "total": self.total, "squares": self.squares, "diverged": self.diverged}

    def load_state_dict(self, state: dict[str, Any], device: Any) -> None:
        """Go on with a checkpointed window."""
        self.count = state["count"]
        self.total, self.squares, self.diverged = (
            value.to(device) if isinstance(value, Tensor) else value
            for value in (state["total"], state["squares"], state["diverged"])
        )


def left_behind(mean: Tensor, spread: Tensor, diverged: Tensor) -> Tensor:
    """Which chains are behind: a window mean log density :data:`GAP` median sds under the median chain's, or diverged.

    Example:
        >>> import torch
        >>> mean = torch.tensor([-10.0, -11.0, -9.5, -400.0])  # the last chain is far from the others' bulk
        >>> spread = torch.tensor([1.5, 1.6, 1.4, 30.0])
        >>> left_behind(mean, spread, torch.tensor([False, False, True, False]))
        tensor([False, False,  True,  True])

    """
    ordered = mean.reshape(-1).sort().values  # (a single chain's mean may come 0-d)
    yardstick = ordered[ordered.numel() // 2] if ordered.numel() > 2 else ordered[0]  # the upper median from 3 on
    return (mean < yardstick - GAP * spread.median()) | diverged


def donors_for(behind: Tensor) -> tuple[Tensor, Tensor] | None:
    """The chains to restart and, for each, the healthy chain it restarts from (round robin over the healthy ones).

    ``None`` where no chain is behind, or where every chain is (there is nobody to restart from).

    Example:
        >>> import torch
        >>> donors_for(torch.tensor([False, True, False, True, True]))
        (tensor([1, 3, 4]), tensor([0, 2, 0]))

    """
    bad = torch.nonzero(behind).flatten()
    good = torch.nonzero(~behind).flatten()
    if len(bad) == 0 or len(good) == 0:
        return None
    return bad, good[torch.arange(len(bad), device=good.device) % len(good)]


def copy_chains(state: Any, bad: Tensor, donors: Tensor) -> Any:
    """``state`` (vectorised: chain dimension first) with chains ``bad`` replaced by copies of chains ``donors``.

    Example:
        >>> import torch
        >>> copy_chains({"w": torch.tensor([[1.0], [2.0], [3.0]])}, torch.tensor([2]), torch.tensor([0]))["w"]
        tensor([[1.],
                [2.],
                [1.]])

    """

    def replace(x: Any) -> Any:
        if not isinstance(x, Tensor) or x.dim() == 0:
            return x
        out = x.clone()
        out[bad.to(x.device)] = x[donors.to(x.device)]
        return out

    return tree_map(replace, state)
