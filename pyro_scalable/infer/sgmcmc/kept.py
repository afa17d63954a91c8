"""Which steps after warm-up become draws: a policy object a kernel hands the driver (``Kernel.kept_draws``).

A policy answers two questions, both about the run's global step index ``t`` (warm-up's steps included, as a
kernel's schedules count them): :meth:`KeptDraws.keeps` — is the draw after step ``t`` kept? — and
:meth:`KeptDraws.steps` — how many steps after warm-up keep ``num_samples`` draws per chain? The driver allocates
the draws and runs the steps from the second, and records a draw where the first says so; it knows nothing else of
the policy.

* :class:`Thinning` (every kernel's default): every ``thin``-th step after warm-up.
* :class:`CycleStage`: the sampling stage of each cycle of a cyclical schedule — the last ``1 - exploration`` of
  every ``cycle_length`` steps, counted from the run's first step (cyclical SG-MCMC, Zhang et al. 2020: the
  exploration stage's draws, taken at a large step and no noise, are no posterior draws) — thinned there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pyro_scalable.arguments import check_count

__all__ = ["CycleStage", "KeptDraws", "Thinning"]


@runtime_checkable
class KeptDraws(Protocol):
    """The steps after warm-up whose draws are kept."""

    def keeps(self, t: int, num_warmup: int) -> bool:
        """Whether the draw after step ``t`` (``t >= num_warmup``, counted from the run's first step) is kept."""

    def steps(self, num_samples: int, num_warmup: int) -> int:
        """The steps after ``num_warmup`` that keep ``num_samples`` draws per chain (the last one kept)."""


@dataclass(frozen=True)
class Thinning:
    """Every ``thin``-th step after warm-up.

    Example:
        >>> policy = Thinning(3)
        >>> [t for t in range(10, 22) if policy.keeps(t, num_warmup=10)], policy.steps(4, num_warmup=10)
        ([12, 15, 18, 21], 12)

    """

    thin: int = 1

    def __post_init__(self) -> None:
        check_count("thin", self.thin, least=1)

    def keeps(self, t: int, num_warmup: int) -> bool:
        return (t - num_warmup + 1) % self.thin == 0

    def steps(self, num_samples: int, num_warmup: int) -> int:
        return num_samples * self.thin


@dataclass(frozen=True)
class CycleStage:
    """The sampling stage of every cycle: steps whose position in their cycle is at least ``exploration`` of it.

    Cycles of ``cycle_length`` steps start at step 0; a cycle's sampling stage is its positions from
    ``ceil(exploration * cycle_length)`` on, of which every ``thin``-th (counted from the stage's start) is kept.
    Only steps after warm-up are kept.

    Example:
        >>> policy = CycleStage(cycle_length=10, exploration=0.6, thin=2)  # positions 6 to 9; keep 7 and 9
        >>> [t for t in range(30) if policy.keeps(t, num_warmup=0)], policy.steps(5, num_warmup=0)
        ([7, 9, 17, 19, 27, 29], 28)

    """

    cycle_length: int
    exploration: float = 0.5
    thin: int = 1

    def __post_init__(self) -> None:
        check_count("cycle_length", self.cycle_length, least=1)
        check_count("thin", self.thin, least=1)
        if not 0.0 <= self.exploration < 1.0:
            raise ValueError(
                f"exploration must be in [0, 1): the share of each cycle spent exploring; got {self.exploration!r}."
            )
        if self.per_cycle < 1:
            raise ValueError(
                f"a cycle of {self.cycle_length} steps exploring {self.exploration:.0%} of it keeps no draw at thin="
                f"{self.thin}: lengthen the cycle, explore less of it, or thin less."
            )

    @property
    def stage_start(self) -> int:
        """The first position of a cycle's sampling stage."""
        return math.ceil(self.exploration * self.cycle_length)

    @property
    def per_cycle(self) -> int:
        """Draws kept per cycle."""
        return (self.cycle_length - self.stage_start) // self.thin

    def keeps(self, t: int, num_warmup: int) -> bool:
        position = t % self.cycle_length - self.stage_start
        return (
            t >= num_warmup
            and position >= 0
            and (position + 1) % self.thin == 0
            and position < self.per_cycle * self.thin
        )

    def steps(self, num_samples: int, num_warmup: int) -> int:
        cycle, length, thin = num_warmup // self.cycle_length, self.cycle_length, self.thin
        first = [cycle * length + self.stage_start + (k + 1) * thin - 1 for k in range(self.per_cycle)]
        first = [t for t in first if t >= num_warmup]  # the kept steps left in the cycle warm-up ends in
        if num_samples <= len(first):
            return first[num_samples - 1] + 1 - num_warmup
        full, k = divmod(num_samples - len(first) - 1, self.per_cycle)
        last = (cycle + 1 + full) * length + self.stage_start + (k + 1) * thin - 1
        return last + 1 - num_warmup
