"""Time to accuracy against the fastest peers: NumPyro's jitted NUTS and BlackJAX's SGLD/SGHMC with control variates.

    python benchmarks/bench_peers.py                       # N = 1e4, 1e5, 1e6 (about 20 minutes on 2 loaded cores)
    python benchmarks/bench_peers.py --sizes 1e4 --out /tmp/peers.md   # one size

Needs the benchmark-only peers (``pip install -e ".[peers]"``: jax[cpu], numpyro, blackjax); without them the run
stops with the import error. Prints a markdown report and writes it to ``benchmarks/results/peers.md``.

**Problem**: logistic regression, d = 10, ``w ~ N(0, I)``, float32 data (``bench_accuracy.make``); every sampler is
handed the same ``x, y`` (the JAX side gets them as NumPy views of the torch tensors).

**Accuracy**: every posterior mean within 0.1 reference sd and every posterior sd within 10% of the reference.
**Reference**: the Laplace approximation at the MAP with the exact Hessian (Newton's method in float64,
``bench_accuracy.laplace``), from none of the samplers; at these N the posterior is within a few hundredths of an sd
of it.

**Ours**: ``StochasticMCMC(SGHMC(model), num_warmup=500, num_chains=4)``, every default (``control_variate="auto"``,
warm-up's step size, friction and metric), B = 1,000; draws per chain doubled from 250 (same seed) until accurate;
the time of the accurate run, from the constructor to the end of ``run``. Where ``N/B`` is below the
``"auto"`` threshold (no control variate), ``control_variate="map"`` is run as well.

**NumPyro NUTS**: ``MCMC(NUTS(model), num_warmup=500, num_samples=500, jit_model_args=True)``, one chain;
*first run* after ``jax.clear_caches()`` (compilation included), *compiled run* the same ``MCMC`` object run again
with another key (NumPyro reuses its compiled sampler for arguments of the same shapes). Its time is for the whole
500 + 500 run; whether its 500 draws are accurate is reported with it (and how many of them sufficed).

**BlackJAX** (``blackjax.sgld``, ``blackjax.sghmc`` with its default 10 integration steps per draw): the gradient
estimator ``blackjax.sgmcmc.gradients.control_variates`` centred at the mode from ``optax.lbfgs``
(jitted, on the full data), and a step size from the Hessian there (BlackJAX has no warm-up to choose one):
``0.2 / λ_max`` for SGLD; for SGHMC ``h = 0.1 / √λ_max`` and friction ``alpha = 0.1 / h`` (BlackJAX's
default ``alpha=0.01`` diverges: its explicit Euler step gains energy h²λ per step); 4 chains vmapped in one jitted
``lax.scan``, started at the mode, minibatches of 1,000 drawn with replacement; burn-in 500 SGLD steps or 100 SGHMC
draws; draws doubled from 250 per chain until accurate. Its time covers the mode, the Hessian, the control
variate's full-data gradient and the sampling; *compiled run* the second call at that draw count (the run's length
is static, so each count compiles once), *first run* after ``jax.clear_caches()`` at the same draw count.

Threads: ``--threads`` sets torch's threads and XLA's (``XLA_FLAGS`` intra-op threads, Eigen's multi-threading off
at 1). Each measurement carries the 1-minute load average and the cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from bench_accuracy import accurate, errors, laplace, make, ours_to_accuracy  # benchmarks/ is on sys.path
from harness import ForeignLoad, log, machine, write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pyro_scalable.infer.sgmcmc.control_choice import AUTO_RATIO  # noqa: E402

BATCH, D, CHAINS = 1000, 10, 4
BURN_IN = {"sgld": 500, "sghmc": 100}  # steps, and SGHMC's draws (10 gradients each)
NUTS_WARMUP, NUTS_DRAWS = 500, 500


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


def import_peers():
    try:
        import blackjax
        import jax
        import numpyro
        import optax
    except ImportError as error:  # a benchmark against peers that are missing has nothing to report
        raise SystemExit(f"bench_peers needs the peers: pip install -e '.[peers]' ({error})") from error
    jax.config.update("jax_enable_x64", False)
    return jax, numpyro, blackjax, optax


# ====================================================================================== NumPyro
def nuts_runs(problem, x, y, seed: int = 0) -> tuple[Cell, Cell]:
    jax, numpyro, _, _ = import_peers()
    import jax.numpy as jnp
    import numpyro.distributions as ndist
    from numpyro.infer import MCMC, NUTS

    def model(x, y):
        w = numpyro.sample("w", ndist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
        numpyro.sample("obs", ndist.Bernoulli(logits=x @ w), obs=y)

    mcmc = MCMC(NUTS(model), num_warmup=NUTS_WARMUP, num_samples=NUTS_DRAWS, progress_bar=False, jit_model_args=True)

    def run(key: int):
        mcmc.run(jax.random.PRNGKey(key), x, y)
        return torch.from_numpy(jax.device_get(mcmc.get_samples()["w"]).copy()).double()

    cells = []
    jax.clear_caches()
    for key in (seed, seed + 1):
        draws, seconds, load = measured(lambda key=key: run(key))
        needed = next((k for k in range(25, NUTS_DRAWS + 1, 25) if accurate(errors(draws[:k], *problem.reference))), 0)
        note = f"{needed} of its draws sufficed; " if needed else ""
        cells.append(Cell(seconds, errors(draws, *problem.reference), load, note))
        log(f"    NumPyro NUTS key {key}: {cells[-1].text()}")
    return cells[0], cells[1]


# ====================================================================================== BlackJAX
def blackjax_pipeline(x, y, algorithm: str):
    """Mode, step size, control variate and a block sampler, built fresh (new functions: compiled on first call)."""
    jax, _, blackjax, optax = import_peers()
    import jax.numpy as jnp
    from blackjax.sgmcmc.gradients import control_variates, grad_estimator

    n = x.shape[0]

    def neg_log_joint(w):
        f = x @ w
        return 0.5 * jnp.sum(w**2) - jnp.sum(y * f - jax.nn.softplus(f))

    solver = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(neg_log_joint)
    tolerance = 1e-3 * n**0.5

    @jax.jit
    def find_mode(w0):
        def body(carry):
            w, state = carry
            value, grad = value_and_grad(w, state=state)
            updates, state = solver.update(grad, state, w, value=value, grad=grad, value_fn=neg_log_joint)
            return optax.apply_updates(w, updates), state

        def going(carry):
            count = optax.tree_utils.tree_get(carry[1], "count")
            grad = optax.tree_utils.tree_get(carry[1], "grad")
            return (count == 0) | ((count < 100) & (optax.tree_utils.tree_norm(grad) > tolerance))

        return jax.lax.while_loop(going, body, (w0, solver.init(w0)))[0]

    @jax.jit
    def largest_curvature(w):
        p = jax.nn.sigmoid(x @ w)
        return jnp.linalg.eigvalsh(jnp.eye(w.shape[0]) + (x * (p * (1 - p))[:, None]).T @ x)[-1]

    def log_likelihood(w, row):
        f = row[0] @ w
        return row[1] * f - jax.nn.softplus(f)

    estimator = grad_estimator(lambda w: -0.5 * jnp.sum(w**2), log_likelihood, n)

    @partial(jax.jit, static_argnums=0)
    def chains(num_steps: int, key, mode, step_size, alpha, xs, ys):
        """Every step of 4 chains from the mode; the control variate's full-data gradient once, at the start."""
        controlled = control_variates(estimator, mode, (xs, ys))
        if algorithm == "sgld":
            algo = blackjax.sgld(controlled)
        else:
            algo = blackjax.sghmc(controlled, alpha=alpha)

        def chain(key, w):
            def body(w, key):
                pick, move = jax.random.split(key)
                idx = jax.random.randint(pick, (BATCH,), 0, n)
                w = algo.step(move, w, (xs[idx], ys[idx]), step_size)
                return w, w

            return jax.lax.scan(body, w, jax.random.split(key, num_steps))[1]

        return jax.vmap(chain, in_axes=(0, None))(jax.random.split(key, CHAINS), mode)

    def run(num_draws: int, seed: int):
        mode = find_mode(jnp.zeros(x.shape[1], dtype=x.dtype))
        lam = largest_curvature(mode)
        # SGLD: 0.2 / λ_max keeps the stiffest direction's variance within 11%. BlackJAX's SGHMC moves the position
        # with the old momentum and the momentum with the old gradient (explicit Euler), whose energy grows by
        # h²λ per step unless friction removes it: h = 0.1 / √λ_max with α h = 0.1 holds that bias near 5%.
        step_size = 0.2 / lam if algorithm == "sgld" else 0.1 / jnp.sqrt(lam)
        alpha = 0.1 / step_size
        draws = chains(BURN_IN[algorithm] + num_draws, jax.random.PRNGKey(seed), mode, step_size, alpha, x, y)
        draws = jax.device_get(draws[:, BURN_IN[algorithm] :])
        return torch.from_numpy(draws.reshape(-1, draws.shape[-1]).copy()).double()

    return run


