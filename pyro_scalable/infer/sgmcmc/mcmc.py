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

import operator
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from pyro_scalable.arguments import check_device, check_flag, check_seed
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.results import Draws
from pyro_scalable.infer.schedules import check_schedule
from pyro_scalable.infer.sgmcmc import phases, run_state
from pyro_scalable.infer.sgmcmc.distributed import DistributedMode
from pyro_scalable.infer.sgmcmc.metric import check_metric
from pyro_scalable.infer.sgmcmc.program import KernelContract
from pyro_scalable.infer.sgmcmc.run_arguments import check_choices, refuse_pyro_spellings

__all__ = ["StochasticMCMC"]


class StochasticMCMC(Draws):
    """Run a stochastic-gradient MCMC kernel on a Pyro model, with many chains, and collect the draws.

    Args:
        kernel: an engine's Pyro-facing class, e.g. ``SGHMC(model, step_size=1e-3)``.
        num_samples: draws kept per chain (after thinning).
        num_warmup: steps per chain before the first kept draw (a kernel that learns its step size in warm-up
            needs some: with ``num_warmup=0`` it is refused, with the reason).
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
            gather of ``num_chains × B`` rows. The chains' gradient noise is then one draw, so they are not
            independent given the data: between-chain r_hat and the pooled ESS can look better than the chains are.
            Default off.
        gradient: the gradient estimator's class, or any callable ``density -> GradientEstimator``
            (:mod:`pyro_scalable.infer.gradients.estimator`), called with each density the run's steps take their
            gradient of (the model's log posterior, with the control variate and in warm-up's metric's variables
            where the run has them). ``None`` (the default): ``NoiseEstimatingGradient`` in warm-up and where the
            kernel corrects for or reports the gradient noise, ``PlainGradient`` where it ignores it. Where warm-up
            chooses the step size, the estimator must measure the noise (``measures_noise``).
        full_batch: a full-batch run is meant. A model whose likelihood runs on all of 10⁴ or more rows at every step
            (its data plate without ``subsample_size``, or no plate) is otherwise named with a warning, once per
            run, with the plate that would subsample it (:mod:`pyro_scalable.bridge.subsampling`).

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
        full_batch: bool = False,
        gradient: Callable[[Any], Any] | None = None,
        **unknown: Any,
    ):
        refuse_pyro_spellings(unknown)
        if not isinstance(kernel, KernelContract):
            raise TypeError(
                f"kernel must be an engine such as SGLD(model, ...) or SGHMC(model, ...) (the calls of "
                f"pyro_scalable.infer.sgmcmc.program.KernelContract), got {kernel!r}."
            )
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
        self.full_batch = check_flag("full_batch", full_batch)
        self.metric = check_metric(metric)
        if gradient is not None and not callable(gradient):
            raise TypeError(
                "gradient must be a gradient estimator's class (e.g. pyro_scalable.infer.gradients.PlainGradient) or "
                f"a callable density -> GradientEstimator, got {gradient!r}."
            )
        self.gradient = gradient
        if distributed not in ("data", "chains", None):
            raise ValueError(f"distributed must be 'data', 'chains' or None, got {distributed!r}.")
        self.kernel = kernel
        self.num_samples = operator.index(num_samples)
        self.num_warmup = operator.index(num_warmup)
        if kernel.adapts and self.num_warmup == 0:
            raise ValueError(
                f"{kernel!r} learns its step size (or metric) in warm-up, but num_warmup=0: give num_warmup "
                "(a few hundred steps), or a step_size."
            )
        self.num_chains = operator.index(num_chains)
        self.thin = operator.index(thin)
        self.kept = kernel.kept_draws(self.thin)  # which steps after warm-up become draws (.kept)
        steps = self.num_warmup + self.kept.steps(self.num_samples, self.num_warmup)  # known before the run
        check_schedule("step_size", kernel.step_size, steps)
        check_schedule("temperature", kernel.temperature, steps, allow_zero=True)
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
        self.control_variate = self.mode_search = self.metric_map = None

    # ------------------------------------------------------------------ running
    def run(self, *args: Any, batches: Iterable | None = None, **kwargs: Any) -> StochasticMCMC:
        """Sample, and return this driver: the result (``get_samples``, ``summary``, ``to_inference_data``, ...).

        ``args``/``kwargs`` are the model's, on the full data. With ``batches`` (e.g. a ``DataLoader``), each step
        calls the model on the next element instead — a tuple of positional arguments or a dict of keyword
        arguments, whose plate uses ``subsample=idx`` — and ``args``/``kwargs`` (if given) are the full data for the
        log-likelihood and ``arviz.from_pyro``. The phases are those of :mod:`.phases`.
        """
        # a stopped earlier run may have kept fewer draws, a chain-parallel one a rank's share of the chains
        self.num_samples, self.num_chains = self._num_samples_requested, self._num_chains_requested
        state = phases.prepare(self, args, kwargs, batches)  # the model bound, the chains started, warm-up's stepper
        try:
            phases.resume(self, state, batches)  # a checkpoint's run goes on from its last completed step
            phases.attach_control_variate(self, state)  # the gradient the control-variate policy chose
            phases.sample(self, state)  # warm-up and sampling, step by step
            phases.finish(self, state)  # the statistics, the ranks' draws gathered, the health checks
        finally:
            run_state.release(state)  # the checkpoint's lock
            self._keep(run_state.outcome(state))  # what was computed stays readable, also after an interruption
        return self

    def _keep(self, outcome: run_state.Outcome) -> None:
        self.results, self.state, self.metric_map = outcome.results, outcome.state, outcome.metric_map
        self.control_variate, self.mode_search = outcome.control_variate, outcome.mode_search
        self.warmup_divergences, self.restarted = outcome.warmup_divergences, outcome.restarted
        self.num_warmup_divergences = int(outcome.warmup_divergences.sum())
        self.num_samples, self.num_chains = outcome.num_samples, outcome.num_chains
