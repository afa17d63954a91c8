"""The phases of one ``StochasticMCMC.run``, in the order the driver calls them, and the state they hand on.

1. :func:`prepare`: bind the model to its data (or a ``DataLoader``), set up the distributed mode, draw each chain's
   initial point, the minibatch sampler and warm-up's stepper (its metric's schedule where one is needed).
2. :func:`resume`: a checkpoint's run goes on from its last completed step.
3. :func:`attach_control_variate`: the density the control-variate policy (:mod:`.control_choice`) chose, and the
   densities the steps take their gradient of (:func:`step_densities`: in warm-up's metric's variables).
4. :func:`sample`: warm-up and sampling, one :func:`step` at a time (fixed-step stretches as compiled blocks under
   ``model_tracing(compile=True)``: :mod:`.compiled_blocks`; each step's bookkeeping is :func:`account`); a warm-up
   window's end (:func:`window_end`: the chains left behind, the metric's next stage) and warm-up's end
   (:func:`warmup_end`) happen inside it. An interruption keeps every draw taken.
5. :func:`finish`: the record's statistics, the distributed gather, the health checks.

The phases read the driver's settings and write nothing onto it: what moves between them, and what the run
produces, is the :class:`~.run_state.RunState`; :func:`~.run_state.outcome` is what the driver keeps of it (also
after an interruption).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from tqdm.auto import tqdm

from pyro_scalable.bridge.checks import user_stacklevel
from pyro_scalable.bridge.hierarchy import prior_parents
from pyro_scalable.bridge.log_posterior import LogPosterior
from pyro_scalable.bridge.minibatches import EpochSampler, data_passes
from pyro_scalable.bridge.model import Batch, Latents
from pyro_scalable.bridge.subsampling import warn_full_batch
from pyro_scalable.bridge.traced import block_steps, compiling
from pyro_scalable.infer.checkpoint import terminate_as_interrupt
from pyro_scalable.infer.distributed import broadcast_seed
from pyro_scalable.infer.gradients import ControlledDensity
from pyro_scalable.infer.health import repeated_draws, warn_unhealthy
from pyro_scalable.infer.remedies import RunSetup
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.checkpoint import RunCheckpoint, run_fingerprint
from pyro_scalable.infer.sgmcmc.compiled_blocks import CompiledBlocks
from pyro_scalable.infer.sgmcmc.control_choice import attach, choose, recentre
from pyro_scalable.infer.sgmcmc.control_probe import controlled_noise_share, warn_wasted_control_variate
from pyro_scalable.infer.sgmcmc.distributed import setup as setup_parallel
from pyro_scalable.infer.sgmcmc.metric import MetricSchedule
from pyro_scalable.infer.sgmcmc.noise_probe import probe_gradient_noise, warn_ignored_noise, warn_uncorrected_noise
from pyro_scalable.infer.sgmcmc.run_arguments import bind
from pyro_scalable.infer.sgmcmc.run_state import RunState, program, restore, stage_index, step_estimators, value
from pyro_scalable.infer.sgmcmc.stragglers import WindowLog

__all__ = ["account", "attach_control_variate", "finish", "prepare", "resume", "sample", "step"]

_NOISE_STATS = ("noise_ratio", "uncorrected")


def prepare(run: Any, args: tuple, kwargs: dict, batches: Iterable | None) -> RunState:
    """Bind the model, start the chains, and build warm-up's stepper (its first stage, without a metric)."""
    seed = int(torch.randint(0, 2**62, ())) if run.seed is None else run.seed
    record, batch_iter = bind(run.kernel.model, args, kwargs, batches, seed)
    bridge = record.bridge
    warn_full_batch(bridge, "StochasticMCMC", full_batch=run.full_batch)
    parallel = setup_parallel(run.distributed, bridge.plates, run.num_chains, sharded=batch_iter is None)
    if parallel is not None:
        seed = broadcast_seed(seed, bridge.device)
    generator = torch.Generator(device=bridge.device).manual_seed(parallel.noise_seed(seed) if parallel else seed)
    latents = bridge.init_latents(run.num_chains, run.kernel.init_strategy, seed=seed)
    if parallel is not None:
        latents = parallel.local_chains(latents)
    sampler = EpochSampler(
        bridge.plates,
        next(iter(latents.values())).shape[0],
        generator,
        bridge.device,
        replacement=run.minibatches == "independent",
        shared=run.shared_minibatches,
    )
    reducer = parallel if run.distributed == "data" else None
    # warm-up wraps a kernel that adapts; at its end the stepper unwraps it (the chains keep what it chose)
    schedule = MetricSchedule.for_run(run.metric, run.kernel, run.num_warmup, latents)
    base = LogPosterior(bridge, replacement=sampler.replacement)  # with replacement: no finite-population correction
    # the first stage is warm-up as without a metric: the metric's stages replace its rest only if they are needed
    steps = program(run.kernel, run.gradient, base, run.num_warmup)
    stepper = ChainStepper(steps, bridge, latents, generator, run.chain_method, reducer)
    record.allocate(latents, run.num_samples, run.draws_device)
    num_chains = next(iter(latents.values())).shape[0]
    total = run.num_warmup + run.kept.steps(run.num_samples, run.num_warmup)
    window = WindowLog()  # each window's log densities per chain: which chains warm-up left behind (.stragglers)
    return RunState(
        record,
        bridge,
        parallel,
        reducer,
        seed,
        generator,
        latents,
        sampler,
        schedule,
        stepper,
        base,
        window,
        batch_iter,
        batches,
        total,
        run.num_samples,
        run.num_chains,
        torch.zeros(num_chains, dtype=torch.int64, device=bridge.device),
        torch.zeros(num_chains, dtype=torch.int64),
    )


