"""Time to accuracy against full-batch NUTS at large N: SG-MCMC with and without control variates.

The ``peers`` suite (``python -m benchmarks run peers``) is this benchmark in the harness; this script stays as a study
for what the suite does not run: N = 10^7, the control variate at the mode, ``bench_peers.py``'s problems and GPU
run, and the studies that import ``make``.

    python benchmarks/studies/bench_accuracy.py            # full run (about 40 minutes on 2 quiet CPU cores, 12 GB)
    python benchmarks/studies/bench_accuracy.py --quick    # N = 10^4 and 10^5 only (a few minutes)

Prints a markdown report and writes it to ``benchmarks/results/accuracy.md`` (``--out`` to change).

**Accurate** means every posterior mean within 0.1 reference sd and every posterior sd within 10% of the reference,
in the unconstrained space the samplers work in (``log σ`` for the noise scale). **Reference**: the Laplace
approximation at the MAP with the exact Hessian (Newton's method in float64, in chunks): at N ≥ 10^5 it is within a
few hundredths of an sd of a long NUTS run (the report checks it against NUTS at the smallest N).

**Problems** (float32 data, as users have it): logistic regression with d = 10 and d = 100, ``w ~ N(0, I)``; a
linear regression with d = 10 and a latent noise scale ``σ ~ HalfNormal(1)``. (``make("hierarchical", ...)`` adds
50 group intercepts ``b_j ~ N(0, τ)``, ``τ ~ HalfNormal(1)``, to that regression, for ``bench_peers.py``; its
reference is ``peers_models.exact_reference``.)

**NUTS**: ``pyro.infer.NUTS`` (defaults: diagonal mass adaptation, no JIT), full batch, one chain, 500 warm-up
iterations then 500 draws; its time to accuracy is read from its draws every 25 iterations. Where a full NUTS run
would take too long (``--nuts-max-n``), its time for warm-up + 500 draws is extrapolated as (the number of
gradient evaluations it made on the same problem at the largest N it ran) × (the measured time of one full-data
gradient at this N): NUTS's step count per draw does not grow with N on these posteriors (its adapted step
shrinks like the posterior sd); the report checks the extrapolation against a measured run where both exist.

**Ours**: ``StochasticMCMC(SGHMC(model, ...), num_chains=4)`` with every default (warm-up chooses the step size and
friction and corrects the gradient noise), minibatch ``B``; ``control_variate="map"`` adds the mode search and one
full-data pass. Runs with 2× more draws each time (same seed) until one is accurate; its time is that run's wall
clock from the ``StochasticMCMC`` constructor on (tracing the model, mode search, full pass, warm-up, sampling).
A run with the control variate may take up to ``--budget`` seconds (default 600), one without it a fifth of that
(it cannot win once it has taken NUTS's time): one that is not accurate within it is reported with its errors.
Warm-up's metric (``StochasticMCMC(metric="auto")``) is on in both.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS
from pyro.infer.mcmc.util import initialize_model
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import ForeignLoad, _code_version, load_average, log, machine, write_report  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402
from pyro_scalable.infer.health import HealthWarning  # noqa: E402

TOLERANCE_MEAN, TOLERANCE_SD = 0.1, 0.10
NUTS_WARMUP, NUTS_DRAWS = 500, 500
CHUNK = 2**16


# ====================================================================================== problems
@dataclass
class Problem:
    name: str
    x: Tensor
    y: Tensor
    latent: bool  # the regression's noise scale
    batch_size: int
    calls: list = field(default_factory=list)  # model evaluations (NUTS: one per gradient)
    groups: Tensor | None = None  # the hierarchical model's group of each point (int64), else None
    num_groups: int = 0

    @property
    def n(self) -> int:
        return self.x.shape[0]

    def model(self, subsample: bool) -> Callable:
        size = self.batch_size if subsample else None

        def model(x: Tensor, y: Tensor) -> None:
            self.calls.append(None)
            w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
            if self.groups is not None:  # y = x w + b[group] + σ ε, b_j ~ N(0, τ): centred, as users write it
                scale = pyro.sample("scale", dist.HalfNormal(x.new_ones(())))
                tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
                with pyro.plate("groups", self.num_groups):
                    b = pyro.sample("b", dist.Normal(x.new_zeros(()), tau))
                with pyro.plate("data", x.shape[0], subsample_size=size) as idx:
                    pyro.sample("obs", dist.Normal(x[idx] @ w + b[self.groups[idx]], scale), obs=y[idx])
                return
            scale = pyro.sample("scale", dist.HalfNormal(x.new_ones(()))) if self.latent else None
            with pyro.plate("data", x.shape[0], subsample_size=size) as idx:
                logits = x[idx] @ w
                if self.latent:
                    pyro.sample("obs", dist.Normal(logits, scale), obs=y[idx])
                else:
                    pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y[idx])

        return model


def make(kind: str, n: int, d: int, batch_size: int, seed: int = 0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, generator=gen) * (1.5 / math.sqrt(d))
    if kind == "logistic":
        y = torch.bernoulli(torch.sigmoid(x @ w), generator=gen)
        return Problem(f"logistic regression, d = {d}", x, y, False, batch_size)
    if kind == "hierarchical":  # J = 50 group intercepts, groups of equal expected size
        groups = torch.randint(0, 50, (n,), generator=gen)
        b = 0.8 * torch.randn(50, generator=gen)
        y = x @ w + b[groups] + 0.7 * torch.randn(n, generator=gen)
        name = f"hierarchical regression, d = {d}, 50 group intercepts"
        return Problem(name, x, y, True, batch_size, groups=groups, num_groups=50)
    y = x @ w + 0.7 * torch.randn(n, generator=gen)
    return Problem(f"regression with a latent noise scale, d = {d}", x, y, True, batch_size)


def unconstrained(problem: Problem, samples: dict[str, Tensor]) -> Tensor:
    """Draws as (S, d[+1]) in the samplers' space: w, then log σ."""
    parts = [samples["w"].reshape(-1, problem.x.shape[1])]
    if problem.groups is not None:  # w, b, log σ, log τ
        parts += [samples["b"].reshape(-1, problem.num_groups), samples["scale"].reshape(-1, 1).log()]
        return torch.cat([*parts, samples["tau"].reshape(-1, 1).log()], 1).double()
    if problem.latent:
        parts.append(samples["scale"].reshape(-1, 1).log())
    return torch.cat(parts, 1).double()


