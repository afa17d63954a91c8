r"""``SampleThenOptimize``: posterior samples of a linear or linearised Pyro model by minibatch optimisation.

The Pyro model's observed site has a parameter :math:`f(x, \theta)` (a Normal's loc, a Bernoulli's or a
Categorical's logits, ...) and the latent sites :math:`\theta` the engine covers. Around the linearisation point
:math:`\theta_*` (the MAP, given or found; any point when :math:`f` is linear in :math:`\theta`) the model is
:math:`f(x, \theta_*) + J(x)(\theta - \theta_*)`, with the prior :math:`\mathcal N(m, A^{-1})` read from the model,
:math:`B_i = \Lambda_i` the likelihood's curvature in :math:`f` at :math:`\theta_*`, :math:`M = \sum_i J_i^\top
\Lambda_i J_i` and :math:`H = M + A`. The engine returns :math:`K` draws :math:`\bar\theta + \zeta_j`:

* :math:`\zeta_j \sim \mathcal N(0, H^{-1})` minimise the low-variance objective :math:`L'` of
  :mod:`~pyro_scalable.infer.linearized.sampling.core`, with :math:`\phi = J` never formed (``torch.func``
  Jacobian-vector and vector-Jacobian products);
* the mean :math:`\bar\theta = \theta_* + \bar\delta`, :math:`H\bar\delta = b - A(\theta_* - m)` with
  :math:`b = \sum_i J_i^\top \nabla_f \log p(y_i \mid f_i)`, is one more row of the same batched quadratic
  (regulariser centre :math:`A^{-1}b - (\theta_* - m)`). For a Normal likelihood (one scale) it is the exact
  posterior mean of the linear model, and the draws are centred there. For other likelihoods it is only the
  Gauss-Newton step from :math:`\theta_*`, whose quadratic extrapolation overstates the likelihood away from the
  prior the MAP was fitted with (and makes per-site EM run away): the draws are centred at :math:`\theta_*`, as
  in the linearised Laplace guide, and the step (``newton_step``) starts the check that :math:`\theta_*` is a MAP.

The regulariser centres need one pass over the data (one VJP per chunk for all rows, :math:`\xi_i \sim
\mathcal N(0, I)` drawn there and summed into :math:`\sum_i J_i^\top \Lambda_i^{1/2}\xi_i`); each optimisation step
is one batched JVP and one batched VJP on a minibatch of the model's subsampled plate; after each solve one more
pass gives the exact gradient norm of every row (a convergence diagnostic) and :math:`M\zeta_j` for the
effective dimension of :mod:`~pyro_scalable.infer.linearized.sampling.em`.

The solver is the linearisation floor's (:func:`~pyro_scalable.infer.linearized.sampling.sample_linearized`);
the engine finds the linearisation point, builds the network and the parallel plan, runs the solver and keeps what
it returns.
"""

from __future__ import annotations

import operator
import os
from dataclasses import fields
from typing import Any, Literal

import torch
from torch import Tensor

from pyro_scalable.arguments import check_choice, check_count, check_device, check_flag, check_seed, check_tensor
from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import FullDataModel, ModelBridge
from pyro_scalable.bridge.subsampling import warn_full_batch
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.linearized.network import NetworkFunction
from pyro_scalable.infer.linearized.sampling import (
    OneProcess,
    Solution,
    SolveSettings,
    check_settings,
    homoscedastic_normal,
    is_linear,
    sample_linearized,
)
from pyro_scalable.infer.linearized.sampling.core import SampleState
from pyro_scalable.infer.linearized.sampling.problem import SolveDiverged
from pyro_scalable.infer.linearized.sites import choose_sites, observed_site
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.results import Draws, FullDataKernel
from pyro_scalable.infer.sample_then_optimize.checkpoint import SolveCheckpoint, run_seed
from pyro_scalable.infer.sample_then_optimize.distributed import DistributedMode
from pyro_scalable.infer.sample_then_optimize.distributed import setup as setup_parallel
from pyro_scalable.infer.sample_then_optimize.linearization import check_draws_finite, linearization_point
from pyro_scalable.infer.sample_then_optimize.predictive import SampleThenOptimizePredictives

