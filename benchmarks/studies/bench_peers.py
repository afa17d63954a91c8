"""Time to accuracy against the fastest peers: NumPyro's jitted NUTS and BlackJAX's SGLD/SGHMC with control variates.

    python benchmarks/studies/bench_peers.py --threads 1        # every problem at N = 1e4 … 1e7 within --total-budget
    python benchmarks/studies/bench_peers.py --problems logistic10 --sizes 1e4 --out /tmp/peers.md   # one cell
    python benchmarks/studies/bench_peers.py --device cuda --sizes 1e6,1e7 --out /tmp/peers_gpu.md  # a GPU (JAX too)

Needs the benchmark-only peers (``pip install -e ".[peers]"``: jax[cpu], numpyro, blackjax); without them the run
stops with the import error. Writes a markdown report to ``benchmarks/results/peers.md`` after every problem and
size (a run that is stopped leaves the rows it has), smallest N first.

**Problems** (``bench_accuracy.make``, float32 data, ``w ~ N(0, I)``; every sampler is handed the same arrays):
``logistic10``/``logistic100``, logistic regression with d = 10 / 100; ``regression10``, linear regression with
d = 10 and a latent noise scale ``σ ~ HalfNormal(1)``; ``hierarchical``, that regression plus 50 group intercepts
``b_j ~ N(0, τ)``, ``τ ~ HalfNormal(1)``, centred (as users write it), about N/50 points per group.

**Accuracy**: every posterior mean within 0.1 reference sd and every posterior sd within 10% of the reference, in
the unconstrained space (``log σ``, ``log τ``). **Reference**, from none of the samplers: for logistic regression
the Laplace approximation at the MAP with the exact Hessian (Newton in float64, ``bench_accuracy.laplace``), at
N ≤ 10⁵ corrected by importance sampling from it (``peers_models.importance_reference``: at d = 100 the mode is
0.20 sd from the posterior mean at N = 10⁴ and 0.06 sd at 10⁵, at d = 10 0.06 sd at 10⁴; the report gives each
offset and the weights' ESS; at N ≥ 10⁶ the offset is about 0.02 sd or less); for the two linear models the
exact posterior moments by quadrature over the scales (``peers_models.exact_reference``: given σ and τ the
coefficients are Gaussian).

**Ours**: ``StochasticMCMC(SGHMC(model), num_warmup=500, num_chains=4)``, every default (``control_variate="auto"``,
warm-up's step size, friction and metric), B = 1,000; draws per chain doubled from 250 (same seed) until accurate
or a run takes half of ``--budget``; the time of the last run, from the constructor to the end of ``run``.

**NumPyro NUTS**: ``MCMC(NUTS(model), num_warmup=500, num_samples=500, jit_model_args=True)``, one chain;
*first run* after ``jax.clear_caches()`` (compilation included), *compiled run* the same ``MCMC`` object run again
with another key (NumPyro reuses its compiled sampler for arguments of the same shapes). Its time is for the whole
500 + 500 run; whether its 500 draws are accurate is reported with it (and how many of them sufficed). A run is
made only if its estimate fits ``--nuts-budget`` and what is left of ``--total-budget``; otherwise the report says
it did not fit, with the estimate: (the compiled run's time at the next smaller N) × (the ratio of one jitted
full-data gradient's time at the two N's) + (the compilation time there), which overestimates where the smaller
N's run was dominated by per-step overhead. Estimates are never reported as measurements.

**BlackJAX** (logistic regression only: its SG-MCMC has no warm-up, and the step-size rule below is written for a
log-concave model with a closed-form Hessian; the other models would each need their own rule, which BlackJAX does
not provide): ``blackjax.sgld``, ``blackjax.sghmc`` (10 integration steps per draw) with the gradient estimator
``blackjax.sgmcmc.gradients.control_variates`` centred at the mode from ``optax.lbfgs`` (jitted, full data), and a
step size from the Hessian there: ``0.2 / λ_max`` for SGLD; for SGHMC ``h = 0.1 / √λ_max`` and friction
``alpha = 0.1 / h`` (BlackJAX's default ``alpha=0.01`` diverges: its explicit Euler step gains energy h²λ per step);
4 chains vmapped in one jitted ``lax.scan``, started at the mode, minibatches of 1,000 drawn with replacement;
burn-in 500 SGLD steps or 100 SGHMC draws; draws doubled from 250 per chain until accurate. Its time covers the
mode, the Hessian, the control variate's full-data gradient and the sampling; *compiled run* the second call at
that draw count (the run's length is static, so each count compiles once), *first run* after
``jax.clear_caches()`` at the same draw count.

Threads: ``--threads`` sets torch's threads and XLA's (``XLA_FLAGS`` intra-op threads, Eigen's multi-threading off
at 1). Each measurement carries the 1-minute load average and the cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from bench_accuracy import accurate, errors, laplace, make, ours_to_accuracy  # benchmarks/studies/ is on sys.path
from harness import ForeignLoad, log, machine, write_report  # bench_accuracy put benchmarks/ on sys.path
from peers_models import (
    BATCH,
    CHAINS,
    blackjax_pipeline,
    exact_reference,
    gradient_seconds,
    import_peers,
    importance_reference,
    jax_data,
    numpyro_draws,
    numpyro_model,
)

NUTS_WARMUP, NUTS_DRAWS = 500, 500
IMPORTANCE_MAX_N = 10**5  # logistic regression: below it the Laplace reference is corrected by importance sampling
PROBLEMS = {
    "logistic10": ("logistic", 10),
    "logistic100": ("logistic", 100),
    "regression10": ("regression", 10),
    "hierarchical": ("hierarchical", 10),
}
SAMPLERS = {
    "ours": "ours, SGHMC(model) at the defaults",
    "nuts first": "NumPyro NUTS, first run (compile included)",
    "nuts compiled": "NumPyro NUTS, compiled run",
    "sgld first": "BlackJAX SGLD + CV, first run",
    "sgld compiled": "BlackJAX SGLD + CV, compiled",
    "sghmc first": "BlackJAX SGHMC + CV, first run",
    "sghmc compiled": "BlackJAX SGHMC + CV, compiled",
}


@dataclass
class Cell:
    seconds: float
    err: tuple[float, float]
    load: str  # 1-minute load average; cores other processes used
    note: str = ""

    def text(self) -> str:
        mark = "" if accurate(self.err) else " **not accurate**"
        return f"{self.seconds:.1f}{mark} ({self.err[0]:.2f} sd / {self.err[1]:.0%}; {self.note}load {self.load})"


def measured(fn):
    """``fn()``'s value, its wall time and the load around it."""
    probe = ForeignLoad()
    start = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - start
    return value, seconds, f"{os.getloadavg()[0]:.1f}, other {probe.cores() or 0:.2f} cores"


