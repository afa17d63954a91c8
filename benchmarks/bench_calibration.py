"""Benchmark of the gradient-noise correction (issue 7): posterior sd against minibatch size, and what it costs.

    python benchmarks/bench_calibration.py            # full run (about 11 minutes on 2 shared CPU cores)
    python benchmarks/bench_calibration.py --quick    # smoke-sized run (about 1.5 minutes)

Prints a markdown report and writes it to ``benchmarks/results/calibration.md`` (``--quick``: ``calibration_quick.md``;
``--out`` to change). Two parts:

1. **Posterior sd against minibatch size**, all samplers side by side in one run, on a conjugate Bayesian linear
   regression (N = 1,000, d = 2, x ~ N(0, I), w ~ N(0, I), known noise sd 1; float64) whose posterior is Gaussian
   in closed form. For each minibatch size B: per coordinate the sd of the draws over the exact posterior sd with its
   Monte-Carlo standard error (sd / sqrt(2 ESS), the ESS across chains), the largest mean error in posterior sds,
   and the ESS per 1,000 kept steps of one chain (smaller coordinate). Samplers:

   * ours, corrected: SGLD, SGHMC, PSGLD, SGNHT and BAOAB with their defaults (``step_size=None``: the step size
     comes from warm-up, and then ``gradient_noise="correct"``) — the user picks B and nothing else;
   * ours, uncorrected: SGLD and SGHMC with ``gradient_noise="estimate"`` (the same warm-up, so the same step size
     rule, but the noise is only measured), and with ``gradient_noise="ignore"`` at a fixed hand-picked step size;
   * ``posteriors`` 0.1.3's ``sgmcmc.sgld`` and ``sgmcmc.sghmc`` (``beta=0``), driven by a plain loop, at the step
     size (and friction) our warm-up chose for this B, and at the same hand-picked settings as ours.

   Every sampler runs the same number of steps from ``init_to_uniform`` (U(-2, 2)) and keeps the same draws. Our
   kernels that estimate the noise draw each chain's minibatch with replacement (the driver's default for them), and
   ours with ``"ignore"`` and posteriors are given minibatches drawn the same way; B = N = 1,000 is the full data
   (no subsampled plate: exact gradients, nothing to correct). posteriors has no warm-up, so where it runs at our
   warm-up's step size it spends the first half of warm-up at the hand-picked settings, as our warm-up's burn-in
   half spends it at the curvature bound.
2. **What the correction costs per step**: ours with ``gradient_noise="correct"`` (per-example gradients, one
   ``torch.func.vmap`` over single-example batches) against ``"ignore"``, same kernel (SGLD), same step size, same
   minibatches, on the regression (B = 100) and on a PyroModule MLP 10-50-1 (tanh, 601 weights, N = 4,000,
   B = 100), 64 chains (vectorised) and one chain. Time per step is ``(T(K steps) - T(k steps)) / (K - k)``
   (setup cancels); the two modes interleaved, repeated, the ratio of medians of per-repetition ratios reported.

Every run records the CPU other processes used meanwhile (``benchmarks/harness.py``). Compare ratios, not times.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from harness import (  # benchmarks/ is on sys.path when a script runs
    ForeignLoad,
    _code_version,
    clean_indices,
    is_clean,
    load_average,
    log,
    machine,
    write_report,
)
from pyro.nn import PyroModule, PyroSample
from pyro.ops.stats import effective_sample_size
from torch import Tensor, nn

from pyro_scalable.infer import BAOAB, PSGLD, SGHMC, SGLD, SGNHT, StochasticMCMC

RESULTS = Path(__file__).resolve().parent / "results"
NUM_DATA = 1000
DIM = 2
# Hand-picked settings, the same for ours ("ignore") and posteriors. SGLD: ε λ_max ≈ 0.1, the curvature bound alone
# (what our warm-up chooses on the full data). SGHMC: ε √λ_max ≈ 0.16 with a momentum decay 1 - εα = 0.5
# (torch.optim.SGD(lr=2.5e-5, momentum=0.5)).
HAND_SGLD = {"step_size": 1e-4}
HAND_SGHMC = {"step_size": 5e-3, "friction": 100.0}


# ====================================================================================== part 1: the regression
class Regression:
    """y = X w + N(0, 1) noise, w ~ N(0, I): the exact posterior is N(mean, cov)."""

    def __init__(self, num_data: int = NUM_DATA, dim: int = DIM, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_data, dim, generator=gen, dtype=torch.float64)
        w = torch.randn(dim, generator=gen, dtype=torch.float64)
        self.y = self.x @ w + torch.randn(num_data, generator=gen, dtype=torch.float64)
        precision = self.x.T @ self.x + torch.eye(dim, dtype=torch.float64)
        self.cov = torch.linalg.inv(precision)
        self.mean = self.cov @ (self.x.T @ self.y)
        self.sd = self.cov.diagonal().sqrt()
        self.curvature = float(torch.linalg.eigvalsh(precision).max())

    @property
    def num_data(self) -> int:
        return self.x.shape[0]

    def model(self, batch_size: int) -> Callable:
        """The Pyro model with a subsampled plate of ``batch_size`` (the full data at B = N)."""

        def model(x: Tensor, y: Tensor) -> None:
            w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
            with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
                pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

        return model

    def log_posterior(self, batch_size: int) -> Callable:
        """posteriors' ``log_posterior(params, idx)`` for C chains at once: the N/B scaling written by hand.

        ``params["w"]`` is (C, d) and ``idx`` (C, B) or ``None`` (the full data). The value is the sum over chains
        of each chain's minibatch log joint, so its gradient in row c is chain c's gradient: posteriors' SGLD and
        SGHMC updates are elementwise, and the C rows are C independent posteriors chains.
        """
        x, y, n = self.x, self.y, self.num_data

        def log_posterior(params: dict[str, Tensor], idx: Tensor | None) -> tuple[Tensor, Tensor]:
            w = params["w"]
            xb, yb = (x, y) if idx is None else (x[idx], y[idx])  # (C, B, d), (C, B)
            residual = yb - (xb @ w.unsqueeze(-1)).squeeze(-1) if idx is not None else yb - w @ x.T
            value = -0.5 * w.square().sum() - 0.5 * (n / residual.shape[-1]) * residual.square().sum()
            return value, value.detach()

        return log_posterior


@dataclass
class Row:
    """One sampler on one minibatch size: accuracy, mixing and what the sampler reported."""

    batch_size: int
    sampler: str
    noise: str  # how the gradient noise was treated
    step_size: float
    friction: float | None
    ratio: list[float]  # sd of the draws / exact sd, per coordinate
    mcse: list[float]  # Monte-Carlo standard error of each ratio
    mean_error: float  # largest |mean - exact mean| / exact sd over coordinates
    ess_per_1000: float  # smaller coordinate, per chain per 1,000 kept steps
    noise_ratio: float | None  # median over kept steps of the largest ε²V̂ / wanted noise (NaN: not estimated)
    uncorrected: float | None  # share of coordinates x steps where the correction was impossible
    seconds: float
    foreign: float | None  # cores other processes used during the run
    num_chains: int = 0
    notes: list[str] = field(default_factory=list)


def summarise(draws: Tensor, problem: Regression) -> tuple[list[float], list[float], float, float]:
    """Per coordinate sd ratio and its MCSE; largest mean error in sds; ESS per 1,000 steps of one chain."""
    chains, samples = draws.shape[:2]
    ratios, errors, ess_all = [], [], []
    for i in range(draws.shape[-1]):
        ess = float(effective_sample_size(draws[..., i], chain_dim=0, sample_dim=1))
        ratio = float(draws[..., i].std()) / float(problem.sd[i])
        ratios.append(ratio)
        errors.append(ratio / math.sqrt(2 * max(ess, 1.0)))
        ess_all.append(ess)
    mean_error = float(((draws.reshape(-1, draws.shape[-1]).mean(0) - problem.mean) / problem.sd).abs().max())
    return ratios, errors, mean_error, min(ess_all) / (chains * samples) * 1000


def run_ours(
    cls: type, problem: Regression, batch_size: int, noise_label: str, cfg: dict, chains: int, **options
) -> tuple[Row, dict]:
    """One of our kernels through ``StochasticMCMC``; returns the row and the chosen step size (and friction)."""
    kernel = cls(problem.model(batch_size), **options)
    mcmc = StochasticMCMC(
        kernel,
        num_samples=cfg["samples"],
        num_warmup=cfg["warmup"],
        num_chains=chains,
        seed=cfg["seed"],
        progress_bar=False,
        minibatches="independent",  # what a noise-estimating kernel gets by default; "ignore" runs get it too
    )
    probe = ForeignLoad()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(problem.x, problem.y)
    seconds = time.perf_counter() - start
    stats = mcmc.sample_stats
    draws = mcmc.get_samples(group_by_chain=True)["w"]
    ratio, mcse, mean_error, ess = summarise(draws, problem)
    step = float(stats["step_size"].float().median())
    friction = float(stats["friction"].float().median()) if "friction" in stats else options.get("friction")
    notes = sorted({str(w.message).split(":")[0][:90] for w in caught})
    row = Row(
        batch_size,
        cls.__name__,
        noise_label,
        step,
        friction,
        ratio,
        mcse,
        mean_error,
        ess,
        float(stats["noise_ratio"].float().median()) if "noise_ratio" in stats else None,
        float(stats["uncorrected"].float().mean()) if "uncorrected" in stats else None,
        seconds,
        probe.cores(),
        chains,
        notes,
    )
    return row, {"step_size": step, "friction": friction}


def run_posteriors(
    method: str,
    problem: Regression,
    batch_size: int,
    label: str,
    cfg: dict,
    chains: int,
    phases: list[tuple[int, dict]],
) -> Row:
    """posteriors' SGLD or SGHMC update (``beta=0``), C chains as the rows of one tensor, minibatches with replacement.

    ``phases`` is ``[(steps, hyperparameters), ...]``; the draws are the last ``cfg["samples"]`` steps.
    """
    import posteriors

    module = getattr(posteriors.sgmcmc, method)
    torch.manual_seed(cfg["seed"])  # posteriors draws its noise from torch's global generator
    gen = torch.Generator().manual_seed(cfg["seed"])
    params = {"w": torch.rand(chains, DIM, generator=gen, dtype=torch.float64) * 4.0 - 2.0}  # init_to_uniform
    state = module.init(params) if method == "sgld" else module.init(params, momenta=None)
    log_posterior = problem.log_posterior(batch_size)
    total = sum(steps for steps, _ in phases)
    samples = cfg["samples"]
    draws = torch.empty(chains, samples, DIM, dtype=torch.float64)
    subsampled = batch_size < problem.num_data
    probe = ForeignLoad()
    start = time.perf_counter()
    t = 0
    for steps, hyper in phases:
        for _ in range(steps):
            idx = torch.randint(problem.num_data, (chains, batch_size), generator=gen) if subsampled else None
            if method == "sgld":
                state, _ = module.update(state, idx, log_posterior, lr=hyper["step_size"], beta=0.0, inplace=True)
            else:
                state, _ = module.update(
                    state, idx, log_posterior, lr=hyper["step_size"], alpha=hyper["friction"], beta=0.0, inplace=True
                )
            if t >= total - samples:
                draws[:, t - (total - samples)] = state.params["w"]
            t += 1
    seconds = time.perf_counter() - start
    ratio, mcse, mean_error, ess = summarise(draws, problem)
    last = phases[-1][1]
    name = "posteriors SGLD" if method == "sgld" else "posteriors SGHMC"
    notes = [] if bool(torch.isfinite(draws).all()) else ["non-finite draws"]
    return Row(
        batch_size,
        name,
        label,
        last["step_size"],
        last.get("friction"),
        ratio,
        mcse,
        mean_error,
        ess,
        None,
        None,
        seconds,
        probe.cores(),
        chains,
        notes,
    )


def part_regression(cfg: dict, report: list[str]) -> list[Row]:
    problem = Regression()
    rows: list[Row] = []
    total = cfg["warmup"] + cfg["samples"]
    for batch_size in cfg["batch_sizes"]:
        chains = cfg["chains_full"] if batch_size >= NUM_DATA else cfg["chains"]
        subsampled = batch_size < NUM_DATA
        log(f"B = {batch_size}: {chains} chains, {cfg['warmup']} warm-up + {cfg['samples']} kept steps")
        chosen = {}

        def add(row: Row) -> None:
            rows.append(row)
            load = "n/a" if row.foreign is None else f"{row.foreign:.2f}"
            log(
                f"  {row.sampler:<17} {row.noise:<28} eps {row.step_size:.3g}  sd/exact "
                + " ".join(f"{r:.3f}±{e:.3f}" for r, e in zip(row.ratio, row.mcse))
                + f"  mean err {row.mean_error:.3f}  ESS/1000 {row.ess_per_1000:.1f}  {row.seconds:.1f} s"
                f" (others {load} cores) {'; '.join(row.notes)}"
            )

        label = "correct (defaults)" if subsampled else "defaults (exact gradient)"
        for cls in (SGLD, SGHMC, PSGLD, SGNHT, BAOAB):
            row, settings = run_ours(cls, problem, batch_size, label, cfg, chains)
            chosen[cls.__name__] = settings
            add(row)
        if subsampled:  # at B = N "estimate" is the defaults run again: no noise to estimate
            for cls in (SGLD, SGHMC):
                add(
                    run_ours(cls, problem, batch_size, "estimate (warm-up ε)", cfg, chains, gradient_noise="estimate")[
                        0
                    ]
                )
        add(
            run_ours(SGLD, problem, batch_size, "ignore (hand ε)", cfg, chains, gradient_noise="ignore", **HAND_SGLD)[0]
        )
        add(
            run_ours(
                SGHMC, problem, batch_size, "ignore (hand ε, α)", cfg, chains, gradient_noise="ignore", **HAND_SGHMC
            )[0]
        )
        burn = cfg["warmup"] // 2
        sgld_warm = {"step_size": chosen["SGLD"]["step_size"]}
        sghmc_warm = chosen["SGHMC"]
        add(
            run_posteriors(
                "sgld",
                problem,
                batch_size,
                "ignore (our warm-up's ε)",
                cfg,
                chains,
                [(burn, HAND_SGLD), (total - burn, sgld_warm)],
            )
        )
        add(run_posteriors("sgld", problem, batch_size, "ignore (hand ε)", cfg, chains, [(total, HAND_SGLD)]))
        add(
            run_posteriors(
                "sghmc",
                problem,
                batch_size,
                "ignore (our warm-up's ε, α)",
                cfg,
                chains,
                [(burn, HAND_SGHMC), (total - burn, sghmc_warm)],
            )
        )
        add(run_posteriors("sghmc", problem, batch_size, "ignore (hand ε, α)", cfg, chains, [(total, HAND_SGHMC)]))
    report += regression_tables(rows, cfg, problem)
    return rows


def discretisation_ratio(ordering: str, step_size: float, friction: float, curvature: float) -> float:
    """Stationary sd / exact sd of SGHMC with exact gradients on N(0, 1/curvature): the discrete Lyapunov equation.

    ``"ours"`` kicks the momentum first and moves with the new one (symplectic Euler); ``"posteriors"`` moves
    with the old momentum, then kicks with the gradient at the old point (posteriors 0.1.3's ``sghmc.update``).
    """
    eps, alpha, lam = step_size, friction, curvature
    if ordering == "posteriors":
        a = torch.tensor([[1.0, eps], [-eps * lam, 1.0 - eps * alpha]], dtype=torch.float64)
        b = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    else:
        a = torch.tensor(
            [[1.0 - eps**2 * lam, eps * (1.0 - eps * alpha)], [-eps * lam, 1.0 - eps * alpha]], dtype=torch.float64
        )
        b = torch.tensor([[eps], [1.0]], dtype=torch.float64)
    q = 2.0 * alpha * eps * (b @ b.T)
    # Σ = A Σ Aᵀ + Q  ⇔  (I − A ⊗ A) vec Σ = vec Q
    sigma = torch.linalg.solve(torch.eye(4, dtype=torch.float64) - torch.kron(a, a), q.reshape(-1)).reshape(2, 2)
    return math.sqrt(float(sigma[0, 0]) * lam)


def discretisation_table(rows: list[Row], problem: Regression) -> list[str]:
    """The discretisation alone (exact gradients) at every fixed SGHMC setting of the run, both orderings."""
    eigenvalues = torch.linalg.eigvalsh(problem.x.T @ problem.x + torch.eye(DIM, dtype=torch.float64)).tolist()
    settings = sorted({(r.step_size, r.friction) for r in rows if r.sampler == "posteriors SGHMC"})
    lines = [
        "### SGHMC's discretisation alone: exact gradients, sd / exact sd in the posterior's eigen-directions",
        "",
        "From the discrete Lyapunov equation (no Monte-Carlo error, no gradient noise), at every (ε, α) posteriors' "
        "SGHMC ran with above. posteriors 0.1.3 moves θ with the momentum before the kick (θ' = θ + εm, then "
        "m' = m + εĝ(θ) − εαm + noise); ours kicks first and moves with the new momentum.",
        "",
        "| ε | α | momentum decay 1 − εα | ε √λ_max | ours | posteriors |",
        "|---|---|---|---|---|---|",
    ]
    for eps, alpha in settings:
        ours = "/".join(f"{discretisation_ratio('ours', eps, alpha, lam):.3f}" for lam in eigenvalues)
        theirs = "/".join(f"{discretisation_ratio('posteriors', eps, alpha, lam):.3f}" for lam in eigenvalues)
        lines.append(
            f"| {eps:.3g} | {alpha:.3g} | {1 - eps * alpha:.2f} | {eps * math.sqrt(max(eigenvalues)):.3f} | "
            f"{ours} | {theirs} |"
        )
    return [*lines, ""]


def _ratio_cell(row: Row) -> str:
    worst = max(range(len(row.ratio)), key=lambda i: abs(row.ratio[i] - 1))
    text = "/".join(f"{r:.2f}" for r in row.ratio) + f" ±{row.mcse[worst]:.2f}"
    far = any(abs(r - 1) > 0.1 for r in row.ratio)
    return f"**{text}**" if far else text


def regression_tables(rows: list[Row], cfg: dict, problem: Regression) -> list[str]:
    sizes = cfg["batch_sizes"]
    lines = [
        "## 1. Posterior sd against minibatch size: conjugate linear regression",
        "",
        f"N = {NUM_DATA:,}, d = {DIM}, float64; exact posterior sd {problem.sd[0]:.4f} / {problem.sd[1]:.4f}, "
        f"largest curvature λ = {problem.curvature:.0f}. {cfg['chains']} chains ({cfg['chains_full']} at B = N) × "
        f"({cfg['warmup']} warm-up + {cfg['samples']} kept steps) per sampler, seed {cfg['seed']}, all from "
        "U(-2, 2). Hand settings: SGLD ε = {0}; SGHMC ε = {1}, α = {2}.".format(
            HAND_SGLD["step_size"], HAND_SGHMC["step_size"], HAND_SGHMC["friction"]
        ),
        "",
        "### Summary: sd of the draws / exact sd (w₁/w₂, ± the larger MCSE; bold: off by more than 10%)",
        "",
        "| sampler | gradient noise | " + " | ".join(f"B = {b}" for b in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    keys = []
    for row in rows:
        key = (row.sampler, row.noise.replace("defaults (exact gradient)", "correct (defaults)"))
        if key not in keys:
            keys.append(key)
    for sampler, noise in keys:
        cells = []
        for b in sizes:
            match = [
                r
                for r in rows
                if r.batch_size == b
                and r.sampler == sampler
                and r.noise.replace("defaults (exact gradient)", "correct (defaults)") == noise
            ]
            cells.append(_ratio_cell(match[0]) if match else "(= defaults)" if b >= NUM_DATA else "–")
        lines.append(f"| {sampler} | {noise} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Every run",
        "",
        "Mean error: largest |mean of the draws − exact mean| over coordinates, in exact posterior sds. ESS/1,000: "
        "effective draws per chain per 1,000 kept steps (smaller coordinate; across chains). Noise ratio: median "
        "over kept steps of the largest ε²V̂ⱼ / wanted noise variance (what the correction subtracts; the "
        "uncorrected variance is too large by about 1 + that). Uncorrected: share of coordinates × steps where the "
        "gradient noise alone exceeded the wanted noise. Others: CPU cores other processes used during the run.",
        "",
        "| B | sampler | gradient noise | ε | α | sd/exact w₁ | sd/exact w₂ | mean error (sds) | ESS/1,000 steps "
        "| noise ratio | uncorrected | run (s) | others (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        alpha = "–" if r.friction is None else f"{r.friction:.3g}"
        noise = "–" if r.noise_ratio is None or math.isnan(r.noise_ratio) else f"{r.noise_ratio:.2f}"
        unc = "–" if r.uncorrected is None or math.isnan(r.uncorrected) else f"{r.uncorrected:.1%}"
        load = "n/a" if r.foreign is None else f"{r.foreign:.2f}"
        note = f" ({'; '.join(r.notes)})" if r.notes else ""
        lines.append(
            f"| {r.batch_size} | {r.sampler}{note} | {r.noise} | {r.step_size:.3g} | {alpha} | "
            f"{r.ratio[0]:.3f} ± {r.mcse[0]:.3f} | {r.ratio[1]:.3f} ± {r.mcse[1]:.3f} | {r.mean_error:.3f} | "
            f"{r.ess_per_1000:.1f} | {noise} | {unc} | {r.seconds:.1f} | {load} |"
        )
    return [*lines, "", *discretisation_table(rows, problem)]


# ====================================================================================== part 2: the correction's cost
class MLP(PyroModule):
    """A 2-layer Bayesian MLP, Gaussian likelihood, subsampled plate."""

    def __init__(self, dims: tuple[int, ...], batch_size: int, noise: float = 0.5):
        super().__init__()
        self.batch_size, self.noise = batch_size, noise
        self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](a, b) for a, b in zip(dims[:-1], dims[1:])])
        for layer, fan_in in zip(self.layers, dims[:-1]):
            layer.weight = PyroSample(dist.Normal(0.0, fan_in**-0.5).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand(layer.bias.shape).to_event(1))

    def forward(self, x: Tensor, y: Tensor) -> None:
        for layer in self.layers:  # draw the weights outside the data plate
            layer.weight, layer.bias  # noqa: B018
        with pyro.plate("data", x.shape[0], subsample_size=self.batch_size) as idx:
            h = x[idx]
            for i, layer in enumerate(self.layers):
                h = layer(h)
                if i < len(self.layers) - 1:
                    h = torch.tanh(h)
            pyro.sample("obs", dist.Normal(h.squeeze(-1), self.noise), obs=y[idx])


def mlp_problem(num_data: int, dims: tuple[int, ...], batch_size: int) -> tuple[Callable, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_data, dims[0], generator=gen)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.5 * torch.randn(num_data, generator=gen)
    return MLP(dims, batch_size), x, y


def time_run(model: Callable, data: tuple, noise: str, step_size: float, chains: int, steps: int, seed: int) -> float:
    kernel = SGLD(model, step_size=step_size, gradient_noise=noise)
    mcmc = StochasticMCMC(
        kernel,
        num_samples=1,
        num_warmup=steps - 1,
        num_chains=chains,
        seed=seed,
        progress_bar=False,
        minibatches="independent",
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fixed step size may leave some coordinates uncorrected: not timed here
        mcmc.run(*data)
    return time.perf_counter() - start


def part_cost(cfg: dict, report: list[str]) -> None:
    regression = Regression()
    mlp, x, y = mlp_problem(cfg["mlp_data"], (10, 50, 1), 100)
    problems = {
        f"regression N = {NUM_DATA:,}, d = {DIM}, B = 100 (float64)": (
            regression.model(100),
            (regression.x, regression.y),
            1e-5,
        ),
        f"MLP 10-50-1 tanh (601 weights), N = {cfg['mlp_data']:,}, B = 100 (float32)": (mlp, (x, y), 1e-5),
    }
    short, long = cfg["cost_steps"]
    lines = [
        '## 2. Cost of the correction per step: `gradient_noise="correct"` / `"ignore"`',
        "",
        f"SGLD at a fixed step size, minibatches with replacement, both modes interleaved; time per step = "
        f"(T({long} steps) − T({short} steps)) / {long - short}; {cfg['reps']} repetitions, the ratio is the "
        'median of per-repetition ratios. "correct" adds one `torch.func.vmap` over the B single-example '
        "batches (per-example gradients) to every step; warm-up's Hessian-vector products are not in these numbers.",
        "",
        "| problem | chains | ignore (ms/step) | correct (ms/step) | **correct / ignore** | clean repetitions |",
        "|---|---|---|---|---|---|",
    ]
    for label, (model, data, step_size) in problems.items():
        for chains in cfg["cost_chains"]:
            times: dict[str, list[float]] = {"ignore": [], "correct": []}
            foreign: list[float | None] = []
            for rep in range(cfg["reps"]):
                probe = ForeignLoad()
                order = ("ignore", "correct") if rep % 2 == 0 else ("correct", "ignore")
                for noise in order:
                    t_short = time_run(model, data, noise, step_size, chains, short, rep)
                    t_long = time_run(model, data, noise, step_size, chains, long, rep)
                    times[noise].append((t_long - t_short) / (long - short))
                foreign.append(probe.cores())
                log(
                    f"  {label[:24]} chains {chains:>3} rep {rep}: ignore {times['ignore'][-1] * 1e3:.2f} ms, "
                    f"correct {times['correct'][-1] * 1e3:.2f} ms (others {foreign[-1] or 0:.2f} cores)"
                )
            clean = [i for i, f in enumerate(foreign) if is_clean(f)]
            use = clean_indices(foreign)
            ratio = statistics.median(times["correct"][i] / times["ignore"][i] for i in use)
            ignore = statistics.median(times["ignore"][i] for i in use)
            correct = statistics.median(times["correct"][i] for i in use)
            lines.append(
                f"| {label} | {chains} | {ignore * 1e3:.2f} | {correct * 1e3:.2f} | **{ratio:.2f}×** | "
                f"{len(clean)}/{cfg['reps']} |"
            )
    report += [*lines, ""]


# ====================================================================================== report
CONFIGS = {
    "full": {
        "batch_sizes": [10, 30, 100, 1000],
        "chains": 256,
        "chains_full": 128,
        "warmup": 300,
        "samples": 600,
        "seed": 0,
        "reps": 3,
        "cost_steps": (10, 110),
        "cost_chains": [64, 1],
        "mlp_data": 4000,
    },
    "quick": {
        "batch_sizes": [10, 1000],
        "chains": 32,
        "chains_full": 16,
        "warmup": 100,
        "samples": 100,
        "seed": 0,
        "reps": 2,
        "cost_steps": (5, 25),
        "cost_chains": [16, 1],
        "mlp_data": 4000,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized run (about 2 minutes)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--parts", default="1,2", help="which parts to run, e.g. '1'")
    parser.add_argument("--out", type=Path, default=None, help="markdown output (default benchmarks/results/...)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # tensordict's notices when posteriors is imported
    import posteriors  # (import cost outside the runs)

    cfg = CONFIGS["quick" if args.quick else "full"]
    out = args.out or RESULTS / ("calibration_quick.md" if args.quick else "calibration.md")
    parts = {int(p) for p in args.parts.split(",")}
    command = " ".join(["python benchmarks/bench_calibration.py", *sys.argv[1:]])
    report = [
        f"# Calibrated SG-MCMC, part{'s' if len(parts) > 1 else ''} {args.parts} (1: posterior sd against "
        f"minibatch size, 2: the correction's cost per step), ours and posteriors, "
        f"{'quick' if args.quick else 'full'} run ({_code_version()})",
        "",
        f"Command: `{command}`",
        "",
        *machine(args.threads, f"posteriors {getattr(posteriors, '__version__', '0.1.3')}"),
        "",
    ]
    start = time.perf_counter()
    probe = ForeignLoad()
    if 1 in parts:
        part_regression(cfg, report)
    if 2 in parts:
        part_cost(cfg, report)
    foreign = probe.cores()
    report.append(
        f"Total wall time {time.perf_counter() - start:.0f} s; other processes used "
        f"{'n/a' if foreign is None else f'{foreign:.2f}'} cores on average meanwhile; load average at the end "
        f"{load_average()}."
    )
    write_report("\n".join(report) + "\n", out)


if __name__ == "__main__":
    main()