def stage_stepper(run: Any, state: RunState, start: Latents, method: str) -> ChainStepper:
    """A stepper for warm-up's current metric stage (all of warm-up without a metric), from ``start``."""
    schedule = state.schedule
    length = schedule.stage_length(schedule.stage) if schedule else run.num_warmup
    steps = program(run.kernel, run.gradient, state.base, length)
    return ChainStepper(steps, state.bridge, start, state.generator, method, state.reducer)


def resume(run: Any, state: RunState, batches: Iterable | None) -> None:
    """Open the checkpoint, if one is asked for; a run it holds goes on from its last completed step."""
    if run.checkpoint is None:
        return
    state.checkpoint = RunCheckpoint(
        run.checkpoint,
        run.checkpoint_every,
        run_fingerprint(run, state.record, batches),
        total=state.total,
        warmup=run.num_warmup,
        settle=state.record.settle,
    )
    saved = state.checkpoint.read(run.resume)
    if saved is not None:  # in a later stage of warm-up's metric, the stage's stepper
        restore(run, state, saved, rebuild=lambda: stage_stepper(run, state, state.latents, run.chain_method))
    state.checkpoint.remember(value(state, state.start))
    for _ in range(state.start if state.batch_iter is not None else 0):
        next(state.batch_iter)  # exact only where iterating `batches` again yields the same sequence


def attach_control_variate(run: Any, state: RunState) -> None:
    """Wrap the log posterior in the control variate the policy chose (or leave it plain); keep a new centre."""
    wanted = run.kernel.control_variate
    if state.option is None:  # not read back from a checkpoint
        state.option = choose(wanted, run.kernel, state.bridge, windows=state.schedule is not None)
    first = {k: x[0] for k, x in state.latents.items()}  # one chain's initial point starts a mode search
    resumed = state.control_variate  # a checkpoint's centre, if it held one
    state.base, control, search, state.option = attach(
        state.option,
        state.base,
        first,
        state.seed,
        state.reducer,
        bridge=state.bridge,
        full=state.record.full_bridge,
        resumed=resumed,
        chosen=wanted == "auto",
        windows=state.schedule is not None,
        progress=run.progress_bar and (state.parallel is None or state.parallel.is_main),  # as sample()'s bar
    )
    if control is not None and control is not resumed:
        state.control_variate, state.mode_search = control, search
        if search is not None and run.kernel.init_strategy is init_to_uniform:  # every chain starts at the mode
            state.latents = {k: control.centre[k].to(v).expand_as(v).clone() for k, v in state.latents.items()}
            steps, method = state.stepper.program, run.chain_method
            state.stepper = ChainStepper(steps, state.bridge, state.latents, state.generator, method, state.reducer)
        if state.checkpoint is not None:  # the centre and its full-data pass are not redone on resume: nor counted
            state.checkpoint.remember(value(state, state.start))  # (the model tracing's calls)
            state.checkpoint.write()
    state.estimators = step_estimators(state)


def sample(run: Any, state: RunState) -> None:
    """Warm-up and sampling, step by step, with a progress bar; an interruption keeps every draw taken."""
    quiet = not run.progress_bar or (state.parallel is not None and not state.parallel.is_main)
    description = "Warmup" if state.start < run.num_warmup else "Sample"
    bar = tqdm(total=state.total, initial=state.start, disable=quiet, desc=description)
    with terminate_as_interrupt(state.checkpoint is not None):
        _loop(run, state, bar, quiet)


