r"""A run's solves: the first one, then one warm-started solve per EM step, with a progress bar and checkpoints.

Each solve minimises the batched quadratic of :mod:`.problem` for :math:`K` samples and the mean, by minibatch epochs
and then conjugate gradients on the full data until every row has converged (:mod:`.krylov`); between solves the
M-step of :mod:`.em` updates the prior precision :math:`\alpha` from the effective dimension :math:`\hat\gamma`
(clipped to :math:`(0, d_g)`; a group whose raw estimate is not positive keeps its precision; a group's step damped
where it changes sign), with ``em_noise`` also a Normal's noise scale, and the solver's velocity restarts at zero.
A run resumed from a checkpoint starts at the EM step and epoch it stopped at.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.infer.sample_then_optimize import core
from pyro_scalable.infer.sample_then_optimize.checkpoint import SolveCheckpoint
from pyro_scalable.infer.sample_then_optimize.em import damp_oscillation, effective_dimension, mackay_update
from pyro_scalable.infer.sample_then_optimize.problem import Problem

__all__ = ["solve_with_em"]


def solve_with_em(
    engine: Any, problem: Problem, generator: torch.Generator
) -> tuple[core.SampleState, list[Tensor], list[Tensor], list[Tensor]]:
    """The first solve and ``engine.em_steps`` warm-started ones; the state, every step's ``alpha`` and ``gamma``.

    With ``em_noise`` also every step's noise scale (else an empty list).
    """
    num_groups = problem.num_groups
    alphas, gammas = [problem.alpha.clone()], []
    noises = [problem.noise0] if engine.em_noise else []
    epochs = engine.num_epochs + engine.em_steps * engine.em_epochs + (engine.em_steps + 1) * engine.refine_passes
    total = epochs * problem.steps_per_epoch  # a refinement pass counts as an epoch
    checkpoint = None if engine.checkpoint is None else SolveCheckpoint(engine, problem, generator)
    saved = None if checkpoint is None else checkpoint.resume()
    first_em_step, done = 0, 0
    if saved is not None:
        first_em_step, alphas, gammas, noises = saved["em_step"], saved["alphas"], saved["gammas"], saved["noises"]
        done = min(first_em_step, 1) * engine.num_epochs + max(first_em_step - 1, 0) * engine.em_epochs
        done = done * problem.steps_per_epoch + saved["progress"]["t"]
    parallel = problem.parallel
    bar = tqdm(total=total, initial=done, disable=not engine.progress_bar or not parallel.is_main, desc="Solve")
    try:
        state = None
        for em_step in range(first_em_step, engine.em_steps + 1):
            epochs = engine.num_epochs if em_step == 0 else engine.em_epochs
            progress = saved["progress"] if saved is not None and em_step == first_em_step else None
            on_epoch = None if checkpoint is None else checkpoint.on_epoch(em_step, epochs, alphas, gammas, noises)
            problem.last_solve = em_step == engine.em_steps
            state = parallel.agree(problem.solve(state, epochs, generator, bar, progress, on_epoch))
            if engine.refine_passes:
                # CG keeps no velocity: its K x d is freed for CG's vectors and the diagnostics (an EM step's next
                # solve restarts it at zero below)
                engine.state = state = state._replace(velocity=state.velocity.new_empty((0, state.velocity.shape[-1])))
                state = problem.refine(state, engine.refine_passes, engine.tolerance, bar)
            engine.state = state
            mean_offset, samples, ggn = problem.finish(state)
            raw = effective_dimension(samples, ggn[:-1], problem.groups, num_groups)
            raw = parallel.mean_over_samples(raw, samples.shape[0])
            gamma = raw.clamp(min=1e-3).minimum(problem.group_sizes)  # the true value lies in (0, d_g)
            gammas.append(gamma)
            if em_step == 0:
                problem.check_map(state, ggn[-1])
            if em_step < engine.em_steps:
                update = damp_oscillation(alphas, mackay_update(gamma, mean_offset, problem.scale, problem.groups))
                # a group whose estimate is <= 0 (pure noise from its coupling to other groups) keeps its
                # precision: clipping it would all but flatten its prior, and nothing would bring it back
                problem.alpha = torch.where(raw > 0, update, problem.alpha)
                if not bool(torch.isfinite(problem.alpha).all() and (problem.alpha > 0).all()):
                    raise ModelError(
                        f"the EM update gave a prior precision of {problem.alpha.tolist()} (the posterior mean is "
                        "at the prior mean in some group); keep em_steps=0 or use em_groups='scalar'."
                    )
                alphas.append(problem.alpha.clone())
                if engine.em_noise:
                    noises.append(problem.update_noise(gamma, state.samples[-1]))
                if state.velocity.numel():
                    state.velocity.zero_()  # in place: engine.state holds the same tensor (no second K x d)
                else:
                    state = state._replace(velocity=torch.zeros_like(state.samples))
    finally:
        bar.close()
    return state, alphas, gammas, noises
