"""The driver: one run loop for every stochastic-gradient engine and any number of chains.

``StochasticMCMC`` binds a kernel (``SGLD``, ``SGHMC``, ...) to a run: it builds the Pyro bridge, draws one
initial point per chain with the kernel's Pyro init strategy, then steps all chains together — one
``torch.func.vmap``-ed computation on the data's device where the model allows it, one chain after another (with
a one-line warning) where it does not. Draws go into preallocated buffers, by default on the CPU so that long runs
do not fill the GPU. ``run`` returns the driver, which answers the result surface every engine shares
(:mod:`~pyro_scalable.infer.results`). Parallel SG-MCMC (deep ensembles) is this driver with many chains and
``num_samples=1`` (or a few, thinned): at T = 1 each chain's last draw is an approximate posterior draw.
"""

from __future__ import annotations

import itertools
import operator
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.arguments import check_device, check_flag, check_seed
from pyro_scalable.bridge.checks import ModelError, first_line
from pyro_scalable.bridge.minibatches import EpochSampler, data_passes
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.infer.distributed import broadcast_seed
from pyro_scalable.infer.health import repeated_draws, warn_unhealthy
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.results import Draws
from pyro_scalable.infer.sgmcmc.adaptation import Adaptation
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.checkpoint import RunCheckpoint
from pyro_scalable.infer.sgmcmc.control_choice import attach, choose, recentre
from pyro_scalable.infer.sgmcmc.distributed import DistributedMode
from pyro_scalable.infer.sgmcmc.distributed import setup as setup_parallel
from pyro_scalable.infer.sgmcmc.metric import MetricSchedule, check_metric
from pyro_scalable.infer.sgmcmc.noise_probe import probe_gradient_noise, warn_ignored_noise, warn_uncorrected_noise
from pyro_scalable.infer.sgmcmc.run_arguments import check_choices, cycle, refuse_pyro_spellings
from pyro_scalable.infer.sgmcmc.stragglers import WindowLog

__all__ = ["StochasticMCMC"]

_NOISE_STATS = ("noise_ratio", "uncorrected")