def _loop(run: Any, state: RunState, bar: Any, quiet: bool) -> None:
    blocks = CompiledBlocks(block_steps()) if compiling() and block_steps() > 1 else None  # the compiled loop
    t, end = state.start, state.start if state.diverged else state.total  # a stopped run stays stopped
    try:
        while t < end:
            length = blocks.length(run, state, t) if blocks is not None else 0
            info = _block(run, state, t, length, blocks) if length else step(run, state, t)
            t += max(length, 1)
            if t == run.num_warmup:
                bar.set_description("Sample")
            if not quiet and ((t - 1) % 50 < max(length, 1) or t == state.total):
                bar.set_postfix(
                    lp=f"{float(info.log_posterior.float().mean()):.4g}",
                    step_size=f"{float(info.step_size.float().mean()):.3g}",
                )
            bar.update(max(length, 1))
            if state.diverged:
                warnings.warn(
                    f"a chain diverged at step {t - 1} (non-finite log density or gradient) and on_divergence='stop': "
                    f"the run ends with {state.kept} draws per chain.",
                    stacklevel=user_stacklevel(),
                )
                break
    except KeyboardInterrupt:
        if state.checkpoint is not None:
            state.checkpoint.write()  # as the last completed step left the run
        truncate(run, state)
        warnings.warn(
            f"interrupted: keeping the {state.kept} draws per chain taken so far.", stacklevel=user_stacklevel()
        )
        raise
    except BaseException:
        truncate(run, state)  # the draws taken stay readable; the buffers beyond them are dropped
        raise
    finally:
        bar.close()
    truncate(run, state)


def step(run: Any, state: RunState, t: int) -> Any:
    """Step ``t`` of the run: every chain one step, warm-up's bookkeeping, the draw kept, the checkpoint."""
    if state.batch_iter is not None:
        step_args, step_kwargs = next(state.batch_iter)
        batch = Batch({}, step_args, step_kwargs)
    else:
        batch = Batch(next(state.sampler), state.bridge.args, state.bridge.kwargs)
    info = state.stepper.step(batch, stage_index(state, t), _estimator(run, state, t))
    account(run, state, t, info, batch)
    return info


def _estimator(run: Any, state: RunState, t: int) -> Any:
    """The gradient estimator of step ``t``: burn-in's (uncalibrated) in warm-up's burn-in steps, else calibrated."""
    estimators = state.estimators
    burn_in = estimators.burn_in is not estimators.calibrated and t < run.num_warmup
    if burn_in and state.stepper.program.phase(stage_index(state, t)).burn_in:
        return estimators.burn_in
    return estimators.calibrated


def _block(run: Any, state: RunState, t: int, length: int, blocks: CompiledBlocks) -> Any:
    """Steps ``t`` to ``t + length - 1`` as one compiled block (:mod:`.compiled_blocks`), or eagerly where it says."""
    compiled = blocks.run(run, state, t, _estimator(run, state, t))
    if compiled is not None:
        for k, (draw, info) in enumerate(compiled):
            account(run, state, t + k, info, None, draw)
        return info
    eager = []
    for k in range(length):  # the graph's first block (checked against these steps), or one that failed to compile
        info = step(run, state, t + k)
        eager.append((state.stepper.latents(), info))
    blocks.check(state, eager)
    return info


