r"""``SWAG``: constant-step SGD on a Pyro model's minibatches, through the SG-MCMC kernels' T = 0 path.

The optimiser is :class:`~pyro_scalable.infer.SGHMC` at temperature 0, which is exactly
``torch.optim.SGD(lr, momentum)`` on the negative log joint (:mod:`pyro_scalable.infer.sgmcmc.sghmc`), stepped for
all runs at once by the SG-MCMC :class:`~pyro_scalable.infer.sgmcmc.chains.ChainStepper` (``vmap`` over runs, one
after another where the model cannot be vectorised) on minibatches of the model's own subsampled plate. Each run
starts from its own point (its own MAP by default, so that MultiSWAG's runs can find different modes), takes
``burn_in_epochs`` epochs to reach SGD's stationary spread, then ``num_epochs`` epochs with a snapshot every
``snapshot_every`` steps, whose moments :mod:`.moments` accumulates.

**The step.** On the log joint :math:`\log p(\theta) + \frac NB\sum_{\mathcal B}\log p(y_i\mid\theta)` (a sum over
the data, not a mean), SGD at a small constant step :math:`\eta` with momentum :math:`\mu` has the stationary
covariance :math:`C` that solves :math:`HC + CH = \frac{\eta}{1-\mu}S`, :math:`S` the covariance of the minibatch
gradient. Mandt, Hoffman & Blei (2017, "Stochastic gradient descent as approximate Bayesian inference", Thm. 2)
give the constant step whose stationary Gaussian is closest in KL to the posterior among isotropic steps:
:math:`\eta/(1-\mu) = 2d/\mathrm{tr}\,S`. ``lr="auto"`` uses it, with :math:`\mathrm{tr}\,S` estimated from
:data:`NOISE_PROBES` minibatch gradients at the first run's start, and capped so that the effective step
:math:`\eta/(1-\mu)` is at most :math:`1/\lambda_{\max}` (:math:`\lambda_{\max}` the largest curvature of the
minibatch log joint there, by power iteration on Hessian-vector products). Mandt's rate looks at the noise only:
on a network it can be two orders of magnitude above the step at which SGD leaves the mode, and a stiff direction
without noise (a sharp prior, e.g. the previous episode's posterior from ``as_prior``) makes it diverge. Heavy
ball's own stability bound, :math:`\eta\lambda < 2(1+\mu)`, is too loose: the curvature grows away from the mode,
so SGD at half of that bound still leaves it; the cap, :math:`\eta\lambda \le 1-\mu`, is :math:`2(1+\mu)/(1-\mu)`
times below the bound (38 at :math:`\mu = 0.9`). SWAG's paper sets the step by hand per data set; a given ``lr``
is used as is.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor
from torch.func import grad
from tqdm.auto import tqdm

from pyro_scalable.arguments import check_choice, check_count, check_flag, check_seed
from pyro_scalable.bridge.checks import ModelError, one_subsampled_plate
from pyro_scalable.bridge.log_posterior import LogPosterior
from pyro_scalable.bridge.minibatches import EpochSampler
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge
from pyro_scalable.bridge.plates import FullDataModel
from pyro_scalable.infer.autodiff import hvp
from pyro_scalable.infer.gradients import PlainGradient
from pyro_scalable.infer.linearized.layout import ParameterLayout
from pyro_scalable.infer.mode_search import find_mode
from pyro_scalable.infer.schedules import Cyclical
from pyro_scalable.infer.sgmcmc.adaptation import Tuned
from pyro_scalable.infer.sgmcmc.chains import ChainStepper
from pyro_scalable.infer.sgmcmc.sghmc import SGHMC, sgd_hyperparameters
from pyro_scalable.infer.swag.check import SPREAD_TOLERANCE, ApproximationWarning, GaussianCheck, check_gaussian
from pyro_scalable.infer.swag.moments import MomentAccumulator, covariance_factors
from pyro_scalable.infer.swag.posterior import SWAGPosterior

__all__ = ["SWAG"]

NOISE_PROBES = 32  # minibatch gradients that estimate tr S for lr="auto"
SWAG_MODE_TOLERANCE = 0.01  # the start SGD leaves from: a mode to 0.01·√d posterior sds (a control variate asks 0.1)
POWER_ITERATIONS = 30  # Hessian-vector products that find the stiffest direction for lr="auto"


@dataclass(frozen=True)
class _RootOf:
    """SGHMC's step size ε = √η for a learning-rate schedule η_t (T = 0: SGD's lr is ε² at unit mass)."""

    schedule: Callable[[Tensor], Tensor]

    def __call__(self, step_count: Tensor) -> Tensor:
        return self.schedule(step_count).sqrt()


class SWAG:
    r"""SWAG and MultiSWAG for a Pyro model whose likelihood sits in a subsampled ``pyro.plate``.

    Args:
        model: the Pyro model, as written for SVI or SG-MCMC (``subsample_size`` on the data plate).
        lr: SGD's learning rate on the negative log joint (a sum over the data: a mean-loss rate divided by N);
            ``"auto"``: :math:`2(1-\mu)d/\mathrm{tr}\,S`, at most :math:`(1-\mu)/\lambda_{\max}` (module
            docstring); ``stats`` records both.
        momentum: SGD's momentum μ in [0, 1).
        cycle_length: steps per cosine cycle of the learning rate (from ``lr`` down to near 0), with a snapshot
            at the end of each cycle, where the rate is lowest; ``None``: a constant rate.
        num_epochs: epochs of snapshots (after burn-in).
        burn_in_epochs: epochs at the SWAG rate before the first snapshot.
        snapshot_every: steps between snapshots (default one epoch; a cycle with ``cycle_length``).
        rank: K, the number of last snapshots kept as deviations (``covariance="low_rank"``).
        covariance: ``"low_rank"`` (SWAG) or ``"diagonal"`` (SWAG-Diagonal).
        num_runs: independent runs (MultiSWAG), stepped together.
        start: where each run starts: ``"map"`` (each run's own MAP, found by minibatch Adam then full-data
            L-BFGS from its own random initial point), a dict of constrained latent values, or a trained
            autoguide (its ``median()``), shared by all runs.
        minibatches: ``"independent"`` (each minibatch drawn with replacement, independently: the noise
            ``lr="auto"``'s rule assumes) or ``"epoch"`` (each point once per epoch, as a DataLoader shuffles). Over
            an epoch the shuffled minibatches' noise sums to zero, so SGD's spread is smaller than the rule's, by
            a factor of a few in sd where SGD relaxes within an epoch.
        chain_method: ``"vectorized"`` or ``"sequential"`` over runs.
        seed: seeds the initial points, the MAP searches and the minibatches.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro_scalable.infer import SWAG
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        ...     with pyro.plate("data", x.shape[0], subsample_size=50) as idx:
        ...         pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=None if y is None else y[idx])
        >>> x = torch.randn(500, 2); y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(500)
        >>> posterior = SWAG(model, num_epochs=20, rank=10, seed=0, progress_bar=False).run(x, y)
        >>> posterior.get_samples(100, seed=0)["w"].shape
        torch.Size([100, 2])

    """

    def __init__(
        self,
        model: Callable,
        *,
        lr: float | Literal["auto"] = "auto",
        momentum: float = 0.9,
        cycle_length: int | None = None,
        num_epochs: int = 20,
        burn_in_epochs: int = 1,
        snapshot_every: int | None = None,
        rank: int = 20,
        covariance: Literal["low_rank", "diagonal"] = "low_rank",
        num_runs: int = 1,
        start: Any = "map",
        minibatches: Literal["epoch", "independent"] = "independent",
        chain_method: Literal["vectorized", "sequential"] = "vectorized",
        seed: int | None = None,
        check: bool = True,
        progress_bar: bool = True,
    ):
        if not callable(model):
            raise TypeError(f"model must be a Pyro model (a callable), got {type(model).__name__}.")
        if not (lr == "auto" or (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0)):
            raise ValueError(f"lr must be a positive number or 'auto', got {lr!r}.")
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}.")
        check_count("cycle_length", cycle_length, optional=True)
        check_count("num_epochs", num_epochs)
        check_count("burn_in_epochs", burn_in_epochs, 0)
        check_count("snapshot_every", snapshot_every, optional=True)
        check_count("rank", rank)
        check_choice("covariance", covariance, ("low_rank", "diagonal"))
        if covariance == "low_rank" and rank < 2:
            raise ValueError(f"covariance='low_rank' needs rank >= 2 (K - 1 divides D Dᵀ), got {rank}.")
        check_count("num_runs", num_runs)
        if not (start == "map" or isinstance(start, Mapping) or callable(getattr(start, "median", None))):
            raise TypeError(
                "start must be 'map', a dict of constrained latent values by site, or a trained autoguide (with "
                f"median()); got {type(start).__name__}."
            )
        check_choice("minibatches", minibatches, ("epoch", "independent"))
        check_choice("chain_method", chain_method, ("vectorized", "sequential"))
        check_seed("seed", seed)
        check_flag("check", check)
        check_flag("progress_bar", progress_bar)
        self.model = model.model if isinstance(model, FullDataModel) else model
        self.lr, self.momentum, self.cycle_length = lr, float(momentum), cycle_length
        self.num_epochs, self.burn_in_epochs, self.snapshot_every = num_epochs, burn_in_epochs, snapshot_every
        self.rank, self.covariance, self.num_runs = rank, covariance, num_runs
        self.start, self.minibatches, self.chain_method = start, minibatches, chain_method
        self.seed, self.check, self.progress_bar = seed, check, progress_bar
        self.stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ the run
    def run(self, *args: Any, **kwargs: Any) -> SWAGPosterior:
        """Run SWAG on the full data ``args``/``kwargs`` (the model's own arguments); returns the posterior."""
        began = time.perf_counter()
        seed = int(torch.randint(0, 2**62, ())) if self.seed is None else self.seed
        bridge = ModelBridge(FullDataModel(self.model), args, kwargs)
        plate = one_subsampled_plate(bridge, "SWAG (its snapshots spread by the minibatch noise)")
        if plate.subsample_size >= plate.size:
            raise ModelError(
                f"the plate '{plate.name}' is not subsampled (subsample_size {plate.subsample_size} of {plate.size}): "
                "full-batch gradient descent converges to one point and SWAG's covariance would be zero. Give it "
                "subsample_size=B < N."
            )
        layout = ParameterLayout({name: site.unconstrained_shape for name, site in bridge.sites.items()})
        starts, searches = self._starts(bridge, seed)
        generator = torch.Generator(device=bridge.device).manual_seed(seed + 1)
        sampler = EpochSampler(
            bridge.plates, self.num_runs, generator, bridge.device, replacement=self.minibatches == "independent"
        )
        self._rates = (math.nan, math.nan)
        lr = self._learning_rate(bridge, layout, {k: v[0] for k, v in starts.items()}, seed)
        per_epoch = -(-plate.size // plate.subsample_size)
        every = self.snapshot_every or self.cycle_length or per_epoch
        burn_in = self.burn_in_epochs * per_epoch
        if self.cycle_length is not None:
            burn_in = -(-burn_in // self.cycle_length) * self.cycle_length  # snapshots at the ends of cycles
        num_snapshots = max(self.num_epochs * per_epoch // every, 2)
        settings = sgd_hyperparameters(lr, self.momentum)
        step_size: Any = settings["step_size"]
        if self.cycle_length is not None:
            step_size = _RootOf(Cyclical(initial=lr, cycle_length=self.cycle_length))
        kernel = SGHMC(
            self.model,
            step_size=step_size,
            friction=settings["friction"],
            temperature=0.0,
            gradient_noise="ignore",
            control_variate=None,
            init_strategy=init_to_uniform,
        )
        gradient = PlainGradient(LogPosterior(bridge, replacement=sampler.replacement))  # SGD's: the minibatch's
        stepper = ChainStepper(Tuned(kernel, gradient), bridge, starts, generator, self.chain_method)
        accumulator = MomentAccumulator(layout.flatten(starts, 1), min(self.rank, num_snapshots))
        total = burn_in + num_snapshots * every
        divergences = [0, 0]  # in burn-in, while snapshotting
        bar = tqdm(total=total, disable=not self.progress_bar, desc="SWAG")
        try:
            for t in range(total):
                info = stepper.step(Batch(next(sampler), bridge.args, bridge.kwargs), t, gradient)
                divergences[t >= burn_in] += int(info.diverging.sum())
                if t >= burn_in and (t - burn_in + 1) % every == 0:
                    accumulator.add(layout.flatten(stepper.latents(), 1).detach())
                if t % 50 == 0 or t + 1 == total:
                    bar.set_postfix(lp=f"{float(info.log_posterior.float().mean()):.4g}")
                bar.update()
        finally:
            bar.close()
        advice = f"the learning rate {lr:.3g} is too large for this model: pass a smaller lr= (e.g. {lr / 10:.3g})."
        if divergences[1]:
            raise FloatingPointError(
                f"{divergences[1]} SGD step(s) after burn-in had a non-finite log joint or gradient (rejected, so the "
                f"snapshots do not show SGD's spread); {advice}"
            )
        if divergences[0]:
            warnings.warn(
                f"{divergences[0]} SGD step(s) in burn-in had a non-finite log joint or gradient and were rejected "
                f"(the run went on from the last finite point); {advice}",
                stacklevel=2,
            )
        moments = accumulator.finish()
        if not bool(torch.isfinite(moments.mean).all() and torch.isfinite(moments.deviations).all()):
            raise FloatingPointError(f"SWAG's snapshots are not finite (the SGD diverged); {advice}")
        self.stats = {
            "lr": lr,
            "lr_noise": self._rates[0],
            "lr_stability": self._rates[1],
            "momentum": self.momentum,
            "steps": total,
            "burn_in_steps": burn_in,
            "snapshot_every": every,
            "num_snapshots": moments.num_snapshots,
            "burn_in_divergences": divergences[0],
            "mode_searches": searches,
        }
        if self.check:
            self.stats["check"] = self._check(bridge, layout, moments, lr, generator)
        self.stats["seconds"] = time.perf_counter() - began
        return SWAGPosterior(bridge, layout, moments, self.covariance, dict(self.stats))

    def _check(self, bridge, layout, moments, lr: float, generator: torch.Generator) -> list[GaussianCheck]:
        """Each run's :func:`check_gaussian`; a warning with the worst run's figures and the remedies."""
        checks = []
        for run in range(moments.mean.shape[0]):
            diagonal, factor = covariance_factors(moments, self.covariance, run)
            checks.append(check_gaussian(bridge, layout, moments.mean[run], diagonal, factor, generator=generator))
        # a network's Hessian is rarely definite at SWAG's mean: above 64 latents that is recorded, not warned
        failed = [(r, c) for r, c in enumerate(checks) if not c.passed and (c.exact or c.positive_definite)]
        if failed:
            run, worst = min(failed, key=lambda rc: (rc[1].positive_definite, rc[1].spread_low))
            which = f"run {run} of {len(checks)}: " if len(checks) > 1 else ""
            narrow = worst.positive_definite and worst.spread_low < SPREAD_TOLERANCE[0]
            remedy = (
                f"SGD at one learning rate ({lr:.3g}) spreads every direction alike, so where the curvature differs "
                "by orders of magnitude across directions (unscaled predictors, a network's flat directions) its "
                "snapshots barely move in the flat ones: standardise the predictors, or pass lr= to choose the step. "
                if narrow
                else ""
            )
            warnings.warn(
                f"SWAG's Gaussian is not the posterior here: {which}{worst.describe()}. {remedy}For the posterior "
                "of this model use StochasticMCMC (SG-MCMC) or the Laplace approximation (AutoLinearizedLaplace) "
                "at its MAP; SWAG(check=False) skips this check.",
                ApproximationWarning,
                stacklevel=3,
            )
        return checks

    def _starts(self, bridge: ModelBridge, seed: int) -> tuple[Latents, list]:
        """Each run's unconstrained start ``(R, ...)``: its own MAP, or the given point for every run."""
        if self.start != "map":
            values = dict(self.start) if isinstance(self.start, Mapping) else self.start.median(*bridge.args)
            missing = [name for name in bridge.sites if name not in values]
            if missing:
                raise ModelError(
                    f"start gives no value for latent site(s) {', '.join(map(repr, missing))}: give every latent "
                    "site's constrained value, or use start='map'."
                )
            point = bridge.unconstrain(
                {n: torch.as_tensor(values[n], dtype=s.dtype, device=bridge.device) for n, s in bridge.sites.items()}
            )
            return {n: v.detach().expand((self.num_runs,) + v.shape).clone() for n, v in point.items()}, []
        initial = bridge.init_latents(self.num_runs, init_to_uniform, seed=seed)
        modes, searches = [], []
        for r in range(self.num_runs):
            generator = torch.Generator(device=bridge.device).manual_seed(seed + 2 + r)
            mode, search = find_mode(
                bridge, {n: v[r] for n, v in initial.items()}, generator, tolerance=SWAG_MODE_TOLERANCE
            )
            modes.append(mode)
            searches.append(search)
        return {n: torch.stack([m[n] for m in modes]) for n in bridge.sites}, searches

    def _learning_rate(self, bridge: ModelBridge, layout: ParameterLayout, point: Latents, seed: int) -> float:
        if self.lr != "auto":
            return float(self.lr)
        generator = torch.Generator(device=bridge.device).manual_seed(seed + 1_000_003)
        sampler = EpochSampler(bridge.plates, 1, generator, bridge.device, replacement=True)
        probes = []
        gradient = grad(bridge.log_posterior)
        for _ in range(NOISE_PROBES):
            indices = {name: idx[0] for name, idx in next(sampler).items()}
            probes.append(layout.flatten(gradient(point, Batch(indices, bridge.args, bridge.kwargs))).double())
        trace = float(torch.stack(probes).var(0).sum())
        if not math.isfinite(trace) or trace <= 0:
            raise ModelError(
                f"lr='auto' found no minibatch gradient noise at the start (tr S = {trace:.3g}); pass lr= by hand."
            )
        noise_rate = 2.0 * (1.0 - self.momentum) * layout.num_params / trace
        # the effective step lr/(1 - μ) at most 1/λ on the stiffest direction (module docstring)
        batch = Batch({name: idx[0] for name, idx in next(sampler).items()}, bridge.args, bridge.kwargs)
        stiffest = _largest_curvature(lambda flat: bridge.log_posterior(layout.unflatten(flat), batch), point, layout)
        self._rates = (noise_rate, (1.0 - self.momentum) / stiffest if stiffest > 0 else math.inf)
        if self._rates[1] < self._rates[0] / 10:
            warnings.warn(
                f"lr='auto': Mandt's rate {noise_rate:.3g} is above the stable step {self._rates[1]:.3g} (curvature "
                f"{stiffest:.3g} in the stiffest direction), so SGD runs at the latter, and SWAG's covariance, which "
                f"grows with the step, comes out about {self._rates[0] / self._rates[1]:.3g} times narrower than "
                "Mandt's in the noisy directions. A direction that is stiff but quiet (a network's sharpest, or a "
                "sharp prior such as a previous posterior) causes this: one step size serves every direction. Pass "
                "lr= to choose the step yourself.",
                stacklevel=3,
            )
        return min(self._rates)


def _largest_curvature(log_joint, point: Latents, layout: ParameterLayout, iterations: int = POWER_ITERATIONS) -> float:
    """The largest eigenvalue of the negative Hessian of ``log_joint`` at ``point``, by power iteration on HVPs."""
    flat = layout.flatten(point).detach()
    vector = torch.randn(flat.shape, generator=torch.Generator(device=flat.device).manual_seed(0), dtype=flat.dtype)
    vector = vector.to(flat.device) / vector.norm()
    value = 0.0
    for _ in range(iterations):
        (product,) = hvp(log_joint, (flat,), (vector,))
        product = -product.detach()
        value = float(vector @ product)
        norm = product.norm()
        if not bool(torch.isfinite(norm)) or float(norm) == 0.0:
            break
        vector = product / norm
    return value