# ====================================================================================== NumPyro
@dataclass
class NutsHistory:  # what the next N's estimate is built from
    compiled: float  # seconds of the compiled run (the first run's if there was none)
    compile: float  # first run − compiled run
    gradient: float  # seconds of one jitted full-data gradient


def nuts_runs(problem, data, limit: float, history: NutsHistory | None, seed: int = 0):
    """NUTS's first and compiled runs, each a ``Cell`` or the reason it was not run; and this N's history."""
    jax = import_peers()[0]
    from numpyro.infer import MCMC, NUTS

    gradient = gradient_seconds(problem, data)
    if history is not None:
        compiled = history.compiled * gradient / history.gradient
        estimate = compiled + history.compile
        if estimate > limit:
            why = f"did not fit the budget ({limit:.0f} s): estimate ≈ {estimate:.0f} s"
            log(f"    NumPyro NUTS: {why}")
            return why, f"did not fit the budget: estimate ≈ {compiled:.0f} s", None
    kernel = NUTS(numpyro_model(problem))
    mcmc = MCMC(kernel, num_warmup=NUTS_WARMUP, num_samples=NUTS_DRAWS, progress_bar=False, jit_model_args=True)

    def run(key: int):
        mcmc.run(jax.random.PRNGKey(key), *data, extra_fields=("num_steps",))
        return numpyro_draws(problem, mcmc.get_samples()), float(mcmc.get_extra_fields()["num_steps"].mean())

    cells = []
    jax.clear_caches()
    for key in (seed, seed + 1):
        if cells and cells[0].seconds > limit:
            cells.append(f"not run: the first run took {cells[0].seconds:.0f} s > the budget {limit:.0f} s")
            break
        (draws, steps), seconds, load = measured(lambda key=key: run(key))
        needed = next((k for k in range(25, NUTS_DRAWS + 1, 25) if accurate(errors(draws[:k], *problem.reference))), 0)
        note = f"{steps:.0f} steps/draw; " + (f"{needed} of its draws sufficed; " if needed else "")
        cells.append(Cell(seconds, errors(draws, *problem.reference), load, note))
        log(f"    NumPyro NUTS key {key}: {cells[-1].text()}")
    compiled = cells[1].seconds if isinstance(cells[1], Cell) else cells[0].seconds
    return cells[0], cells[1], NutsHistory(compiled, max(cells[0].seconds - compiled, 0.0), gradient)


