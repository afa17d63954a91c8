"""What one ``StochasticMCMC.run`` hands from phase to phase (:mod:`.phases`), and what the driver keeps of it.

:class:`RunState` is the run while it runs: the model, the chains' stepper, the minibatches, warm-up's bookkeeping,
and the record of draws it fills; :func:`step_densities` the densities its steps take their gradient of (built again
whenever the control variate's centre or warm-up's metric changes). :class:`Outcome` is what the driver keeps of a
run (:func:`outcome`, also after an interruption).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.gradients import ControlledDensity, MinibatchDensity
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.checkpoint import RunCheckpoint
from pyro_scalable.infer.sgmcmc.metric import MetricSchedule
from pyro_scalable.infer.sgmcmc.stragglers import WindowLog

__all__ = ["Outcome", "RunState", "StepDensities", "outcome", "release", "step_densities"]


class StepDensities(NamedTuple):
    """What a step takes its gradient of: burn-in's density and every other step's, in the metric's variables."""

    burn_in: MinibatchDensity
    calibrated: MinibatchDensity


def step_densities(state: RunState) -> StepDensities:
    """The densities of the run's steps from its density in θ (``state.base``) and warm-up's metric (if any).

    With ``control_variate="warmup"`` burn-in steps on the plain density: the controlled one's noise grows with the
    distance to the centre, and burn-in does not bound the gradient noise.
    """
    wrap = state.schedule.wrap if state.schedule is not None else (lambda density: density)
    calibrated = wrap(state.base)
    plain_burn_in = state.option == "warmup" and isinstance(state.base, ControlledDensity)
    return StepDensities(wrap(state.base.inner) if plain_burn_in else calibrated, calibrated)


@dataclass
class RunState:
    """What one run's phases hand on: the model, the chains' stepper, the minibatches, the warm-up's bookkeeping.

    And what the run produces: the record of draws, the per-chain warm-up counts, the control variate chosen.
    """

    record: RunRecord
    bridge: ModelBridge
    parallel: Any  # the distributed mode's helper, or None
    reducer: Any  # the data-parallel all-reduce, or None
    seed: int
    generator: torch.Generator
    latents: Latents  # every chain's initial point
    sampler: EpochSampler
    schedule: MetricSchedule | None  # warm-up's metric stages, where a metric is needed
    stepper: ChainStepper
    base: MinibatchDensity  # the density in θ (the bridge's log posterior, or controlled after attach_control_variate)
    window: WindowLog
    batch_iter: Iterator | None  # a DataLoader's elements, cycled
    batches: Iterable | None
    total: int  # warm-up steps + sampling steps
    num_samples: int  # draws per chain: as asked, then as kept (or gathered)
    num_chains: int  # as asked, or as gathered (chain-parallel)
    warmup_divergences: Tensor  # per chain, on the model's device until the run ends
    restarted: Tensor  # per chain: how often warm-up restarted it from a healthy chain
    densities: StepDensities | None = None  # what the steps take their gradient of (step_densities)
    control_variate: Any = None  # the control variate's centre and full-data gradient (:mod:`.control_variates`)
    mode_search: Any = None  # how its mode was found
    option: Any = None  # the control-variate policy's choice
    checkpoint: RunCheckpoint | None = None
    start: int = 0
    kept: int = 0
    diverged: bool = False


class Outcome(NamedTuple):
    """What the driver keeps of a run (:meth:`~.mcmc.StochasticMCMC.run` assigns it, also after an interruption)."""

    results: RunRecord
    state: Any  # the chains' final state (the kernel's, in warm-up's metric variables where there is one)
    metric_map: Any  # warm-up's metric θ = mean + L z, or None
    control_variate: Any
    mode_search: Any
    warmup_divergences: Tensor  # per chain, on the CPU
    restarted: Tensor
    num_samples: int
    num_chains: int


def outcome(state: RunState) -> Outcome:
    """The run's results as its phases left them."""
    return Outcome(
        state.record,
        state.stepper.final_state,
        state.schedule.affine if state.schedule is not None else None,
        state.control_variate,
        state.mode_search,
        state.warmup_divergences.cpu(),
        state.restarted,
        state.num_samples,
        state.num_chains,
    )


def release(state: RunState) -> None:
    """The run is over: a checkpoint it opened gives up its lock (the next run on the path may take it)."""
    if state.checkpoint is not None:
        state.checkpoint.close()