# ====================================================================================== reference
def _sums(problem: Problem, theta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Xᵀ(residual or y − p), XᵀWX and Σ (residual² or log-likelihood) over the data, in float64 chunks."""
    d = problem.x.shape[1]
    w = theta[:d]
    first = torch.zeros(d, dtype=torch.float64)
    second = torch.zeros(d, d, dtype=torch.float64)
    scalar = torch.zeros((), dtype=torch.float64)
    for start in range(0, problem.n, CHUNK):
        xb = problem.x[start : start + CHUNK].double()
        yb = problem.y[start : start + CHUNK].double()
        f = xb @ w
        if problem.latent:
            r = yb - f
            first += xb.T @ r
            second += xb.T @ xb
            scalar += r.square().sum()
        else:
            p = torch.sigmoid(f)
            first += xb.T @ (yb - p)
            second += (xb * (p * (1 - p))[:, None]).T @ xb
    return first, second, scalar


def newton_system(problem: Problem, theta: Tensor) -> tuple[Tensor, Tensor]:
    """Gradient and Hessian of the negative log joint at θ = (w[, s = log σ]) (closed forms)."""
    d = problem.x.shape[1]
    w = theta[:d]
    first, second, squares = _sums(problem, theta)
    eye = torch.eye(d, dtype=torch.float64)
    if not problem.latent:
        return w - first, eye + second
    # ½‖w‖² + ½e^{2s} − s (HalfNormal(1) on σ = e^s with its log-Jacobian) + Σ[½ r² e^{−2s} + s]
    s = theta[d]
    inv = torch.exp(-2 * s)
    grad = torch.cat([w - inv * first, (torch.exp(2 * s) - 1 + problem.n - inv * squares).reshape(1)])
    hessian = torch.zeros(d + 1, d + 1, dtype=torch.float64)
    hessian[:d, :d] = eye + inv * second
    hessian[:d, d] = hessian[d, :d] = 2 * inv * first
    hessian[d, d] = 2 * torch.exp(2 * s) + 2 * inv * squares
    return grad, hessian


def laplace(problem: Problem) -> tuple[Tensor, Tensor]:
    """MAP by Newton's method (float64, closed-form Hessians) and the sds of the inverse Hessian there."""
    if problem.groups is not None:
        raise ValueError("laplace: the hierarchical problem's reference is peers_models.exact_reference")
    d = problem.x.shape[1]
    theta = torch.zeros(d + problem.latent, dtype=torch.float64)
    if problem.latent:  # least squares and the residual scale: Newton's basin
        _, second, _ = _sums(problem, theta)
        first = sum(
            (problem.x[i : i + CHUNK].double().T @ problem.y[i : i + CHUNK].double())
            for i in range(0, problem.n, CHUNK)
        )
        theta[:d] = torch.linalg.solve(second, first)
        theta[d] = 0.5 * torch.log(_sums(problem, theta)[2] / problem.n)
    for _ in range(100):
        grad, hessian = newton_system(problem, theta)
        step = torch.linalg.solve(hessian, grad)
        theta = theta - step
        if float(step.abs().max()) < 1e-12:
            break
    _, hessian = newton_system(problem, theta)
    return theta, torch.linalg.inv(hessian).diagonal().sqrt()


def errors(draws: Tensor, mean: Tensor, sd: Tensor) -> tuple[float, float]:
    """Worst coordinate: |mean error| in reference sds, and |sd / reference sd - 1|."""
    return float(((draws.mean(0) - mean).abs() / sd).max()), float((draws.std(0) / sd - 1).abs().max())


def accurate(err: tuple[float, float]) -> bool:
    return err[0] <= TOLERANCE_MEAN and err[1] <= TOLERANCE_SD


# ====================================================================================== NUTS
@dataclass
class NutsResult:
    total: float | None  # warm-up + 500 draws, seconds (measured)
    to_accuracy: float | None
    draws_needed: int | None
    gradients: int  # model evaluations in the whole run
    grad_time: float  # seconds per full-data gradient at this N
    extrapolated: float | None = None
    foreign: float | None = None


def gradient_time(problem: Problem) -> float:
    """Median seconds of one full-data potential-energy gradient, as NUTS computes it."""
    model = problem.model(subsample=False)
    _, potential_fn, _, _ = initialize_model(model, (problem.x, problem.y))
    params = {"w": torch.zeros(problem.x.shape[1], requires_grad=True)}
    if problem.latent:
        params["scale"] = torch.zeros((), requires_grad=True)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        torch.autograd.grad(potential_fn(params), list(params.values()))
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def run_nuts(problem: Problem, mean: Tensor, sd: Tensor, seed: int = 0) -> NutsResult:
    stamps: list[float] = []
    pyro.set_rng_seed(seed)
    model = problem.model(subsample=False)
    mcmc = MCMC(
        NUTS(model),
        num_samples=NUTS_DRAWS,
        warmup_steps=NUTS_WARMUP,
        disable_progbar=True,
        hook_fn=lambda kernel, samples, stage, i: stamps.append(time.perf_counter()),
    )
    problem.calls.clear()
    probe = ForeignLoad()
    start = time.perf_counter()
    mcmc.run(problem.x, problem.y)
    total = time.perf_counter() - start
    gradients = len(problem.calls)
    draws = unconstrained(problem, mcmc.get_samples())
    found, needed = None, None
    for k in range(25, NUTS_DRAWS + 1, 25):
        if accurate(errors(draws[:k], mean, sd)):
            found, needed = stamps[NUTS_WARMUP + k - 1] - start, k
            break
    return NutsResult(total, found, needed, gradients, gradient_time(problem), foreign=probe.cores())


# ====================================================================================== ours
@dataclass
class OursRun:
    draws: int
    seconds: float
    err: tuple[float, float]
    step_size: float
    mode_seconds: float | None
    full_passes: int | None


def run_ours(problem: Problem, control_variate: str | None, num_samples: int, seed: int = 0) -> OursRun:
    start = time.perf_counter()
    mcmc = StochasticMCMC(
        SGHMC(problem.model(subsample=True), control_variate=control_variate),
        num_samples=num_samples,
        num_warmup=500,
        num_chains=4,
        seed=seed,
        progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)  # judged here against the reference instead
        warnings.filterwarnings("ignore", message="in .* of the coordinates of the kept steps")
        mcmc.run(problem.x, problem.y)
    seconds = time.perf_counter() - start
    draws = unconstrained(problem, mcmc.get_samples()).cpu()  # the reference is on the CPU (data maybe on a GPU)
    search = mcmc.mode_search
    return OursRun(
        num_samples,
        seconds,
        (math.inf, math.inf) if not bool(torch.isfinite(draws).all()) else errors(draws, *problem.reference),
        float(mcmc.sample_stats["step_size"].double().mean()),
        None if search is None else search.seconds,
        None if search is None else search.full_passes,
    )


def ours_to_accuracy(problem: Problem, control_variate: str | None, budget: float) -> list[OursRun]:
    runs: list[OursRun] = []
    draws = 250
    while True:
        run = run_ours(problem, control_variate, draws)
        runs.append(run)
        log(f"    ours cv={control_variate}: {draws} draws/chain, {run.seconds:.1f} s, errors {run.err}")
        if accurate(run.err) or run.seconds * 2 > budget:
            return runs
        draws *= 2


# ====================================================================================== report
def fmt(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.1f}"


def describe(runs: list[OursRun]) -> tuple[float | None, str]:
    last = runs[-1]
    if accurate(last.err):
        extra = (
            "" if last.mode_seconds is None else f"; mode search {last.mode_seconds:.1f} s, {last.full_passes} passes"
        )
        return last.seconds, f"{fmt(last.seconds)} ({last.draws} draws × 4 chains{extra})"
    return None, (
        f"not reached: a {last.seconds:.0f} s run ({last.draws} draws × 4 chains) is off by {last.err[0]:.2f} sd / "
        f"{last.err[1]:.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=600.0, help="seconds one of our runs may take")
    parser.add_argument(
        "--nuts-max-n",
        type=float,
        default=1e5,
        help="largest N at which NUTS runs in full "
        "(and logistic regression with d = 10 at N = 10^6, which checks the extrapolation)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "accuracy.md")
    parser.add_argument(
        "--problems", default="logistic10,logistic100,regression10", help="a subset, e.g. 'logistic100,regression10'"
    )
    parser.add_argument("--sizes", default=None, help="N values, e.g. '1e5,1e6' (default 1e5,1e6,1e7; quick 1e4,1e5)")
    parser.add_argument(
        "--nuts-gradients",
        default="",
        help="NUTS's gradient evaluations measured at a smaller N in an earlier run, for an extrapolation without a "
        "smaller N in this one, e.g. 'logistic100=10774,regression10=6459' (the earlier report's notes give them)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [10**4, 10**5] if args.quick else [10**5, 10**6, 10**7]
    if args.sizes:
        sizes = [int(float(n)) for n in args.sizes.split(",")]
    known = {"logistic10": ("logistic", 10, 1000), "logistic100": ("logistic", 100, 1000)}
    known["regression10"] = ("regression", 10, 1000)
    problems = [known[name] for name in args.problems.split(",")]
    report = [
        f"# Time to accuracy against full-batch Pyro NUTS: {', '.join(args.problems.split(','))} at N = "
        f"{', '.join(f'{n:.0e}' for n in sizes)} ({_code_version()})",
        "",
        f"Command: `python {' '.join(['benchmarks/studies/bench_accuracy.py', *sys.argv[1:]])}`",
        "",
        *machine(args.threads),
        "",
        "| problem | N | NUTS warm-up + 500 draws (s) | NUTS to accuracy (s) | SGHMC, no control variate (s) | "
        "SGHMC + control variate (the default here) (s) | **control variate / NUTS-500** |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    notes: list[str] = []
    nuts_gradients: dict[str, int] = {}
    for item in filter(None, args.nuts_gradients.split(",")):
        name, count = item.split("=")
        nuts_gradients[make(*known[name][:1], 100, known[name][1], known[name][2]).name] = int(count)
    for kind, d, batch in problems:
        for n in sizes:
            problem = make(kind, n, d, batch)
            log(f"{problem.name}, N = {n:.0e}: reference")
            problem.reference = laplace(problem)
            if n <= args.nuts_max_n or (kind, d, n) == ("logistic", 10, 10**6) and not args.quick:
                log("  NUTS")
                nuts = run_nuts(problem, *problem.reference)
                if problem.name in nuts_gradients:  # the extrapolation from the smaller N, against the measurement
                    predicted = nuts_gradients[problem.name] * nuts.grad_time
                    notes.append(
                        f"- {problem.name}, N = {n:.0e}: the extrapolation from the smaller N predicts "
                        f"{predicted:.0f} s for NUTS; measured {nuts.total:.0f} s."
                    )
                nuts_gradients[problem.name] = nuts.gradients
                nuts_total, nuts_note = nuts.total, f"{fmt(nuts.total)}"
                notes.append(
                    f"- {problem.name}, N = {n:.0e}: NUTS made {nuts.gradients} gradient evaluations "
                    f"({nuts.grad_time * 1e3:.1f} ms each, {nuts.gradients * nuts.grad_time:.0f} s of its "
                    f"{nuts.total:.0f} s); other processes used {nuts.foreign or 0:.2f} cores meanwhile."
                )
                nuts_accuracy = fmt(nuts.to_accuracy) + (f" ({nuts.draws_needed} draws)" if nuts.draws_needed else "")
            else:
                grad = gradient_time(problem)
                nuts_total = nuts_gradients[problem.name] * grad
                nuts_note = f"≈ {nuts_total:.0f} (extrapolated)"
                nuts_accuracy = "–"
                notes.append(
                    f"- {problem.name}, N = {n:.0e}: one full-data gradient {grad * 1e3:.0f} ms × "
                    f"{nuts_gradients[problem.name]} gradient evaluations = NUTS ≈ {nuts_total:.0f} s."
                )
            cells = []
            times = {}
            for cv in (None, "map"):
                # without the control variate: until it is clear it loses (it cannot beat NUTS after its time)
                budget = min(args.budget, 2 * nuts_total) if cv else min(args.budget / 5, nuts_total)
                runs = ours_to_accuracy(problem, cv, budget)
                times[cv], text = describe(runs)
                cells.append(text)
                notes.append(
                    f"  - ours, control_variate={cv!r}: "
                    + ", ".join(
                        f"{r.draws} draws {r.seconds:.1f} s (off {r.err[0]:.2f} sd / {r.err[1]:.0%})" for r in runs
                    )
                    + f"; warm-up's step size {runs[-1].step_size:.3g}"
                )
            ratio = "–" if times["map"] is None else f"**{times['map'] / nuts_total:.3f}**"
            report.append(
                f"| {problem.name} | {n:.0e} | {nuts_note} | {nuts_accuracy} | {cells[0]} | {cells[1]} | {ratio} |"
            )
            del problem
    report += ["", "Notes (load average at the end: " + load_average() + "):", "", *notes, ""]
    write_report("\n".join(report), args.out)


if __name__ == "__main__":
    main()
