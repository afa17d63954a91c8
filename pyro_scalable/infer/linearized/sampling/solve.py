r"""A run's solves: the first one, then one warm-started solve per EM step, with a progress bar and checkpoints.

Each solve minimises the batched quadratic of :mod:`.problem` for :math:`K` samples and the mean, by minibatch epochs
and then conjugate gradients on the full data until every row has converged (:mod:`.krylov`); between solves the
M-step of :mod:`.em` updates the prior precision :math:`\alpha` from the effective dimension :math:`\hat\gamma`
(clipped to :math:`(0, d_g)`; a group whose raw estimate is not positive keeps its precision; a group's step damped
where it changes sign), with ``em_noise`` also a Normal's noise scale, and the solver's velocity restarts at zero.
A run resumed from a checkpoint starts at the EM step and epoch it stopped at.

:func:`sample_linearized` is the whole of it for a network linearised at :math:`\theta_*`: the problem, the solves,
the checks of the result (convergence, the linearisation point, a Normal's noise scale), and one :class:`Solution`
record of everything a caller keeps. ``SampleThenOptimize`` and the Laplace ``"sampled"`` structure both call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Latents, ModelBridge
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.map_check import GAIN_THRESHOLD, check_noise_fit, gauss_newton_gain, warn_not_map
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sampling import core, krylov
from pyro_scalable.infer.linearized.sampling.em import (
    damp_oscillation,
    effective_dimension,
    linearized_sum_squares,
    mackay_update,
)
from pyro_scalable.infer.linearized.sampling.plan import OneProcess, SolveSettings
from pyro_scalable.infer.linearized.sampling.problem import Finished, Problem
from pyro_scalable.infer.linearized.sites import choose_sites, first_batch

__all__ = [
    "Checkpoint",
    "Solution",
    "Solved",
    "homoscedastic_normal",
    "is_linear",
    "is_linear_gaussian",
    "sample_linearized",
    "solve_with_em",
]


class Checkpoint(Protocol):
    """Where the solves are saved and resumed from (``SampleThenOptimize``'s ``checkpoint`` file).

    ``resume`` returns the saved run (``em_step``, ``progress``, ``alpha``, ``alphas``, ``gammas``, ``noises``,
    ``trace``) with its tensors on ``device``, or ``None``; ``on_epoch`` returns the ``on_epoch`` callback of
    :meth:`.problem.Problem.solve` for EM step ``em_step``, which reads the problem and the history when it writes.
    """

    def resume(self, device: torch.device) -> dict[str, Any] | None: ...

    def on_epoch(
        self, em_step: int, epochs: int, problem: Problem, alphas: list, gammas: list, noises: list
    ) -> Callable[[dict[str, Any]], None]: ...


class Solved(NamedTuple):
    """What :func:`solve_with_em` leaves: the last solve's state and diagnostics, and the EM history."""

    state: core.SampleState  # this rank's rows: the K sample rows, then the mean row
    finished: Finished  # the last solve's full-data diagnostics
    alphas: list[Tensor]  # the prior precision per group of every solve
    gammas: list[Tensor]  # the effective dimension per group after every solve
    noises: list[Tensor]  # with em_noise, the noise scale of every solve (else empty)
    cg_passes: list[int]  # the refinement's conjugate-gradient passes in every solve


class Solution(NamedTuple):
    """Everything a run of :func:`sample_linearized` decided, for its caller to keep."""

    state: core.SampleState  # the rows ζ_1..ζ_K, then the mean row (the Newton step from θ*); gathered on rank 0
    mean: Tensor  # the flat mean θ̄ the draws are centred at
    gradient: Tensor  # b, the data's gradient of the log-likelihood at θ* (at the final noise scale)
    precision: Tensor  # the prior precision of the last solve, flat
    stats: dict[str, Tensor]  # per draw: the full-data diagnostics of the last solve
    trace: dict[str, list[Tensor]]  # every epoch's minibatch objective and gradient norm per draw
    alphas: list[Tensor]
    gammas: list[Tensor]
    noises: list[Tensor]
    group_names: list[str]  # the EM groups (one, or one per site)
    cg_passes: list[int]
    mean_error: float | None  # CG's estimate of the mean row's error in posterior sds (None without CG)
    mean_grad_norm: float  # the mean row's full-data gradient norm


def sample_linearized(
    net: NetworkFunction,
    theta: Tensor,
    settings: SolveSettings,
    generator: torch.Generator,
    *,
    parallel: OneProcess | None = None,
    noise: Tensor | None = None,
    linear_gaussian: bool = False,
    noise_site: str | None = None,
    checkpoint: Checkpoint | None = None,
) -> Solution:
    """``settings.num_samples`` draws of the posterior of ``net`` linearised at ``theta``, and its mean.

    ``noise`` is a homoscedastic Normal's scale at ``theta`` (``noise_site`` its latent site, if any), which
    ``settings.em_noise`` fits and the noise check reads; ``linear_gaussian``: the model is linear-Gaussian in θ
    (:func:`is_linear_gaussian`), so ``theta`` need not be a MAP and the MAP check measures the draws' centre.
    Warns where the draws have not converged, the linearisation point is not a MAP, or too few observations are left
    to measure σ.
    """
    problem = Problem(
        settings, net, theta, generator, parallel, noise, linear_gaussian=linear_gaussian, noise_site=noise_site
    )
    solved = solve_with_em(problem, settings, generator, checkpoint)
    parallel = problem.parallel
    state, stats, trace = parallel.gather(solved.state, solved.finished.stats, problem.trace)
    cause = check_noise(problem, solved.gammas[-1], state.samples[-1])
    finished = solved.finished
    krylov.warn_unconverged(
        stats,
        mean_error=finished.mean_error,
        tolerance=settings.tolerance,
        refine_passes=settings.refine_passes,
        cause=cause,
    )
    return Solution(
        state=state,
        mean=problem.mean(state).detach(),
        gradient=problem.gradient.detach(),
        precision=problem.precision.detach(),
        stats=stats,
        trace=trace,
        alphas=solved.alphas,
        gammas=solved.gammas,
        noises=solved.noises,
        group_names=problem.group_names,
        cg_passes=solved.cg_passes,
        mean_error=finished.mean_error,
        mean_grad_norm=finished.mean_grad_norm,
    )


def solve_with_em(
    problem: Problem, settings: SolveSettings, generator: torch.Generator, checkpoint: Checkpoint | None = None
) -> Solved:
    """The first solve and ``settings.em_steps`` warm-started ones, each followed by an EM step but the last."""
    num_groups, em_steps, em_epochs = problem.num_groups, settings.em_steps, settings.epochs_per_em_step
    alphas, gammas = [problem.alpha.clone()], []
    noises = [problem.noise0] if settings.em_noise else []
    epochs = settings.num_epochs + em_steps * em_epochs + (em_steps + 1) * settings.refine_passes
    total = epochs * problem.steps_per_epoch  # a refinement pass counts as an epoch
    saved = None if checkpoint is None else checkpoint.resume(problem.theta.device)
    first_em_step, done = 0, 0
    if saved is not None:
        first_em_step, alphas, gammas, noises = saved["em_step"], saved["alphas"], saved["gammas"], saved["noises"]
        problem.alpha = saved["alpha"]
        problem.trace = {name: list(values) for name, values in saved["trace"].items()}
        if noises:
            problem.net.noise = noises[-1]
        done = min(first_em_step, 1) * settings.num_epochs + max(first_em_step - 1, 0) * em_epochs
        done = done * problem.steps_per_epoch + saved["progress"]["t"]
    parallel = problem.parallel
    bar = tqdm(total=total, initial=done, disable=not settings.progress_bar or not parallel.is_main, desc="Solve")
    cg_passes: list[int] = []
    try:
        state = None
        for em_step in range(first_em_step, em_steps + 1):
            epochs = settings.num_epochs if em_step == 0 else em_epochs
            progress = saved["progress"] if saved is not None and em_step == first_em_step else None
            on_epoch = None
            if checkpoint is not None:
                on_epoch = checkpoint.on_epoch(em_step, epochs, problem, alphas, gammas, noises)
            problem.last_solve = em_step == em_steps
            state = parallel.agree(problem.solve(state, epochs, generator, bar, progress, on_epoch))
            refinement = None
            if settings.refine_passes:
                # CG keeps no velocity: its K x d is freed for CG's vectors and the diagnostics (an EM step's next
                # solve restarts it at zero below)
                state = state._replace(velocity=state.velocity.new_empty((0, state.velocity.shape[-1])))
                state, refinement = problem.refine(state, settings.refine_passes, settings.tolerance, bar)
                cg_passes.append(refinement.passes)
            finished = problem.finish(state, refinement)
            raw = effective_dimension(finished.samples, finished.products[:-1], problem.groups, num_groups)
            raw = parallel.mean_over_samples(raw, finished.samples.shape[0])
            gamma = raw.clamp(min=1e-3).minimum(problem.group_sizes)  # the true value lies in (0, d_g)
            gammas.append(gamma)
            if em_step == 0:
                check_map(problem, state, finished.products[-1])
            if em_step < em_steps:
                update = damp_oscillation(alphas, mackay_update(gamma, finished.offset, problem.scale, problem.groups))
                # a group whose estimate is <= 0 (pure noise from its coupling to other groups) keeps its
                # precision: clipping it would all but flatten its prior, and nothing would bring it back
                problem.alpha = torch.where(raw > 0, update, problem.alpha)
                if not bool(torch.isfinite(problem.alpha).all() and (problem.alpha > 0).all()):
                    raise ModelError(
                        f"the EM update gave a prior precision of {problem.alpha.tolist()} (the posterior mean is "
                        "at the prior mean in some group); keep em_steps=0 or use em_groups='scalar'."
                    )
                alphas.append(problem.alpha.clone())
                if settings.em_noise:
                    noises.append(problem.update_noise(gamma, state.samples[-1]))
                if state.velocity.numel():
                    state.velocity.zero_()  # in place: no second K x d
                else:
                    state = state._replace(velocity=torch.zeros_like(state.samples))
    finally:
        bar.close()
    return Solved(state, finished, alphas, gammas, noises, cg_passes)


def check_noise(problem: Problem, gamma: Tensor, step: Tensor) -> bool:
    """Warn, as the Laplace guide does, when N − γ leaves too few observations to measure a Normal's σ.

    The residuals are the linearised model's at the mean ``θ* + step`` (one more pass over the data). Returns
    whether it warned.
    """
    net = problem.net
    noise = problem.noise0 if net.noise is None else net.noise
    if noise is None:
        return False
    batches = [b for b in map(problem.local, net.batches()) if b is not None]
    sums = problem.parallel.sum_over_data(linearized_sum_squares(net, problem.theta, step.detach(), batches))
    args = float(gamma.sum()), int(sums[1]), float(sums[0]), float(noise), problem.noise_site
    fitted_by = "EM" if problem.settings.em_noise else None
    source = "the sample-then-optimise posterior"
    return problem.parallel.is_main and check_noise_fit(*args, source, fitted_by=fitted_by)


def check_map(problem: Problem, state: core.SampleState, product: Tensor) -> None:
    r"""Warn, as the Laplace guide does, when the point the draws are centred at is not the linearised model's MAP.

    The gain of a Gauss-Newton step on the exact GGN (:mod:`~pyro_scalable.infer.linearized.map_check`). Every model
    is checked: a nonlinear one (a network, a GLM) from its linearisation point, where its draws are centred, starting
    CG at the solved mean row (``product``: ``M`` times it); a linear-Gaussian one, whose draws are centred at the
    solved mean :math:`\theta_* + \bar\delta` wherever :math:`\theta_*` is, from that centre (its residual
    :math:`b - H\bar\delta`: nothing to gain once the solve has converged, found without a product by the check's
    upper bound).
    """
    precision, inverse, step = problem.precision, problem.inverse_preconditioner(), state.samples[-1].detach()
    b = problem.gradient - precision * (problem.theta - problem.prior_mean)
    matvec = lambda v: problem.full_ggn_vp(v.unsqueeze(0)).squeeze(0) + precision * v  # noqa: E731
    solve = None if inverse is None else (lambda r: inverse * r)
    if problem.linear_gaussian:
        residual = b - (product + precision * step)
        floor = precision.double()
        gain = gauss_newton_gain(
            matvec, residual, solve=solve, floor_solve=lambda r: r / floor, threshold=GAIN_THRESHOLD
        )
        consequence = (
            "The draws are centred at the solved mean of the linear-Gaussian model, which has not converged: raise "
            "num_epochs or refine_passes."
        )
        warn_not_map(gain, float(residual.norm()), consequence)
        return
    gain = gauss_newton_gain(matvec, b, solve=solve, start=step, start_product=product + precision * step)
    found = " (The MAP was found by the engine's mode search: raise map_steps.)" if problem.settings.map_found else ""
    consequence = "The samples are those of the model linearised there, not the linearised-Laplace posterior."
    warn_not_map(gain, float(b.norm()), consequence + found)


def is_linear(bridge: ModelBridge, site: str, chosen: list[str], latents: Latents, generator) -> bool:
    """Whether the output is linear in the chosen latents (one random direction, to rounding).

    The direction is drawn from ``generator``, so the draws after it depend on this call being made. A linear output
    is not enough for the linearised model to be the model: see :func:`is_linear_gaussian`.
    """
    layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
    theta = layout.flatten(latents).detach()
    net = NetworkFunction(bridge, site, layout, theta, latents)
    batch = first_batch(bridge)
    direction = torch.randn(theta.shape, generator=generator, dtype=theta.dtype, device=theta.device)
    f0, products = net.jvp(theta, direction.unsqueeze(0), batch)
    f1 = net.f(theta + direction, batch).detach()
    error = (f1 - f0 - products[0]).abs().max()
    scale = f0.abs().max() + f1.abs().max() + products.abs().max()
    return bool(error <= 100 * torch.finfo(theta.dtype).eps * scale)


def is_linear_gaussian(bridge: ModelBridge, site: str, chosen: list[str], latents: Latents, generator) -> bool:
    """Whether the model is linear-Gaussian in the chosen latents: its own linearisation, at any point.

    The output (a Normal's loc) linear in them (:func:`is_linear`, which draws from ``generator``), and the
    likelihood a Normal whose scale none of them sets (:func:`homoscedastic_normal`). A GLM's predictor is linear
    too, but its likelihood is not Gaussian: its linearisation is a Gaussian only at its mode.
    """
    return is_linear(bridge, site, chosen, latents, generator) and homoscedastic_normal(bridge, site, chosen, latents)


def homoscedastic_normal(bridge: ModelBridge, site: str, chosen: list[str], latents: Latents) -> bool:
    """Whether observed ``site`` is a Normal whose scale does not depend on the ``chosen`` latents."""
    _, heteroscedastic, _, _ = choose_sites(bridge, site, latents, chosen)
    layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
    net = NetworkFunction(bridge, site, layout, layout.flatten(latents).detach(), latents)
    return net.outputs(net.theta_star, first_batch(bridge)).likelihood.name == "Normal" and not heteroscedastic