__all__ = ["SampleThenOptimize"]


class SampleThenOptimize(SampleThenOptimizePredictives, Draws):
    """Posterior samples of a linear (or linearised) Pyro model, each the minimiser of a convex quadratic.

    Args:
        model: a Pyro model with one observed site; its data plate's ``subsample_size`` sets the minibatch.
        num_samples: posterior draws ``K``, optimised together.
        num_epochs: passes over the data per solve.
        step_size: initial step size, decayed linearly to zero over a solve (default: ``0.5 / λ``, λ the largest
            eigenvalue of ``H`` estimated by power iteration on minibatches).
        momentum: Nesterov momentum.
        max_grad_norm: clip each row's gradient to this norm (``None``: no clipping).
        linearize_at: the linearisation point: constrained values by site name, or a trained autoguide (its
            ``median``). Default: none needed for a linear-Gaussian model (an output linear in the latents, no other
            latent, a Normal likelihood with a fixed scale); every other model (a GLM included) is linearised at
            its MAP, found by the full-data mode search (:mod:`.linearization`).
        sites: the latent sites to sample (default: all that the output depends on; a scalar Normal noise scale is
            held at its value at ``linearize_at``).
        prior_precision: overrides the precision read from the model's priors (a scalar or a flat vector over the
            sampled sites, in unconstrained space); the prior mean stays the model's.
        g_prior: scale the prior precision of each parameter by ``diag(M)`` (normalised to mean one per group),
            which makes it invariant to the scale of each weight (robust to normalisation layers).
        em_steps: MacKay updates of the prior precision; ``0`` keeps the model's prior.
        em_groups: one precision for all parameters (``"scalar"``) or one per Pyro site (``"site"``).
        em_epochs: epochs of each warm-started solve after the first (default ``num_epochs``).
        em_noise: also update a Normal likelihood's scalar noise scale at every EM step (MacKay's, :mod:`.em`); it
            replaces the model's value (a latent site held fixed, or a constant) in draws, predictions, ``noise_scale``.
        variance_reduction: which rows get an SVRG control variate (re-anchored every epoch with one full-data
            pass): the mean only (``"mean"``), or every row (``"all"``: twice the products per step, linear
            convergence instead of SGD's ``O(1/sqrt(T))``: samples accurate to many digits).
        preconditioner: ``"diagonal"`` steps along ``(diag(M) + A)⁻¹ ∇`` (one extra pass over
            the data for the exact GGN diagonal), so that directions the prior dominates and features of
            different scales converge at the rate of the rest; ``None``: plain SGD (:mod:`.core`).
        refine_passes: after each solve's epochs, at most this many conjugate-gradient iterations on the full data
            (one pass each), stopped as soon as every row (each draw and the mean) is within ``tolerance`` posterior
            sds of its exact solution in every direction, by CG's energy-error estimate (:mod:`.krylov`); a run
            whose budget ends first warns with the estimate. ``0``: the epochs only.
        tolerance: the error allowed, in posterior sds along any direction (the energy norm ``‖z − z*‖_H``).
        map_steps: L-BFGS iterations (per stage) of the MAP search when ``linearize_at`` is needed and not given;
            ``0``: no search (an error where a MAP is needed).
        chunk_size: points per chunk in the full-data passes (default: max(B, 1024)).
        seed: seeds the prior draws, the perturbations, the minibatches; ``None`` draws one from torch.
        draws_device: where draws are kept (default CPU).
        progress_bar: show a tqdm progress bar.
        checkpoint: a file to write the run's progress to every ``checkpoint_every`` epochs (and at the end of
            each solve), so that a killed run goes on where it stopped, with the same draws
            (:mod:`.checkpoint`); ``run`` resumes from it where it exists and was written with the same settings,
            model code and data values, and raises a ``CheckpointError`` otherwise.
        checkpoint_every: epochs between checkpoints.
        resume: ``False`` starts over even where a checkpoint exists (and overwrites it).
        distributed: run on every process of torch.distributed's default process group (launched by ``torchrun``;
            see :mod:`.distributed`). ``"samples"`` splits the K samples across the ranks and gathers the draws
            on rank 0 (other ranks keep their own block); ``"data"`` splits every minibatch and data pass across
            the ranks, and every rank ends with every draw.
        full_batch: a full-batch run is meant: a model whose likelihood runs on all of 10⁴ or more rows at every
            step (no ``subsample_size``, or no plate) is otherwise named with a warning and the plate to write.

    After ``run``, besides the draws (``get_samples``, ``to_inference_data``, :meth:`predict`):

    Attributes:
        net: the model as a network function of the flat sampled latents, linearised at ``net.theta_star``.
        linear: whether the model's output is linear in the sampled latents (with a Normal likelihood of a fixed
            scale no MAP is needed; a GLM is linearised at its MAP).
        state: the solver's last :class:`~pyro_scalable.infer.linearized.sampling.core.SampleState`: one row per
            sample, then the mean row (after a divergence: the state before the step that diverged).
        mean_unconstrained: the flat posterior mean the draws are centred at.
        cg_passes: the refinement's conjugate-gradient passes in each solve (the first, then one per EM step).
        mean_error: CG's estimate of the mean row's error in posterior sds along any direction (after a
            refinement; the draws' are ``sample_stats["cg_error"]``).
        newton_step: the mean row's solution, the Newton step from ``net.theta_star`` (a check that it is a MAP).
        data_gradient: the full-data gradient of the log-likelihood at ``net.theta_star`` (flat).
        em_history: every EM step's prior precision and effective dimension (with ``em_noise``, ``"noise_scale"``).
        noise_scale: with ``em_noise``, the fitted noise scale of the Normal likelihood (else ``None``).

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import SampleThenOptimize
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0], subsample_size=100) as idx:
        ...         pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])
        >>> x = torch.randn(1000, 3); y = x @ torch.tensor([1.0, -1.0, 0.5]) + 0.5 * torch.randn(1000)
        >>> engine = SampleThenOptimize(model, num_samples=64, em_steps=3, seed=0, progress_bar=False)
        >>> engine.run(x, y)
        SampleThenOptimize(1 chain x 64 draws)
        >>> engine.get_samples()["w"].shape
        torch.Size([64, 3])
        >>> engine.em_history["prior_precision"].shape  # (em_steps + 1, groups)
        torch.Size([4, 1])

    """

    independent = True  # each draw is its own solve: summary() reads no n_eff or r_hat into them

    def __init__(
        self,
        model: Any,
        num_samples: int = 16,
        *,
        num_epochs: int = 20,
        step_size: float | None = None,
        momentum: float = 0.9,
        max_grad_norm: float | None = None,
        linearize_at: dict[str, Tensor] | Any | None = None,
        sites: list[str] | Literal["last_layer"] | None = None,
        prior_precision: float | Tensor | None = None,
        g_prior: bool = False,
        em_steps: int = 0,
        em_groups: Literal["scalar", "site"] = "scalar",
        em_epochs: int | None = None,
        em_noise: bool = False,
        variance_reduction: Literal["mean", "all"] = "mean",
        preconditioner: Literal["diagonal"] | None = "diagonal",
        refine_passes: int = 200,
        tolerance: float = 0.1,
        map_steps: int = 200,
        chunk_size: int | None = None,
        seed: int | None = None,
        draws_device: torch.device | str = "cpu",
        progress_bar: bool = True,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 1,
        resume: bool = True,
        distributed: DistributedMode | None = None,
        full_batch: bool = False,
    ):
        if not callable(model):
            raise TypeError(f"model must be a Pyro model (a callable), got {type(model).__name__}.")
        check_settings(
            num_samples=num_samples,
            num_epochs=num_epochs,
            em_steps=em_steps,
            em_epochs=num_epochs if em_epochs is None else em_epochs,
            refine_passes=refine_passes,
            step_size=step_size,
            momentum=momentum,
            max_grad_norm=max_grad_norm,
            tolerance=tolerance,
            variance_reduction=variance_reduction,
            preconditioner=preconditioner,
            em_groups=em_groups,
            g_prior=g_prior,
            em_noise=em_noise,
            progress_bar=progress_bar,
        )
        for name, value, least in (("map_steps", map_steps, 0), ("checkpoint_every", checkpoint_every, 1)):
            if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}.")
        if linearize_at is not None and not isinstance(linearize_at, dict) and not hasattr(linearize_at, "median"):
            raise TypeError(
                "linearize_at must be a dict of constrained values by site name or a trained autoguide, "
                f"got {type(linearize_at).__name__}."
            )
        if isinstance(sites, str) and sites != "last_layer":
            raise ValueError(f"sites must be None, 'last_layer' or a list of latent site names, got {sites!r}.")
        if prior_precision is not None:
            check_tensor("prior_precision", prior_precision, positive=True)
        check_count("chunk_size", chunk_size, optional=True)
        check_seed("seed", seed)
        draws_device = check_device("draws_device", draws_device)
        if distributed not in ("samples", "data", None):
            raise ValueError(f"distributed must be 'samples', 'data' or None, got {distributed!r}.")
        if checkpoint is not None and distributed is not None:
            raise ValueError("checkpoint does not work with distributed yet: give one of them.")
        self.kernel = FullDataKernel(FullDataModel(model))
        self.num_samples = operator.index(num_samples)
        self.num_chains = 1
        self.num_epochs = operator.index(num_epochs)
        self.step_size, self.momentum, self.max_grad_norm = step_size, momentum, max_grad_norm
        self.linearize_at, self.sites, self.prior_precision = linearize_at, sites, prior_precision
        self.g_prior = g_prior
        self.em_steps = operator.index(em_steps)
        self.em_groups = em_groups
        self.em_epochs = self.num_epochs if em_epochs is None else operator.index(em_epochs)
        self.em_noise = em_noise
        self.variance_reduction, self.preconditioner = variance_reduction, preconditioner
        self.refine_passes = operator.index(refine_passes)
        self.tolerance = float(tolerance)
        self.map_steps = operator.index(map_steps)
        self.chunk_size, self.seed = chunk_size, seed
        self.draws_device = torch.device(draws_device)
        self.progress_bar = progress_bar
        self.checkpoint = checkpoint
        self.checkpoint_every = operator.index(checkpoint_every)
        self.resume = check_flag("resume", resume)
        self.distributed = distributed
        self.full_batch = check_flag("full_batch", full_batch)
        self._requested_samples = self.num_samples
        self._reset()

    def _reset(self) -> None:
        self.results: RunRecord | None = None
        self.state: SampleState | None = None
        self.net: NetworkFunction | None = None
        self.linear: bool | None = None
        self.em_history: dict[str, Any] = {}
        self.trace: dict[str, list[Tensor]] = {}
        self.cg_passes, self.mean_error, self.mean_grad_norm, self.noise_scale = [], None, None, None

    def settings(self) -> SolveSettings:
        """The solver's settings from this engine's (public, mutable) attributes, as they are now."""
        names = [field.name for field in fields(SolveSettings) if field.name != "map_found"]
        return SolveSettings(**{name: getattr(self, name) for name in names}, map_found=self.linearize_at is None)

    # ------------------------------------------------------------------ running
    def run(self, *args: Any, **kwargs: Any) -> SampleThenOptimize:
        """Linearise (if needed), draw the regulariser centres, solve, run the EM steps; keep the draws; return self."""
        self.num_samples = self._requested_samples  # a sample-parallel run leaves a rank's share on ranks > 0
        self._reset()
        model = self.kernel.model.model
        bridge = ModelBridge(model, args, kwargs)
        warn_full_batch(bridge, "SampleThenOptimize", full_batch=self.full_batch)  # a step on all of N >= 10⁴ rows
        self.results = RunRecord(bridge, bridge, args, kwargs)
        site = observed_site(bridge, "sample-then-optimise")
        if not bridge.sites:
            raise ModelError("the model has no latent site to sample.")
        parallel = setup_parallel(self.distributed, self.num_samples, next(iter(bridge.plates.values()), None))
        seed = parallel.seed(run_seed(self), bridge.device)  # seed=None: a checkpoint's recorded seed, if it has one
        generator = torch.Generator(device=bridge.device).manual_seed(seed)
        latents = linearization_point(
            bridge,
            site,
            args,
            kwargs,
            generator,
            linearize_at=self.linearize_at,
            sites=self.sites,
            map_steps=self.map_steps,
            quiet=not self.progress_bar or not parallel.is_main,
        )
        chosen, heteroscedastic, noise_site, noise = choose_sites(bridge, site, latents, self.sites)
        if self.em_noise and noise is None:
            raise ModelError(
                f"em_noise=True needs observed site '{site}' to be a Normal with one scalar scale (a constant or a "
                "latent site held fixed); drop em_noise."
            )
        layout = ParameterLayout({name: bridge.sites[name].unconstrained_shape for name in chosen})
        theta = layout.flatten(latents).detach()
        self.linear = is_linear(bridge, site, chosen, latents, generator)
        linear_gaussian = self.linear and homoscedastic_normal(bridge, site, chosen, latents)
        self.net = NetworkFunction(
            bridge, site, layout, theta, latents, heteroscedastic=heteroscedastic, chunk_size=self.chunk_size
        )
        checkpoint = None if self.checkpoint is None else SolveCheckpoint(self, generator, seed)
        try:
            solution = sample_linearized(
                self.net,
                theta,
                self.settings(),
                generator,
                parallel=parallel,
                noise=noise,
                linear_gaussian=linear_gaussian,
                noise_site=noise_site,
                checkpoint=checkpoint,
            )
        except SolveDiverged as error:
            self.state = error.state
            raise
        finally:
            checkpoint is None or checkpoint.close()  # the checkpoint's lock, for the next run on its path
        self._keep(solution, noise_site, parallel)
        return self

    def _keep(self, solution: Solution, noise_site: str | None, parallel: OneProcess) -> None:
        """Everything the run decided, from the solver's record: the state, diagnostics, EM history and draws."""
        net, state = self.net, solution.state
        self.state, self.trace, self.cg_passes = state, solution.trace, solution.cg_passes
        self.mean_error, self.mean_grad_norm = solution.mean_error, solution.mean_grad_norm
        if not parallel.is_main:
            self.num_samples = parallel.num_local
        self.em_history = {
            "groups": solution.group_names,
            "prior_precision": torch.stack(solution.alphas).to(self.draws_device),
            "effective_dimension": torch.stack(solution.gammas).to(self.draws_device),
        }
        if solution.noises:
            self.em_history["noise_scale"] = torch.stack(solution.noises).to(self.draws_device)
            self.noise_scale = solution.noises[-1]
            if noise_site is not None:  # the draws and the mean carry the fitted scale
                shape = net.fixed[noise_site].shape
                fitted = self.bridge.unconstrain({noise_site: solution.noises[-1].reshape(shape)})
                net.fixed[noise_site] = fitted[noise_site]
        self.newton_step = state.samples[-1].detach()
        draws = solution.mean + state.samples[:-1]
        self.mean_unconstrained = solution.mean
        self.data_gradient = solution.gradient
        self._solved_precision = solution.precision
        latents = {
            **{k: v.expand((draws.shape[0],) + v.shape) for k, v in net.fixed.items()},
            **net.layout.unflatten(draws),
        }
        check_draws_finite(self.bridge, latents)
        self.results.draws = {k: v.detach().unsqueeze(0).to(self.draws_device) for k, v in latents.items()}
        self.results.stats = {k: v.unsqueeze(0).to(self.draws_device) for k, v in solution.stats.items()}

    def rerun_em(
        self, em_steps: int, em_groups: Literal["scalar", "site"], prior_precision: float | Tensor | None = None
    ) -> None:
        """Run again on the data of the last ``run``, from ``prior_precision`` with ``em_steps`` MacKay updates.

        The settings stay changed (they are the public ``em_steps``, ``em_groups`` and ``prior_precision``); a fixed
        ``seed`` draws the same noise as the last run.
        """
        self._require_net()
        check_count("em_steps", em_steps, 0)
        check_choice("em_groups", em_groups, ("scalar", "site"))
        if prior_precision is not None:
            check_tensor("prior_precision", prior_precision, positive=True)
        self.em_steps, self.em_groups, self.prior_precision = operator.index(em_steps), em_groups, prior_precision
        self.run(*self.results.args, **self.results.kwargs)