def account(run: Any, state: RunState, t: int, info: Any, batch: Batch | None, draw: Latents | None = None) -> None:
    """Step ``t``'s bookkeeping after the chains moved: warm-up's windows, the draw kept, the checkpoint.

    ``draw``: the chains' draw after the step where the stepper has moved past it (a compiled block's steps);
    ``batch``: the step's minibatch (warm-up's metric stages read it; a block runs none of theirs).
    """
    schedule = state.schedule
    if t < run.num_warmup and (schedule.in_window(t) if schedule else t >= run.num_warmup // 2):
        state.window.observe(info.log_posterior, info.diverging)
    if schedule is not None and t < run.num_warmup:
        schedule.observe(t, schedule.to_theta(state.stepper.latents()))
        if schedule.due(t):
            window_end(run, state, batch)
    if t + 1 == run.num_warmup:
        warmup_end(run, state)
    state.diverged = bool(info.diverging.any()) if run.on_divergence == "stop" else False
    if t < run.num_warmup:  # a tensor until the run ends: no wait for the device on every step
        state.warmup_divergences = state.warmup_divergences + info.diverging.to(torch.int64)
    elif run.kept.keeps(t, run.num_warmup):  # the kernel's policy (.kept): thinning, or a cycle's sampling stage
        draw = state.stepper.latents() if draw is None else draw
        state.record.record(state.kept, schedule.to_theta(draw) if schedule else draw, info)
        state.kept += 1
    if state.checkpoint is not None:
        state.checkpoint.step_done(value(state, t + 1))


def window_end(run: Any, state: RunState, batch: Batch) -> None:
    """The next stage of warm-up, in the metric this one's positions give; a straggler restarts from a healthy one.

    A chain left behind (:mod:`.stragglers`) neither shapes the next metric nor stays where it is.
    """
    schedule = state.schedule
    behind, restart = state.window.close(state.parallel is None)
    theta = schedule.to_theta(state.stepper.latents())
    if restart is not None:
        theta = {k: v.index_copy(0, restart[0], v[restart[1]]) for k, v in theta.items()}
        state.restarted[restart[0].cpu()] += 1
    big = batch.indices if state.batch_iter else {k: v[0] for k, v in state.sampler.larger(4096).items()}
    curvature = schedule.hessian(state.base, Batch(big, batch.args, batch.kwargs))
    keep = None if restart is None else ~behind
    moved = schedule.next_map(next(iter(theta.values())), curvature, keep=keep)
    if state.option == "warmup":  # recentred at each window's mean: one full-data pass
        state.control_variate = recentre(state.record.full_bridge, schedule, state.reducer)
        state.base = ControlledDensity(state.base.inner, state.control_variate)
    if moved is not None:
        state.stepper = stage_stepper(run, state, schedule.to_z(theta), state.stepper.mode)
    elif restart is not None:
        state.stepper.restart(*restart)
    state.estimators = step_estimators(state)  # in the next stage's metric, around the new centre


def warmup_end(run: Any, state: RunState) -> None:
    """Sampling starts from healthy chains only; the stepper unwraps warm-up (the chains keep what it chose)."""
    _, restart = state.window.close(state.parallel is None)
    if restart is not None:
        state.stepper.restart(*restart)
        state.restarted[restart[0].cpu()] += 1
    state.stepper.end_warmup()
    state.estimators = step_estimators(state)  # sampling's (a plain gradient where the kernel ignores the noise)


def finish(run: Any, state: RunState) -> None:
    """The record's statistics and the per-chain warm-up counts, the ranks' draws gathered, the health checks."""
    results = state.record
    results.stats = {  # statistics of a gradient noise the kernel did not estimate are NaN: leave them out
        k: v for k, v in results.stats.items() if not (k in _NOISE_STATS and bool(v.isnan().all()))
    }
    if state.parallel is not None:  # the ranks' draws on rank 0 (chain-parallel), or nothing to do (data-parallel)
        gathered = state.parallel.gather(results.draws, results.stats)
        results.draws, results.stats = gathered.draws, gathered.stats
        state.num_chains = gathered.num_chains or state.num_chains
        state.num_samples = state.num_samples if gathered.num_samples is None else gathered.num_samples
    if state.diverged and state.kept == 0:
        raise RuntimeError(
            "a chain diverged during warmup and on_divergence='stop'; no draw was kept. "
            "Lower the step size, or use on_divergence='continue'."
        )
    per_chain = state.warmup_divergences.cpu()
    if state.num_samples > 0:
        results.stats["repeated"] = repeated_draws(results.draws)
        if run.distributed != "chains":  # each chain's warm-up, repeated along its draws (sample_stats' shape)
            shape = results.stats["repeated"].shape
            for name, value in (("warmup_divergences", per_chain), ("restarted", state.restarted)):
                results.stats[name] = value[:, None].expand(shape).to(results.stats["repeated"].device)
    passes = data_passes(state.bridge.plates, state.total * state.num_chains, loader=state.batch_iter is not None)
    setup = RunSetup(run.kernel.adapts, state.option is not None, prior_parents(state.bridge))  # for the advice
    warn_unhealthy(results.draws, results.stats, int(per_chain.sum()), data_passes=passes, setup=setup)
    warn_uncorrected_noise(results.stats, state.num_samples, run.kernel.adapts)
    if state.num_samples and state.parallel is None and state.start < state.total:  # not for a run read back
        last = state.stepper.latents()
        density = state.estimators.calibrated.density
        warn_ignored_noise(probe_gradient_noise(run.kernel, state.bridge, last, state.seed, state.total, density))
        if run.kernel.control_variate == "auto" and state.option == "map":  # what the chosen centre bought (at θ)
            theta = state.schedule.to_theta(last) if state.schedule else last
            share = controlled_noise_share(state.base, state.bridge, theta, state.seed)
            warn_wasted_control_variate(share, state.mode_search)


def truncate(run: Any, state: RunState) -> None:
    """Settle the draws and drop the buffers never filled."""
    record = state.record
    record.settle()
    if state.kept < state.num_samples:
        record.draws = {k: v[:, : state.kept] for k, v in record.draws.items()}
        record.stats = {k: v[:, : state.kept] for k, v in record.stats.items()}
        state.num_samples = state.kept