class StochasticMCMC(Draws):
    """Run a stochastic-gradient MCMC kernel on a Pyro model, with many chains, and collect the draws.

    Args:
        kernel: an engine's Pyro-facing class, e.g. ``SGHMC(model, step_size=1e-3)``.
        num_samples: draws kept per chain (after thinning).
        num_warmup: steps per chain before the first kept draw.
        num_chains: independent chains, run together.
        thin: keep every ``thin``-th step after warmup.
        seed: seeds the initial points, the minibatches and the injected noise; ``None`` draws a seed from
            torch's global generator (so ``pyro.set_rng_seed`` makes runs repeatable).
        chain_method: ``"vectorized"`` (``torch.func.vmap`` over chains, with a sequential fallback) or
            ``"sequential"``.
        on_divergence: ``"continue"`` rejects a step whose log density or gradient is not finite, marks it in
            ``sample_stats.diverging`` and goes on; ``"stop"`` ends the run there, keeping every draw taken.
        draws_device: where draws are stored (default CPU, whatever device the model runs on).
        progress_bar: show a tqdm progress bar.
        distributed: run on every process of torch.distributed's default process group (launched by ``torchrun``;
            see :mod:`pyro_scalable.infer.sgmcmc.distributed`). ``"data"`` splits each minibatch across the ranks and
            all-reduces the gradient: every rank runs every chain and ends with the same draws as one process on
            the whole minibatch. ``"chains"`` splits the chains across the ranks; rank 0 then holds every chain's
            draws, and every other rank only its own (its ``num_chains`` is its share). ``None``: one process.
        checkpoint: a file to write the run's state to, so that a killed run goes on where it stopped
            (:mod:`pyro_scalable.infer.sgmcmc.checkpoint`). ``run`` resumes from it where it exists and was written by
            the same run — the same settings, the same model code and the same data values — and refuses it with a
            ``CheckpointError``, naming what differs, where it was not, or where the file is damaged or foreign.
        checkpoint_every: steps (warm-up included) between checkpoints; one is also written at the end of
            warm-up, at the end of the run and on ``KeyboardInterrupt``.
        resume: ``False`` starts over even where a checkpoint exists (and overwrites it).
        minibatches: how the subsampled plate's indices are drawn: ``"epoch"`` walks a shuffled permutation (each
            point once per epoch, as a ``DataLoader`` does), ``"independent"`` draws each minibatch with
            replacement, independently of the others, so that the gradient noise is what a noise correction
            subtracts (:mod:`pyro_scalable.bridge.minibatches`). Default: ``"independent"`` for a kernel that
            estimates its gradient noise, ``"epoch"`` otherwise.
        metric: the posterior's scale (``"diagonal"``) or covariance (``"dense"``) learnt from the chains in warm-up,
            where warm-up chooses the step size; the kernels then run in the change of variables that whitens it
            (:mod:`pyro_scalable.infer.sgmcmc.metric`). ``"auto"``: dense up to 100 dimensions, diagonal above, for
            a warm-up of at least 200 steps; ``"unit"``: none.
        shared_minibatches: every chain steps on the same minibatch (the subsampled plate's indices drawn once per
            step, not per chain): with vectorised chains, one gather of B rows and one batched product instead of a
            gather of ``num_chains × B`` rows (about 2× the throughput on a linear model on a CPU,
            ``docs/benchmarks.md``). The chains' gradient noise is then one draw, so they are not independent given
            the data: between-chain r_hat and the pooled ESS can look better than the chains are. Default off.

    After ``run``, ``control_variate`` holds the kernel's control variate (its centre, unconstrained, and the
    full-data log joint and gradient there; ``None`` without one) and ``mode_search`` how its mode was found
    (:mod:`pyro_scalable.infer.sgmcmc.control_variates`); ``metric_map`` warm-up's metric θ = mean + L z (``None``
    without one), in whose variables z the kernel's ``state`` then is.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import SGHMC, StochasticMCMC
        >>> def model(x, y):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        ...     with pyro.plate("data", len(y), subsample_size=50) as idx:
        ...         pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])
        >>> x = torch.randn(1000, 2); y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -2.0])))
        >>> mcmc = StochasticMCMC(SGHMC(model, step_size=0.01, friction=20.0), num_samples=300,
        ...                       num_warmup=300, num_chains=4, seed=0, progress_bar=False)
        >>> mcmc.run(x, y)
        StochasticMCMC(SGHMC, 4 chains x 300 draws)
        >>> mcmc.get_samples(group_by_chain=True)["w"].shape
        torch.Size([4, 300, 2])

    """

    def __init__(
        self,
        kernel: Any,
        num_samples: int,
        num_warmup: int = 0,
        num_chains: int = 1,
        thin: int = 1,
        *,
        seed: int | None = None,
        chain_method: Literal["vectorized", "sequential"] = "vectorized",
        on_divergence: Literal["continue", "stop"] = "continue",
        draws_device: torch.device | str = "cpu",
        progress_bar: bool = True,
        distributed: DistributedMode | None = None,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 1000,
        resume: bool = True,
        minibatches: Literal["epoch", "independent"] | None = None,
        metric: Literal["auto", "unit", "diagonal", "dense"] = "auto",
        shared_minibatches: bool = False,
        **unknown: Any,
    ):
        refuse_pyro_spellings(unknown)
        for name, value, least in (
            ("num_samples", num_samples, 1),
            ("num_warmup", num_warmup, 0),
            ("num_chains", num_chains, 1),
            ("thin", thin, 1),
            ("checkpoint_every", checkpoint_every, 1),
        ):
            if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}.")
        self.minibatches = check_choices(kernel, chain_method, on_divergence, minibatches)
        self.shared_minibatches = check_flag("shared_minibatches", shared_minibatches)
        self.metric = check_metric(metric)
        if distributed not in ("data", "chains", None):
            raise ValueError(f"distributed must be 'data', 'chains' or None, got {distributed!r}.")
        if distributed == "data" and not (hasattr(kernel, "estimate") and hasattr(kernel, "update")):
            raise TypeError(f"distributed='data' needs a kernel with estimate() and update(), got {kernel!r}.")
        if not (hasattr(kernel, "init") and hasattr(kernel, "step") and hasattr(kernel, "model")):
            raise TypeError(f"kernel must be an engine such as SGLD(model, ...) or SGHMC(model, ...), got {kernel!r}.")
        self.kernel = kernel
        self.num_samples = operator.index(num_samples)
        self.num_warmup = operator.index(num_warmup)
        if getattr(kernel, "adapts", False) and self.num_warmup == 0:
            raise ValueError(
                f"{kernel!r} learns its step size (or metric) in warm-up, but num_warmup=0: give num_warmup "
                "(a few hundred steps), or a step_size."
            )
        self.num_chains = operator.index(num_chains)
        self.thin = operator.index(thin)
        self.seed = check_seed("seed", seed)
        self.chain_method = chain_method
        self.on_divergence = on_divergence
        self.draws_device = check_device("draws_device", draws_device)
        self.progress_bar = check_flag("progress_bar", progress_bar)
        self.distributed = distributed
        if shared_minibatches and distributed == "data":
            raise ValueError("shared_minibatches=True is for chains on one process; distributed='data' shares none.")
        if checkpoint is not None and distributed is not None:
            raise ValueError("checkpoint does not work with distributed yet: give one of them.")
        self.checkpoint = checkpoint
        self.checkpoint_every = operator.index(checkpoint_every)
        self.resume = bool(resume)
        self._num_samples_requested = self.num_samples
        self._num_chains_requested = self.num_chains
        self.results: RunRecord | None = None
        self.state: Any = None
        self.num_warmup_divergences = 0
        self.warmup_divergences: Tensor | None = None  # per chain, after a run
        self.restarted: Tensor | None = None  # per chain: how often warm-up restarted it from a healthy chain
        self.control_variate = self.mode_search = self.metric_map = self._schedule = None

    # ------------------------------------------------------------------ running
    def run(self, *args: Any, batches: Iterable | None = None, **kwargs: Any) -> StochasticMCMC:
        """Sample. ``args``/``kwargs`` are the model's, on the full data.

        With ``batches`` (e.g. a ``DataLoader``), each step calls the model on the next element instead — a
        tuple of positional arguments or a dict of keyword arguments, whose plate uses ``subsample=idx`` — and
        ``args``/``kwargs`` (if given) are the full data for the log-likelihood and ``arviz.from_pyro``.
        """
        self.num_samples = self._num_samples_requested  # a stopped earlier run may have kept fewer
        self.num_chains = self._num_chains_requested  # a chain-parallel run leaves a rank's share on ranks > 0
        seed = int(torch.randint(0, 2**62, ())) if self.seed is None else self.seed
        self.results, batch_iter = self._bind(args, kwargs, batches)
        bridge = self.results.bridge
        parallel = setup_parallel(self.distributed, bridge.plates, self.num_chains, sharded=batch_iter is None)
        if parallel is not None:
            seed = broadcast_seed(seed, bridge.device)
        generator = torch.Generator(device=bridge.device).manual_seed(parallel.noise_seed(seed) if parallel else seed)
        latents = bridge.init_latents(self.num_chains, self.kernel.init_strategy, seed=seed)
        if parallel is not None:
            latents = parallel.local_chains(latents)
        sampler = EpochSampler(
            bridge.plates,
            next(iter(latents.values())).shape[0],
            generator,
            bridge.device,
            replacement=self.minibatches == "independent",
            shared=self.shared_minibatches,
        )
        reducer = parallel if self.distributed == "data" else None
        # warm-up wraps a kernel that adapts; at its end the stepper unwraps it (the chains keep what it chose)
        schedule = self._schedule = MetricSchedule.for_run(self.metric, self.kernel, self.num_warmup, latents)

        def stage_stepper(start: Latents, method: str) -> ChainStepper:  # warm-up's stage (all of it without metric)
            program = Adaptation(self.kernel, schedule.stage_length(schedule.stage)) if schedule else self.kernel
            return ChainStepper(program, bridge, start, generator, method, reducer)

        # the first stage is warm-up as without a metric: the metric's stages replace its rest only if they are needed
        program = Adaptation(self.kernel, self.num_warmup) if getattr(self.kernel, "adapts", False) else self.kernel
        stepper = ChainStepper(program, bridge, latents, generator, self.chain_method, reducer)
        base = stepper.log_posterior_fn
        base.replacement = sampler.replacement  # no finite-population correction then
        self.control_variate = self.mode_search = None  # a checkpoint's resume puts its control variate back

        self.results.allocate(latents, self.num_samples, self.draws_device)
        total = self.num_warmup + self.num_samples * self.thin
        start, kept, diverged = 0, 0, False
        num_chains = next(iter(latents.values())).shape[0]
        self.num_warmup_divergences = torch.zeros(num_chains, dtype=torch.int64, device=bridge.device)
        self.restarted = torch.zeros(num_chains, dtype=torch.int64)
        window = WindowLog()  # each window's log densities per chain: which chains warm-up left behind (.stragglers)
        checkpoint = None
        if self.checkpoint is not None:
            checkpoint = RunCheckpoint(
                self.checkpoint,
                self.checkpoint_every,
                run=self,
                stepper=stepper,
                generator=generator,
                sampler=sampler if batch_iter is None else None,
                total=total,
                batches=batches,
                metric=schedule,
                window=window,
                rebuild=lambda: stage_stepper(latents, self.chain_method),
            )
            start, kept, diverged = checkpoint.resume(self.resume)
            stepper = checkpoint.stepper  # in a later stage of warm-up's metric, the stage's
            for _ in range(start if batch_iter is not None else 0):
                next(batch_iter)  # exact only where iterating `batches` again yields the same sequence
        option = choose(
            getattr(self.kernel, "control_variate", None), self.kernel, bridge, windows=schedule is not None
        )
        chosen = getattr(self.kernel, "control_variate", None) == "auto"
        first = {k: x[0] for k, x in latents.items()}  # one chain's initial point starts a mode search
        base = attach(self, option, base, first, seed, reducer, checkpoint, chosen=chosen)
        stepper.log_posterior_fn = schedule.wrap(base) if schedule else base
        quiet = not self.progress_bar or (parallel is not None and not parallel.is_main)
        bar = tqdm(total=total, initial=start, disable=quiet, desc="Warmup" if start < self.num_warmup else "Sample")
        try:
            for t in range(start, start if diverged else total):  # a run stopped at a divergence stays stopped
                if batch_iter is not None:
                    step_args, step_kwargs = next(batch_iter)
                    batch = Batch({}, step_args, step_kwargs)
                else:
                    batch = Batch(next(sampler), bridge.args, bridge.kwargs)
                if option == "warmup":  # plain in burn-in: the controlled noise grows with the distance to the centre
                    base.active = t >= self.num_warmup or not stepper.program.phase(t - schedule.stage_start()).burn_in
                info = stepper.step(batch, t - (schedule.stage_start() if schedule else 0))
                if t < self.num_warmup and (schedule.in_window(t) if schedule else t >= self.num_warmup // 2):
                    window.observe(info.log_posterior, info.diverging)
                if schedule is not None and t < self.num_warmup:
                    schedule.observe(t, schedule.to_theta(stepper.latents()))
                    if schedule.due(t):  # the next stage of warm-up, in the metric this one's positions give
                        behind, restart = window.close(parallel is None)
                        theta = schedule.to_theta(stepper.latents())
                        if restart is not None:  # a straggler neither shapes the metric nor stays where it is
                            theta = {k: v.index_copy(0, restart[0], v[restart[1]]) for k, v in theta.items()}
                            self.restarted[restart[0].cpu()] += 1
                        big = batch.indices if batch_iter else {k: v[0] for k, v in sampler.larger(4096).items()}
                        curvature = schedule.hessian(base, Batch(big, batch.args, batch.kwargs))
                        keep = None if restart is None else ~behind
                        moved = schedule.next_map(next(iter(theta.values())), curvature, keep=keep)
                        if option == "warmup":  # recentred at each window's mean: one full-data pass
                            self.control_variate = base.control = recentre(self.results.full_bridge, schedule, reducer)
                        if moved is not None:
                            stepper = stage_stepper(schedule.to_z(theta), stepper.mode)
                            stepper.log_posterior_fn = schedule.wrap(base)
                            if checkpoint is not None:
                                checkpoint.stepper = stepper
                        elif restart is not None:
                            stepper.restart(*restart)
                if t + 1 == self.num_warmup:
                    _, restart = window.close(parallel is None)
                    if restart is not None:  # sampling starts from healthy chains only
                        stepper.restart(*restart)
                        self.restarted[restart[0].cpu()] += 1
                    stepper.end_warmup()
                diverged = bool(info.diverging.any()) if self.on_divergence == "stop" else False
                if t < self.num_warmup:  # a tensor until the run ends: no wait for the device on every step
                    self.num_warmup_divergences = self.num_warmup_divergences + info.diverging.to(torch.int64)
                elif (t - self.num_warmup + 1) % self.thin == 0:
                    draw = schedule.to_theta(stepper.latents()) if schedule else stepper.latents()
                    self.results.record(kept, draw, info)
                    kept += 1
                if checkpoint is not None:
                    checkpoint.step_done(t + 1, kept, stopped=diverged)
                if t + 1 == self.num_warmup:
                    bar.set_description("Sample")
                if not quiet and (t % 50 == 0 or t + 1 == total):
                    bar.set_postfix(
                        lp=f"{float(info.log_posterior.float().mean()):.4g}",
                        step_size=f"{float(info.step_size.float().mean()):.3g}",
                    )
                bar.update()
                if diverged:
                    warnings.warn(
                        f"a chain diverged at step {t} (non-finite log density or gradient) and on_divergence='stop': "
                        f"the run ends with {kept} draws per chain.",
                        stacklevel=2,
                    )
                    break
        except KeyboardInterrupt:
            if checkpoint is not None:
                checkpoint.write()  # as the last completed step left the run
            self._truncate(kept, stepper)
            warnings.warn(f"interrupted: keeping the {kept} draws per chain taken so far.", stacklevel=2)
            raise
        except BaseException:
            self._truncate(kept, stepper)  # the draws taken stay readable; the buffers beyond them are dropped
            raise
        finally:
            bar.close()
        self._truncate(kept, stepper)
        self.results.stats = {  # statistics of a gradient noise the kernel did not estimate are NaN: leave them out
            k: v for k, v in self.results.stats.items() if not (k in _NOISE_STATS and bool(v.isnan().all()))
        }
        if parallel is not None:
            parallel.gather(self)
        if diverged and kept == 0:
            raise RuntimeError(
                "a chain diverged during warmup and on_divergence='stop'; no draw was kept. "
                "Lower the step size, or use on_divergence='continue'."
            )
        if self.num_samples > 0:
            self.results.stats["repeated"] = repeated_draws(self.results.draws)
            if self.distributed != "chains":  # each chain's warm-up, repeated along its draws (sample_stats' shape)
                shape = self.results.stats["repeated"].shape
                for name, value in (("warmup_divergences", self.warmup_divergences), ("restarted", self.restarted)):
                    self.results.stats[name] = value[:, None].expand(shape).to(self.results.stats["repeated"].device)
        passes = data_passes(bridge.plates, total * self.num_chains)
        warn_unhealthy(self.results.draws, self.results.stats, self.num_warmup_divergences, data_passes=passes)
        warn_uncorrected_noise(self.results.stats, self.num_samples, getattr(self.kernel, "adapts", False))
        if self.num_samples and parallel is None and start < total:  # not for a finished run read back
            probe = probe_gradient_noise(self.kernel, bridge, stepper.latents(), seed, total, stepper.log_posterior_fn)
            warn_ignored_noise(probe)
        return self

    def _bind(self, args: tuple, kwargs: dict, batches: Iterable | None) -> tuple[RunRecord, Iterator | None]:
        """The run's record (the model on the steps' data and on the full data) and the DataLoader's iterator."""
        model = self.kernel.model
        if batches is None:
            bridge = ModelBridge(model, args, kwargs)
            return RunRecord(bridge, bridge, args, kwargs), None
        if not isinstance(batches, Iterable) or isinstance(batches, (Tensor, str)):
            raise TypeError(
                f"batches must be an iterable of minibatches (e.g. a DataLoader), got {type(batches).__name__}."
            )
        batch_iter = cycle(batches)
        first = next(batch_iter)
        try:
            bridge = ModelBridge(model, *first)
        except (TypeError, ValueError, IndexError, RuntimeError) as error:
            # a ModelError is the data's fault, unless torch failed inside the model on this element (its cause)
            if isinstance(error, ModelError) and not isinstance(error.__cause__, RuntimeError):
                raise
            raise TypeError(
                f"the model failed on the first element of batches ({first_line(error)}); batches must yield a "
                "tuple of the model's positional arguments or a dict of its keyword arguments."
            ) from error
        full = ModelBridge(model, args, kwargs) if (args or kwargs) else None
        return RunRecord(bridge, full, args, kwargs), itertools.chain([first], batch_iter)

    def _truncate(self, kept: int, stepper: ChainStepper) -> None:
        self.results.settle()
        if isinstance(self.num_warmup_divergences, Tensor):
            self.warmup_divergences = self.num_warmup_divergences.cpu()
            self.num_warmup_divergences = int(self.warmup_divergences.sum())
        self.state = stepper.final_state
        self.metric_map = self._schedule.affine if self._schedule is not None else None
        if kept < self.num_samples:
            self.results.draws = {k: v[:, :kept] for k, v in self.results.draws.items()}
            self.results.stats = {k: v[:, :kept] for k, v in self.results.stats.items()}
            self.num_samples = kept
