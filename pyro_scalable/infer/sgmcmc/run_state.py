"""What one ``StochasticMCMC.run`` hands from phase to phase (:mod:`.phases`), and what the driver keeps of it.

:class:`RunState` is the run while it runs: the model, the chains' stepper, the minibatches, warm-up's bookkeeping,
and the record of draws it fills; :func:`step_estimators` the gradient estimators of the densities its steps take
their gradient of (built again whenever the control variate's centre, warm-up's metric or the program changes), and
:func:`program` what steps the chains (warm-up around the kernel, or the kernel sampling). :class:`Outcome` is what
the driver keeps of a run (:func:`outcome`, also after an interruption).
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
from pyro_scalable.infer.gradients.estimator import GradientEstimator, NoiseEstimatingGradient, PlainGradient
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.sgmcmc.adaptation import Adaptation, Tuned
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.checkpoint import RunCheckpoint
from pyro_scalable.infer.sgmcmc.metric import MetricSchedule
from pyro_scalable.infer.sgmcmc.stragglers import WindowLog

__all__ = ["Outcome", "RunState", "StepEstimators", "outcome", "program", "release", "step_estimators"]


class StepEstimators(NamedTuple):
    """What a step's gradient is: burn-in's estimator and every other step's, in the metric's variables."""

    burn_in: GradientEstimator
    calibrated: GradientEstimator


def step_estimators(state: RunState) -> StepEstimators:
    """The running program's estimator of the run's density in θ (``state.base``), in warm-up's metric (if any).

    With ``control_variate="warmup"`` burn-in steps on the plain density: the controlled one's noise grows with the
    distance to the centre, and burn-in does not bound the gradient noise.
    """
    wrap = state.schedule.wrap if state.schedule is not None else (lambda density: density)
    kind = state.stepper.program.estimator
    calibrated = kind.over(wrap(state.base))
    plain_burn_in = state.option == "warmup" and isinstance(state.base, ControlledDensity)
    return StepEstimators(kind.over(wrap(state.base.inner)) if plain_burn_in else calibrated, calibrated)


def estimators(kernel: Any, gradient: Any, density: MinibatchDensity) -> tuple[GradientEstimator, GradientEstimator]:
    """Warm-up's and sampling's gradient estimators of ``density``: ``gradient``'s (the user's class), or the defaults.

    The defaults: warm-up measures the noise (it chooses the step size from it); sampling does where the kernel
    corrects for or reports it (``gradient_noise``), and takes the plain gradient where the kernel ignores it.
    """
    if gradient is not None:
        made = gradient(density)
        if not isinstance(made, GradientEstimator):
            raise TypeError(
                f"gradient={gradient!r} made {made!r}, which is no GradientEstimator (init, measure, fold, estimate, "
                "every_chain, over, density, measures_noise: pyro_scalable.infer.gradients.estimator)."
            )
        if kernel.adapts and not made.measures_noise:
            raise ValueError(
                f"{made!r} does not measure the gradient noise, from which warm-up chooses {kernel!r}'s step size: "
                "give a step_size, or an estimator that measures the noise (NoiseEstimatingGradient, or a subclass)."
            )
        return made, made
    sampling = PlainGradient if kernel.gradient_noise == "ignore" else NoiseEstimatingGradient
    return NoiseEstimatingGradient(density), sampling(density)


def program(kernel: Any, gradient: Any, density: MinibatchDensity, num_warmup: int) -> Adaptation | Tuned:
    """What steps the chains: warm-up around a kernel that adapts (for ``num_warmup`` steps), else the kernel itself."""
    warmup, sampling = estimators(kernel, gradient, density)
    return Adaptation(kernel, num_warmup, warmup, sampling) if kernel.adapts else Tuned(kernel, sampling)


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
    estimators: StepEstimators | None = None  # the steps' gradient estimators (step_estimators)
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