def blackjax_runs(problem, x, y, algorithm: str, budget: float) -> tuple[Cell, Cell]:
    jax = import_peers()[0]
    run = blackjax_pipeline(x, y, algorithm)
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
    fresh = blackjax_pipeline(x, y, algorithm)
    draws, seconds, load = measured(lambda: fresh(draws_per_chain, 0))
    first = Cell(seconds, errors(draws, *problem.reference), load, f"{draws_per_chain} draws × {CHAINS}; ")
    log(f"    BlackJAX {algorithm}, first run: {first.text()}")
    return first, compiled


# ====================================================================================== ours
def ours(problem, control_variate: str, budget: float) -> Cell:
    runs = ours_to_accuracy(problem, control_variate, budget)  # each run timed on its own; the last is reported
    last = runs[-1]
    note = f"{last.draws} draws × 4; tried {', '.join(str(r.draws) for r in runs)}; "
    return Cell(last.seconds, last.err, f"{os.getloadavg()[0]:.1f}", note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e4,1e5,1e6", help="N values, e.g. '1e4,1e5,1e6'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds one run of an SG-MCMC sampler may take")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peers.md")
    args = parser.parse_args()
    flags = f"--xla_cpu_multi_thread_eigen={'false' if args.threads == 1 else 'true'}"
    os.environ["XLA_FLAGS"] = f"{flags} intra_op_parallelism_threads={args.threads}"
    torch.set_num_threads(args.threads)
    jax, numpyro, blackjax, _ = import_peers()
    import numpy as np

    sizes = [int(float(n)) for n in args.sizes.split(",")]
    peers = f"jax {jax.__version__}, numpyro {numpyro.__version__}, blackjax {blackjax.__version__}"
    rows, crossover = [], []
    started = time.perf_counter()
    for n in sizes:
        problem = make("logistic", n, D, BATCH)
        log(f"N = {n:.0e}: reference")
        problem.reference = laplace(problem)
        x, y = jax.numpy.asarray(problem.x.numpy()), jax.numpy.asarray(problem.y.numpy().astype(np.float32))
        log("  ours at the defaults")
        cells = {"ours": ours(problem, "auto", args.budget)}
        if n / BATCH < AUTO_RATIO:
            cells["ours, map"] = ours(problem, "map", args.budget)
        log("  NumPyro NUTS")
        cells["nuts first"], cells["nuts compiled"] = nuts_runs(problem, x, y)
        for algorithm in ("sgld", "sghmc"):
            log(f"  BlackJAX {algorithm}")
            cells[f"{algorithm} first"], cells[f"{algorithm} compiled"] = blackjax_runs(
                problem, x, y, algorithm, args.budget
            )
        rows.append((n, cells))
        ratio = cells["ours"].seconds / cells["nuts first"].seconds
        crossover.append((n, ratio, cells["ours"].seconds / cells["nuts compiled"].seconds))
        del problem, x, y
    elapsed = time.perf_counter() - started
    names = ["ours", "ours, map", "nuts first", "nuts compiled", "sgld first", "sgld compiled"]
    names += ["sghmc first", "sghmc compiled"]
    titles = [
        "ours, SGHMC(model) at the defaults",
        'ours, control_variate="map"',
        "NumPyro NUTS, first run (compile included)",
        "NumPyro NUTS, compiled run",
        "BlackJAX SGLD + CV, first run",
        "BlackJAX SGLD + CV, compiled",
        "BlackJAX SGHMC + CV, first run",
        "BlackJAX SGHMC + CV, compiled",
    ]
    report = [
        f"# Time to accuracy: SGHMC(model) at the defaults against NumPyro NUTS and BlackJAX SGLD/SGHMC, logistic "
        f"regression d = 10, N = {', '.join(f'{n:.0e}' for n in sizes)}",
        "",
        f"Command: `python {' '.join(['benchmarks/bench_peers.py', *sys.argv[1:]])}` ({elapsed / 60:.1f} minutes)",
        "",
        *machine(args.threads, peers),
        "",
        "Seconds; in brackets the worst mean error in reference sds and the worst sd error (accurate: ≤ 0.1 sd and "
        "≤ 10%), then the 1-minute load average (2 cores) and the cores other processes used meanwhile. The "
        "reference is the exact Laplace approximation at the MAP (Newton, float64): from none of the samplers.",
        "",
        "| sampler | " + " | ".join(f"N = {n:.0e}" for n, _ in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for name, title in zip(names, titles, strict=True):
        report.append(f"| {title} | " + " | ".join(c[name].text() if name in c else "–" for _, c in rows) + " |")
    report += ["", "Ours at the defaults over NumPyro NUTS (below 1: ours is faster):", ""]
    report += [
        f"- N = {n:.0e}: {first:.2f}× its first run, {again:.2f}× its compiled run" for n, first, again in crossover
    ]
    report += [""]
    write_report("\n".join(report), args.out)


if __name__ == "__main__":
    main()
