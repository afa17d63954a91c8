"""A multilevel model's data rows by group, and sums over them in double precision.

:class:`Rows` keeps one index of the rows sorted by group, so that the rows of a set of groups are a gather (never a
copy of the data), and a fixed sample of at most ``m`` rows per group with weights ``n_k / m_k``. :func:`sums` adds
rows' terms by group in double precision: a group's log-likelihood is a sum of up to thousands of terms, and the
samplers take differences of such sums.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pyro_scalable.bridge.row_groups import RowGroups

__all__ = ["Rows", "sums", "wide"]


def wide(x: Tensor) -> Tensor:
    """``x`` in double precision, where its device has it: sums of many rows' terms then lose nothing that matters."""
    return x if x.device.type == "mps" else x.double()


def sums(terms: Tensor, group: Tensor, size: int) -> Tensor:
    """The sums of ``terms`` by ``group`` (``size`` of them), accumulated in double precision (:func:`wide`)."""
    terms = wide(terms)
    return terms.new_zeros(size).index_add(0, group, terms)


class Rows:
    """The data rows of each group, in one index sorted by group: a set of groups' rows is a gather, not a copy."""

    def __init__(self, groups: RowGroups):
        self.group = groups.group
        self.sizes = groups.sizes
        self.order = torch.argsort(groups.group, stable=True)
        self.starts = torch.cumsum(groups.sizes, 0) - groups.sizes
        self.num_groups = groups.num_groups
        self.all = torch.arange(len(groups.group), device=groups.group.device)

    def of(self, drawn: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of the groups ``drawn`` and, for each row, its group's position in ``drawn``."""
        if drawn.shape[0] == self.num_groups:
            return self.all, self.group
        lengths = self.sizes[drawn]
        offsets = torch.cumsum(lengths, 0) - lengths
        slot = torch.repeat_interleave(torch.arange(len(drawn), device=drawn.device), lengths)
        within = torch.arange(int(lengths.sum()), device=drawn.device) - offsets[slot]
        return self.order[self.starts[drawn][slot] + within], slot

    def sample(self, most: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
        """At most ``most`` rows of each group, fixed once (a seeded shuffle within each group).

        Returns the rows, their groups, and each row's weight ``n_k / m_k`` (``None`` where no group has more than
        ``most`` rows: then the rows are all rows).
        """
        if int(self.sizes.max()) <= most:
            return self.all, self.group, None
        shuffle = torch.randperm(len(self.group), generator=torch.Generator().manual_seed(0)).to(self.all.device)
        order = shuffle[torch.argsort(self.group[shuffle], stable=True)]  # by group, shuffled within each
        rank = self.all - self.starts.repeat_interleave(self.sizes)  # each sorted row's place within its group
        kept = order[rank < most]
        weight = self.sizes / self.sizes.clamp(max=most)
        return kept, self.group[kept], weight[self.group[kept]].to(dtype)