# ====================================================================================== BlackJAX
def blackjax_runs(problem, data, algorithm: str, budget: float) -> tuple[Cell, Cell]:
    jax = import_peers()[0]
    run = blackjax_pipeline(*data, algorithm)
    draws_per_chain = 250
    while True:  # each size compiles once (the run's length is static); its second call is the compiled run
        run(draws_per_chain, 99)
        draws, seconds, load = measured(lambda count=draws_per_chain: run(count, 0))
        compiled = Cell(seconds, errors(draws, *problem.reference), load, f"{draws_per_chain} draws × {CHAINS}; ")
        log(f"    BlackJAX {algorithm}, compiled: {compiled.text()}")
        if accurate(compiled.err) or seconds * 4 > budget:
            break
        draws_per_chain *= 2
    jax.clear_caches()
    fresh = blackjax_pipeline(*data, algorithm)
    draws, seconds, load = measured(lambda: fresh(draws_per_chain, 0))
    first = Cell(seconds, errors(draws, *problem.reference), load, f"{draws_per_chain} draws × {CHAINS}; ")
    log(f"    BlackJAX {algorithm}, first run: {first.text()}")
    return first, compiled


# ====================================================================================== ours
def ours(problem, budget: float, device: torch.device) -> Cell:
    if device.type != "cpu":  # the same arrays, moved before the clock starts (as a user's data would already be)
        moved = replace(
            problem,
            **{k: getattr(problem, k).to(device) for k in ("x", "y", "groups") if getattr(problem, k) is not None},
        )
        moved.reference, problem = problem.reference, moved
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    runs = ours_to_accuracy(problem, "auto", budget)  # each run timed on its own; the last is reported
    last = runs[-1]
    note = f"{last.draws} draws × 4; tried {', '.join(str(r.draws) for r in runs)}; "
    return Cell(last.seconds, last.err, f"{os.getloadavg()[0]:.1f}", note)


# ====================================================================================== report
def crossover(cells_by_n: dict[int, dict], which: str) -> str:
    """The smallest N where ours ÷ NUTS(which) < 1, with the ratios measured (both accurate or not, as marked)."""
    ratios, first = [], None
    for n, cells in cells_by_n.items():
        mine, theirs = cells.get("ours"), cells.get(f"nuts {which}")
        if isinstance(mine, Cell) and isinstance(theirs, Cell):
            ratio = mine.seconds / theirs.seconds
            flag = "" if accurate(mine.err) else " (ours not accurate)"
            ratios.append(f"{n:.0e}: {ratio:.2f}{flag}")
            if first is None and ratio < 1 and accurate(mine.err):
                first = n
        elif isinstance(mine, Cell):
            why = "NUTS not run" if theirs is None else "NUTS did not fit the budget"
            ratios.append(f"{n:.0e}: {why}, ours {mine.seconds:.0f} s")
    where = f"N = {first:.0e}" if first is not None else "none in the grid measured"
    return f"{where} (ours ÷ NUTS {which}: {'; '.join(ratios)})"


