"""What one ``StochasticMCMC.run`` hands from phase to phase (:mod:`.phases`), and what the driver keeps of it.

:class:`RunState` is the run while it runs: the model, the chains' stepper, the minibatches, warm-up's bookkeeping,
and the record of draws it fills; :func:`step_estimators` the gradient estimators of the densities its steps take
their gradient of (built again whenever the control variate's centre, warm-up's metric or the program changes), and
:func:`program` what steps the chains (warm-up around the kernel, or the kernel sampling). :class:`Outcome` is what
the driver keeps of a run (:func:`outcome`, also after an interruption).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.checkpoint import CheckpointError
from pyro_scalable.infer.gradients import ControlledDensity, MinibatchDensity
from pyro_scalable.infer.gradients.estimator import (
    GradientEstimator,
    NoiseEstimatingGradient,
    PlainGradient,
    whitened,
)
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.sgmcmc.adaptation import Adaptation, Tuned
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.checkpoint import RunCheckpoint, to_device, unstack_chains
from pyro_scalable.infer.sgmcmc.control_variates import ControlVariate
from pyro_scalable.infer.sgmcmc.metric import MetricSchedule
from pyro_scalable.infer.sgmcmc.stragglers import WindowLog

__all__ = [
    "Outcome",
    "RunState",
    "RunValue",
    "StepEstimators",
    "outcome",
    "program",
    "release",
    "restore",
    "step_estimators",
    "value",
]


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
    calibrated = whitened(kind.over(state.base), wrap)
    plain_burn_in = state.option == "warmup" and isinstance(state.base, ControlledDensity)
    return StepEstimators(whitened(kind.over(state.base.inner), wrap) if plain_burn_in else calibrated, calibrated)


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
        if kernel.gradient_noise != "ignore" and not made.measures_noise:  # else nothing corrected, nothing said
            raise ValueError(
                f"{made!r} does not measure the gradient noise, which {kernel!r} is to {kernel.gradient_noise}: give "
                "gradient_noise='ignore', or an estimator that measures the noise (NoiseEstimatingGradient, or a "
                "subclass)."
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


class RunValue(NamedTuple):
    """The run after ``step`` completed steps, as values: what a checkpoint saves and a resumed run is put back from.

    The chains' state holds each chain's kernel State, warm-up's and the gradient estimator's (:mod:`.adaptation`);
    ``draws`` and ``stats`` are the record's buffers, of which the first ``kept`` draws are taken.
    """

    step: int
    kept: int
    stopped: bool
    mode: str  # the stepper's: "vectorized" (a stacked state) or "sequential" (a list of chains)
    state: Any
    generator: Tensor  # the run's torch.Generator's state
    sampler: dict | None  # the minibatch sampler's permutations and positions (None: a DataLoader feeds the steps)
    draws: dict[str, Tensor]
    stats: dict[str, Tensor]
    warmup_divergences: Tensor
    control_variate: Any
    metric: dict | None  # warm-up's metric schedule
    window: dict  # warm-up's log-density window (:mod:`.stragglers`)
    restarted: Tensor
    tracing: list  # which of the model's signatures replay its recorded graph (:mod:`pyro_scalable.bridge.traced`)
    option: str | None  # the control variate's policy the run went on with, where a string


def value(state: RunState, step: int) -> RunValue:
    """The run as ``step`` completed steps left it (references and small copies only: cheap every step)."""
    chains = state.stepper.final_state
    return RunValue(
        step,
        state.kept,
        state.diverged,
        state.stepper.mode,
        list(chains) if isinstance(chains, list) else chains,
        state.generator.get_state(),
        state.sampler.state_dict() if state.batch_iter is None else None,
        state.record.draws,
        state.record.stats,
        state.warmup_divergences,
        state.control_variate,
        None if state.schedule is None else state.schedule.state_dict(),
        state.window.state_dict(),
        state.restarted.clone(),
        [tracer.history() for tracer in tracers(state.record)],
        option if isinstance(option := state.option, str) else None,
    )


def restore(run: Any, state: RunState, saved: dict[str, Any], rebuild: Callable[[], ChainStepper]) -> None:
    """Put a checkpoint's value (:class:`RunValue`'s fields) back into the run: it goes on bitwise from there.

    ``rebuild``: a stepper for warm-up's current metric stage (its state then restored) where that is a later one.
    """
    device = state.bridge.device
    stepper = state.stepper
    if saved["metric"] is not None and state.schedule is not None:
        state.schedule.load_state_dict(saved["metric"], device)
        if state.schedule.stage > 0:
            stepper = rebuild()
    if saved["step"] >= run.num_warmup:
        stepper.end_warmup()  # the saved state is the tuned chains', not warm-up's
    stepper.restore(saved["mode"], unstack_chains(saved["state"], stepper.final_state, saved["mode"]))
    state.stepper = stepper
    state.generator.set_state(saved["generator"])
    if state.batch_iter is None:
        state.sampler.load_state_dict(saved["sampler"])
    record, kept = state.record, saved["kept"]
    for name, draws in saved["draws"].items():
        record.draws[name][:, :kept].copy_(draws)
    for name, stat in saved["stats"].items():
        record.stats[name] = torch.empty((stat.shape[0], run.num_samples), dtype=stat.dtype, device=run.draws_device)
        record.stats[name][:, :kept].copy_(stat)
    state.window.load_state_dict(saved["window"], device)
    models = tracers(record)
    if len(saved["tracing"]) != len(models):
        raise CheckpointError("the model tracing's history in the checkpoint does not fit this run's models.")
    for tracer, history in zip(models, saved["tracing"], strict=True):
        tracer.restore(history)  # each call goes to Pyro or to the recorded graph as in the uninterrupted run
    state.start, state.kept, state.diverged = saved["step"], kept, saved["stopped"]
    state.warmup_divergences, state.restarted = saved["warmup_divergences"].to(device), saved["restarted"].clone()
    if saved["control_variate"] is not None:
        state.control_variate = ControlVariate(**to_device(saved["control_variate"], device))
    state.option = saved["option"]  # a fallback the policy took ("warmup" for a centred hierarchy's funnel) holds


def tracers(record: RunRecord) -> list:
    """The model tracings of the steps' bridge and of the full data's (where that is another)."""
    bridges = [record.bridge, *([record.full_bridge] if record.full_bridge not in (None, record.bridge) else [])]
    return [tracer for bridge in bridges for tracer in bridge.tracers]


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


def stage_index(state: RunState, t: int) -> int:
    """The stepper's step index of the run's step ``t``: counted from the start of warm-up's metric stage, if any."""
    return t - (state.schedule.stage_start() if state.schedule else 0)
