r"""Multilevel MCMC: the driver that runs :class:`~.sweep.Sweep` (its mathematics) through warm-up and sampling.

Warm-up starts each chain at a draw of the Laplace approximation of its globals' marginal (:mod:`.start`: a
Newton climb from where Pyro's initialisation put it). Its windows end at 10%, 20%, 35% and 60% of
``num_warmup``; at each end the sweep takes each chain's window (its globals and its locals' mean) and renews its
reference point, curvatures and the globals' mass matrix (:meth:`~.sweep.Sweep.adapt_to`). The draws go to a
:class:`~pyro_scalable.infer.record.RunRecord`, so the result surface is ``pyro.infer.MCMC``'s, as every engine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from torch import Tensor
from tqdm.auto import tqdm

from pyro_scalable.arguments import check_count, check_device, check_flag, check_seed
from pyro_scalable.bridge import FullDataModel
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.row_groups import row_groups
from pyro_scalable.infer.health import warn_unhealthy
from pyro_scalable.infer.multilevel.start import laplace_start
from pyro_scalable.infer.multilevel.sweep import Sweep
from pyro_scalable.infer.record import RunRecord
from pyro_scalable.infer.remedies import Degenerate
from pyro_scalable.infer.results import Draws, FullDataKernel

__all__ = ["MultilevelMCMC"]

WINDOWS = (0.10, 0.20, 0.35, 0.60)  # fractions of warm-up at which the reference and the preconditioners are renewed


class MultilevelMCMC(Draws):
    """Metropolis-within-Gibbs for a model with a group plate: exact block moves of the groups, then the globals.

    Args:
        model: a Pyro model with a **group plate** (a ``pyro.plate`` that is not subsampled, holding a latent per
            group) and one subsampled **data plate** whose rows each read one group, e.g.
            ``pyro.sample("obs", dist.Normal(a[g[idx]] + b[g[idx]] * x[idx], s), obs=y[idx])``. The rows' groups are
            read from the model (:func:`~pyro_scalable.bridge.row_groups.row_groups`).
        num_samples: draws kept per chain (one per sweep).
        num_warmup: sweeps of warm-up per chain (module docstring).
        num_chains: chains, run together.
        plate: the group plate's name, where the model has several.
        groups_per_step: groups moved per sweep (default: all). Fewer make a sweep cheaper and mix the locals less
            per sweep; they are drawn uniformly without replacement, the same for every chain.
        global_steps: leapfrog steps of the globals' HMC trajectory per sweep (default 3; each reads every row).
        local_steps: Newton moves of each group per sweep (default 1; each reads the group's rows once).
        proxy: move on a second-order proxy of the rows' log-likelihood and correct to the exact density in a
            delayed-acceptance stage (:mod:`.proxy`): a sweep then reads every row twice, forward only, instead of
            about ten times with gradients. Default: on from :data:`~.sweep.PROXY_ROWS` rows.
        seed: the run's random seed (default: drawn from torch's generator).
        init_strategy: Pyro's initialisation strategy for the chains' starting points.
        draws_device: where draws are kept (default CPU).
        progress_bar: show a tqdm progress bar of the sweeps.

    After ``run``, the result surface is ``pyro.infer.MCMC``'s (``get_samples``, ``summary``, ``diagnostics``,
    ``to_inference_data``); ``sample_stats`` has each chain's mean acceptance of its local moves (``accept_prob``) and
    of its global ones (``accept_global``); ``step_sizes`` the steps warm-up chose; ``data_passes`` the passes made;
    ``restarted`` how often warm-up restarted each chain from another (:meth:`_restart_stuck`); ``proxy_used``
    whether sampling ran on the rows' proxy.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(g, y):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        ...     with pyro.plate("groups", 4):
        ...         b = pyro.sample("b", dist.Normal(mu, 1.0))
        ...     with pyro.plate("data", len(y), subsample_size=8) as idx:
        ...         pyro.sample("obs", dist.Normal(b[g[idx]], 1.0), obs=y[idx])
        >>> g = torch.arange(40) % 4
        >>> y = g.float() + torch.randn(40, generator=torch.Generator().manual_seed(0))
        >>> mcmc = MultilevelMCMC(model, num_samples=100, num_warmup=100, seed=0).run(g, y)
        >>> mcmc.get_samples()["b"].shape
        torch.Size([400, 4])

    """

    def __init__(
        self,
        model: Callable,
        num_samples: int = 1000,
        num_warmup: int = 1000,
        num_chains: int = 4,
        *,
        plate: str | None = None,
        groups_per_step: int | None = None,
        global_steps: int | None = None,
        local_steps: int | None = None,
        proxy: bool | None = None,
        seed: int | None = None,
        init_strategy: Callable = init_to_uniform,
        draws_device: torch.device | str = "cpu",
        progress_bar: bool = True,
    ):
        if not callable(model):
            raise TypeError(f"model must be a Pyro model (a callable), got {model!r}.")
        self.num_samples = check_count("num_samples", num_samples)
        self.num_warmup = check_count("num_warmup", num_warmup, least=0)
        self.num_chains = check_count("num_chains", num_chains)
        if plate is not None and not isinstance(plate, str):
            raise TypeError(f"plate must be the group plate's name (a str), got {plate!r}.")
        self.plate = plate
        self.groups_per_step = check_count("groups_per_step", groups_per_step, optional=True)
        self.global_steps = check_count("global_steps", global_steps, optional=True)
        self.local_steps = check_count("local_steps", local_steps, optional=True)
        if proxy is not None:
            proxy = check_flag("proxy", proxy)
        self.proxy = proxy
        self.seed = check_seed("seed", seed)
        self.init_strategy = init_strategy
        self.draws_device = check_device("draws_device", draws_device)
        self.progress_bar = check_flag("progress_bar", progress_bar)
        self.kernel = FullDataKernel(FullDataModel(model))
        self.step_sizes: dict[str, list[float]] = {}  # each chain's, for the local and the global moves
        self.restarted = torch.zeros(self.num_chains, dtype=torch.long)  # per chain: warm-up's restarts
        self.data_passes = 0.0
        self.proxy_used = False  # whether sampling ran on the rows' proxy (warm-up may give it up)
        self.results = None

    # ------------------------------------------------------------------ running
    def run(self, *args: Any, **kwargs: Any) -> MultilevelMCMC:
        """Warm up, then keep ``num_samples`` sweeps of every chain; return self."""
        bridge = ModelBridge(self.kernel.model.model, args, kwargs)
        groups = row_groups(bridge, self.plate)
        sweep = Sweep(bridge, groups, self)
        seed = self.seed if self.seed is not None else int(torch.randint(2**31, ()).item())
        generator = torch.Generator(device=bridge.device).manual_seed(seed)
        latents = bridge.init_latents(self.num_chains, self.init_strategy, seed=seed)
        self.restarted = torch.zeros(self.num_chains, dtype=torch.long)
        theta, b = sweep.layout.split(latents)
        sweep.adapt_to(theta[:, None], b, b)
        theta, b = laplace_start(sweep, theta, b, generator)
        sweep.adapt_to(theta[:, None], b, b, proxy=True)
        self.results = RunRecord(bridge, bridge, args, kwargs)
        windows = sorted({int(f * self.num_warmup) for f in WINDOWS if int(f * self.num_warmup) >= 10})
        start = time.perf_counter()
        bar = tqdm(total=self.num_warmup + self.num_samples, desc="Warmup", disable=not self.progress_bar)
        window_theta: list[Tensor] = []
        window_b = torch.zeros_like(b)
        for t in range(self.num_warmup):
            theta, b, _ = sweep(theta, b, generator, adapt=True)
            bar.update()
            window_theta.append(theta)
            window_b += b
            if t + 1 in windows:
                window, b_mean = torch.stack(window_theta, 1), window_b / len(window_theta)
                theta, b, window, b_mean = self._restart_stuck(sweep, theta, b, window, b_mean)
                sweep.adapt_to(window, b_mean, b, proxy=True)
                window_theta, window_b = [], torch.zeros_like(b)
            elif t + 1 < self.num_warmup:
                sweep.refit_if_stale(theta, b)
        sweep.fix_steps()
        self.results.allocate(sweep.layout.join(theta, b), self.num_samples, self.draws_device)
        bar.set_description("Sample")
        for t in range(self.num_samples):
            theta, b, info = sweep(theta, b, generator, adapt=False)
            self.results.record(t, sweep.layout.join(theta, b), info)
            bar.update()
        bar.close()
        self.results.settle()
        self.step_sizes = {"local": sweep.local_step.step.tolist(), "global": sweep.global_step.step.tolist()}
        self.data_passes = sweep.rows_read / groups.group.shape[0]
        self.proxy_used = sweep.proxy
        self.seconds = time.perf_counter() - start
        warn_unhealthy(self.results.draws, {}, data_passes=self.data_passes, stalled=_stalled(sweep, theta))
        return self

    def _restart_stuck(self, sweep: Sweep, theta: Tensor, b: Tensor, window: Tensor, b_mean: Tensor):
        """Restart, at a window's end, each chain whose steps warm-up shrank below a tenth of the yardstick chain's.

        A chain that wandered into a region far narrower than the posterior's bulk (a centred funnel's neck, where
        the group scale is near zero) adapts its steps to that region and can stay there for the rest of the run.
        The yardstick is the upper middle chain by step (the larger of two); a stuck chain takes its state, its
        window and its steps. Only in warm-up: the draws kept are still each chain's own Markov chain from wherever
        warm-up left it.
        """
        if theta.shape[0] < 2:
            return theta, b, window, b_mean
        kinds = _kinds(sweep, theta)
        stuck = torch.zeros(theta.shape[0], dtype=torch.bool, device=theta.device)
        donor = None
        for kind in kinds.values():
            below, donor = _below_yardstick(kind.final)
            stuck |= below
        if not stuck.any():
            return theta, b, window, b_mean
        restarted = [torch.where(_along(stuck, x), x[donor], x) for x in (theta, b, window, b_mean)]
        for kind in kinds.values():
            kind.step = torch.where(stuck, kind.step[donor], kind.step)
        self.restarted += stuck.long().cpu()
        return tuple(restarted)


STUCK = 0.1  # a chain whose step of either kind falls below this fraction of the yardstick chain's is stuck


def _kinds(sweep: Sweep, theta: Tensor) -> dict:
    """The kinds of step a chain takes: its groups' (local) and, where there are any, its shared latents' (global)."""
    return {"local": sweep.local_step, **({"global": sweep.global_step} if theta.shape[-1] else {})}


def _below_yardstick(steps: Tensor) -> tuple[Tensor, Tensor]:
    """The chains whose ``steps`` are below :data:`STUCK` times the yardstick chain's, and the yardstick chain.

    The yardstick is the upper middle chain by step (the larger of two).
    """
    yardstick = steps.argsort()[steps.shape[0] // 2]
    return steps < STUCK * steps[yardstick], yardstick


def _stalled(sweep: Sweep, theta: Tensor) -> Degenerate | None:
    """The chains whose steps stalled after warm-up's last restart check: what to tell the user (else ``None``).

    Such a chain mixes as many times slower as its step is smaller, so the length a run's ESS asks for would not
    mend it.
    """
    if theta.shape[0] < 2:
        return None
    found = []
    for name, kind in _kinds(sweep, theta).items():
        below, yardstick = _below_yardstick(kind.step)
        if below.any():
            chains = torch.nonzero(below).flatten().tolist()
            found.append(
                f"the {name} step of chain{'s' if len(chains) > 1 else ''} {', '.join(map(str, chains))} ended at "
                f"{float(kind.step[below].max()):.2g}, below a tenth of chain {int(yardstick)}'s "
                f"{float(kind.step[yardstick]):.2g}"
            )
    if not found:
        return None
    return Degenerate(
        "; ".join(found) + " (a chain stuck in a narrow region after warm-up's last restart check)",
        "a stuck chain moves as many times slower as its step is smaller, so running longer will not mend it: run "
        "again with another seed",
    )


def _along(mask: Tensor, x: Tensor) -> Tensor:
    """A per-chain ``mask`` shaped to broadcast over ``x``'s trailing dimensions."""
    return mask.reshape(mask.shape + (1,) * (x.dim() - 1))