def render(args, sizes, results, notes, elapsed, header) -> str:
    report = [
        "# Time to accuracy: SGHMC(model) at the defaults against NumPyro NUTS and BlackJAX SGLD/SGHMC",
        "",
        f"Command: `python {' '.join(['benchmarks/studies/bench_peers.py', *sys.argv[1:]])}` "
        f"({elapsed / 60:.1f} minutes so "
        f"far; NUTS budget {args.nuts_budget:.0f} s a run, total budget {args.total_budget:.0f} minutes)",
        "",
        *header,
        "",
        "Seconds; in brackets the worst mean error in reference sds and the worst sd error (accurate: ≤ 0.1 sd and "
        "≤ 10%), then the 1-minute load average (2 cores) and the cores other processes used meanwhile. References "
        "from none of the samplers (module docstring). '–': not run (a size beyond what the run reached, or BlackJAX "
        "on a model it has no step-size rule for).",
    ]
    for name in args.problems.split(","):
        cells_by_n = results.get(name, {})
        if not cells_by_n:
            continue
        title = make(PROBLEMS[name][0], 10, PROBLEMS[name][1], BATCH).name
        report += ["", f"## {title} (`{name}`)", ""]
        report += ["| sampler | " + " | ".join(f"N = {n:.0e}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for key, label in SAMPLERS.items():
            if not any(key in cells for cells in cells_by_n.values()):
                continue
            row = [cells_by_n.get(n, {}).get(key, "–") for n in sizes]
            report.append(f"| {label} | " + " | ".join(c.text() if isinstance(c, Cell) else c for c in row) + " |")
        report += ["", f"- crossover, ours < NUTS first run: {crossover(cells_by_n, 'first')}"]
        report += [f"- crossover, ours < NUTS compiled run: {crossover(cells_by_n, 'compiled')}"]
        report += [f"- {note}" for note in notes.get(name, [])]
    return "\n".join(report + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", default=",".join(PROBLEMS), help=f"a subset of {','.join(PROBLEMS)}")
    parser.add_argument("--sizes", default="1e4,1e5,1e6,1e7", help="N values, e.g. '1e4,1e5,1e6'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds one run of an SG-MCMC sampler may take")
    parser.add_argument("--nuts-budget", type=float, default=600.0, help="seconds one NUTS run may take")
    parser.add_argument("--total-budget", type=float, default=90.0, help="minutes the whole run may take")
    parser.add_argument("--samplers", default="ours,nuts,blackjax", help="a subset of ours,nuts,blackjax")
    parser.add_argument("--device", default="cpu", help="where ours runs ('cuda'); the peers on JAX's default device")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "peers.md")
    args = parser.parse_args()
    flags = f"--xla_cpu_multi_thread_eigen={'false' if args.threads == 1 else 'true'}"
    os.environ["XLA_FLAGS"] = f"{flags} intra_op_parallelism_threads={args.threads}"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a GPU shared with torch: JAX allocates as it goes
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    jax, numpyro, blackjax, _ = import_peers()

    sizes = sorted(int(float(n)) for n in args.sizes.split(","))
    peers = f"jax {jax.__version__}, numpyro {numpyro.__version__}, blackjax {blackjax.__version__}"
    peers += f"; JAX on {jax.devices()[0].device_kind} ({jax.devices()[0].platform})"
    if device.type == "cuda":
        peers += f"; ours on {torch.cuda.get_device_name(device)}"
    results: dict[str, dict[int, dict]] = {}
    notes: dict[str, list[str]] = {}
    history: dict[str, NutsHistory | None] = {}
    started = time.perf_counter()
    header = machine(args.threads, peers)  # the code as imported at the start, not as it is at a later write

    def left() -> float:
        return args.total_budget * 60 - (time.perf_counter() - started)

    for n in sizes:  # smallest N first, every problem: results early
        for name in args.problems.split(","):
            kind, d = PROBLEMS[name]
            cells = results.setdefault(name, {}).setdefault(n, {})
            if left() < 60:
                cells["ours"] = "not run: the total budget was spent"
                continue
            problem = make(kind, n, d, BATCH)
            log(f"{name}, N = {n:.0e}: reference")
            if kind == "logistic":
                problem.reference = laplace(problem)
                if n <= IMPORTANCE_MAX_N:  # the mode is not yet the mean: correct the Laplace approximation
                    mean, sd, ess = importance_reference(problem, problem.reference[0], min(20000, int(1e9 / n)))
                    off = float(((problem.reference[0] - mean).abs() / sd).max())
                    notes.setdefault(name, []).append(
                        f"N = {n:.0e}: reference by importance sampling from the Laplace approximation "
                        f"(ESS {ess:.0f}); the Laplace mean (the mode) is {off:.3f} sd from it"
                    )
                    problem.reference = (mean, sd)
            else:
                problem.reference = exact_reference(problem)
                if kind == "regression":  # how far the Laplace approximation in (w, log σ) would have been
                    mean, sd = laplace(problem)
                    off = float(((mean - problem.reference[0]).abs() / problem.reference[1]).max())
                    notes.setdefault(name, []).append(
                        f"N = {n:.0e}: Laplace in (w, log σ) at the joint mode is {off:.3f} sd from the exact mean"
                    )
            data = jax_data(problem)
            log("  ours at the defaults")
            cells["ours"] = ours(problem, min(args.budget, left()), device)
            if "nuts" in args.samplers:
                log("  NumPyro NUTS")
                limit = min(args.nuts_budget, left())
                first, again, measured_here = nuts_runs(problem, data, limit, history.get(name))
                cells["nuts first"], cells["nuts compiled"] = first, again
                history[name] = measured_here or history.get(name)  # estimates scale from the largest N measured
            for algorithm in ("sgld", "sghmc") if kind == "logistic" and "blackjax" in args.samplers else ():
                if left() < 120:
                    cells[f"{algorithm} first"] = "not run: the total budget was spent"
                    continue
                log(f"  BlackJAX {algorithm}")
                cells[f"{algorithm} first"], cells[f"{algorithm} compiled"] = blackjax_runs(
                    problem, data, algorithm, min(args.budget, left())
                )
            del problem, data
            write_report(render(args, sizes, results, notes, time.perf_counter() - started, header), args.out)


if __name__ == "__main__":
    main()
