"""What a sample-then-optimise solve is asked to do, and which share of it this process holds.

:class:`SolveSettings` is the solver's configuration as one record: the engine builds it from its public
attributes, the Laplace ``"sampled"`` structure from its ``sampler_options``, and the solve reads nothing else.
:class:`OneProcess` is the plan of a one-process run (every sample row, every data point); the distributed plans of
the engine (:mod:`pyro_scalable.infer.sample_then_optimize.distributed`) subclass it, so the solve sees one
interface whether it runs on one process or many.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from pyro_scalable.arguments import check_choice, check_flag, check_number
from pyro_scalable.bridge.model import Batch, DataPlate
from pyro_scalable.infer.linearized.sampling import core

__all__ = ["OneProcess", "SolveSettings", "check_settings", "local_batch"]


@dataclass(frozen=True)
class SolveSettings:
    """The solver's settings (the meaning of each is documented on :class:`~pyro_scalable.infer.SampleThenOptimize`).

    ``map_found`` says that the linearisation point came from the engine's own MAP search, so that the warning of
    a point that is not a MAP can name the remedy (more ``map_steps``).
    """

    num_samples: int = 16
    num_epochs: int = 20
    step_size: float | None = None
    momentum: float = 0.9
    max_grad_norm: float | None = None
    prior_precision: float | Tensor | None = None
    g_prior: bool = False
    em_steps: int = 0
    em_groups: Literal["scalar", "site"] = "scalar"
    em_epochs: int | None = None  # None: num_epochs
    em_noise: bool = False
    variance_reduction: Literal["mean", "all"] = "mean"
    preconditioner: Literal["diagonal"] | None = "diagonal"
    refine_passes: int = 200
    tolerance: float = 0.1
    progress_bar: bool = True
    map_found: bool = False

    @property
    def epochs_per_em_step(self) -> int:
        """The epochs of each warm-started solve after the first."""
        return self.num_epochs if self.em_epochs is None else self.em_epochs


def check_settings(**settings: Any) -> None:
    """Raise on a value that :class:`SolveSettings` cannot run with, naming the argument (given ones only)."""
    counts = {"num_samples": 1, "num_epochs": 1, "em_steps": 0, "em_epochs": 1, "refine_passes": 0}
    for name, least in counts.items():
        value = settings.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}.")
    check_number("step_size", settings.get("step_size"), positive=True, optional=True)
    if "momentum" in settings and not 0 <= check_number("momentum", settings["momentum"]) < 1:
        raise ValueError(f"momentum must be in [0, 1), got {settings['momentum']!r}.")
    check_number("max_grad_norm", settings.get("max_grad_norm"), positive=True, optional=True)
    if "tolerance" in settings:
        check_number("tolerance", settings["tolerance"], positive=True)
    if "variance_reduction" in settings:
        check_choice("variance_reduction", settings["variance_reduction"], ("mean", "all"))
    if settings.get("preconditioner", "diagonal") not in ("diagonal", None):
        raise ValueError(f"preconditioner must be 'diagonal' or None, got {settings['preconditioner']!r}.")
    if "em_groups" in settings:
        check_choice("em_groups", settings["em_groups"], ("scalar", "site"))
    for name in ("g_prior", "em_noise", "progress_bar"):
        if name in settings:
            check_flag(name, settings[name])
    if settings.get("em_noise") and not settings.get("em_steps"):
        raise ValueError("em_noise=True updates the noise scale at each EM step: give em_steps >= 1.")


class OneProcess:
    """The plan of a one-process run: every row, every point, no communication."""

    rank, world_size = 0, 1

    def __init__(self, num_samples: int):
        self.num_samples = num_samples
        self.rows = slice(0, num_samples)  # this rank's sample rows
        self.share = slice(None)  # this rank's positions in a batch of points

    is_main = property(lambda self: self.rank == 0)
    num_local = property(lambda self: self.rows.stop - self.rows.start)

    def seed(self, seed: int, device: Any) -> int:
        """The run's seed, the same on every rank."""
        return seed

    def sum_over_data(self, x: Tensor) -> Tensor:
        """The sum over the ranks of a sum over this rank's share of the points."""
        return x

    def mean_over_samples(self, x: Tensor, local: int) -> Tensor:
        """The mean over all K samples of a quantity averaged over this rank's ``local`` samples."""
        return x

    def agree(self, state: core.SampleState) -> core.SampleState:
        """``state`` with the mean row (the last) the same on every rank."""
        return state

    def gather(self, state: core.SampleState, stats: dict[str, Tensor], trace: dict[str, list[Tensor]]):
        """Every rank's rows, diagnostics and trace in sample order on rank 0; elsewhere this rank's own."""
        return state, stats, trace


def local_batch(batch: Batch, plate: DataPlate | None, share: slice) -> Batch | None:
    """Cut ``batch`` to the points at positions ``share`` of the plate (``None`` where none are left)."""
    if plate is None or share == slice(None):
        return batch
    indices = batch.indices[plate.name][share]
    return batch._replace(indices={**batch.indices, plate.name: indices}) if indices.numel() else None
