"""The peers suite at N = 10⁶ with HMCECS and BlackJAX's control-variate SGLD/SGHMC side by side (issue 57).

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/studies/peers_at_scale.py logistic --n 1000000
    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/studies/peers_at_scale.py regression --n 1000000
    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/studies/peers_at_scale.py logistic-d100 --n 1000000

Runs, in one process, the cells (problem, N) of ``ours-sghmc``, ``blackjax-sghmc-cv``, ``blackjax-sgld-cv`` (each
``(compiled)`` too) and ``numpyro-hmcecs`` through the harness of ``python -m benchmarks run peers`` (the same
``_run_cell``, the same records appended to ``benchmarks/results/peers/cells.jsonl``, rendered by
``python -m benchmarks render``). The BlackJAX engines are registered here, not in ``benchmarks/engines.py``.

**BlackJAX** (ported from the former ``bench_peers.py``; BlackJAX's SG-MCMC has no warm-up, so the step size comes
from the Hessian at the mode): the position is the unconstrained vector (``w``, and ``log σ`` for the regression,
the prior's Jacobian included); the mode from ``optax.lbfgs`` (jitted, full data); ``λ_max`` the largest eigenvalue
of the full-data Hessian there (``jax.hessian``); ``blackjax.sgld`` at ``0.2 / λ_max`` or ``blackjax.sghmc`` (10
integration steps per draw) at ``h = 0.1 / √λ_max``, friction ``α = 0.1 / h``; the gradient estimator
``blackjax.sgmcmc.gradients.control_variates`` centred at the mode; 4 chains vmapped in one jitted ``lax.scan`` from
the mode, minibatches of 1,000 drawn with replacement; burn-in 500 SGLD steps or 100 SGHMC draws. The time covers
the mode, the Hessian, the control variate's full-data gradient and the sampling. ``-cv (compiled)``: draws per chain
doubled from 250 until accurate, each count run once untimed (it compiles: the run's length is static) and then
timed; ``-cv``: that count again after ``jax.clear_caches()`` with new functions, compilation included (a user's
first run).

**HMCECS** is the harness's ``numpyro-hmcecs``; ``numpyro-hmcecs (compiled)`` the same ``MCMC`` run twice, the
second run (another key) timed: NumPyro reuses its compiled sampler. (With ``jit_model_args=True`` the data become
arguments and, at N = 10⁶, a run took 152 s against 45 s as constants: not used.) A cell still running after
``--limit`` seconds (twice that for the two runs) is recorded as failed with that reason and the process ends (they
run last).

XLA runs on one thread (``XLA_FLAGS``), as torch does with ``--threads 1``. ``register()`` adds the BlackJAX
engines to ``benchmarks.engines.ENGINES`` (``tests/test_benchmarks_page.py`` calls it to know their records).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks import engines, harness, records  # noqa: E402
from benchmarks.suites import SUITES  # noqa: E402

BURN_IN = {"sgld": 500, "sghmc": 100}  # steps, and SGHMC's draws (10 gradients each)
ENGINE_ORDER = (
    "ours-sghmc",
    "blackjax-sghmc-cv (compiled)",
    "blackjax-sghmc-cv",
    "blackjax-sgld-cv (compiled)",
    "blackjax-sgld-cv",
    "numpyro-hmcecs",
    "numpyro-hmcecs (compiled)",
)


def blackjax_pipeline(kind: str, x, y, algorithm: str):
    """Mode, step size, control variate and a block sampler, built fresh (new functions: compiled on first call)."""
    import jax
    import jax.numpy as jnp
    from blackjax.sgmcmc.gradients import grad_estimator

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the studies' own modules
    from peers_models import control_variate_chains, lbfgs_mode

    n, d = x.shape
    batch, chains = engines.BATCH, engines.CHAINS

    if kind == "logistic":

        def log_prior(theta):
            return -0.5 * jnp.sum(theta**2)

        def log_likelihood(theta, row):
            f = row[0] @ theta
            return row[1] * f - jax.nn.softplus(f)

        start = jnp.zeros(d, dtype=x.dtype)
    else:  # (w, s), σ = e^s ~ HalfNormal(1): log p(s) = −e^{2s}/2 + s

        def log_prior(theta):
            s = theta[-1]
            return -0.5 * jnp.sum(theta[:-1] ** 2) - 0.5 * jnp.exp(2 * s) + s

        def log_likelihood(theta, row):
            s = theta[-1]
            r = (row[1] - row[0] @ theta[:-1]) * jnp.exp(-s)
            return -0.5 * r**2 - s

        start = jnp.zeros(d + 1, dtype=x.dtype)

    def neg_log_joint(theta):
        return -log_prior(theta) - jnp.sum(jax.vmap(log_likelihood, in_axes=(None, 0))(theta, (x, y)))

    find_mode = lbfgs_mode(neg_log_joint, n)

    @jax.jit
    def largest_curvature(theta):
        return jnp.linalg.eigvalsh(jax.hessian(neg_log_joint)(theta))[-1]

    estimator = grad_estimator(log_prior, log_likelihood, n)

    sample = control_variate_chains(estimator, algorithm, n, batch, chains)

    def run(num_draws: int, seed: int) -> torch.Tensor:
        mode = find_mode(start)
        lam = largest_curvature(mode)
        # SGLD: 0.2 / λ_max keeps the stiffest direction's variance within 11%. BlackJAX's SGHMC moves the position
        # with the old momentum and the momentum with the old gradient (explicit Euler), whose energy grows by
        # h²λ per step unless friction removes it: h = 0.1 / √λ_max with α h = 0.1 holds that bias near 5%.
        step_size = 0.2 / lam if algorithm == "sgld" else 0.1 / jnp.sqrt(lam)
        alpha = 0.1 / step_size
        draws = sample(BURN_IN[algorithm] + num_draws, jax.random.PRNGKey(seed), mode, step_size, alpha, x, y)
        draws = jax.device_get(draws[:, BURN_IN[algorithm] :])
        return torch.from_numpy(draws.copy()).double()  # (chains, draws, d')

    return run


def _blackjax_compiled(algorithm: str):
    def run(cell: engines.Cell) -> dict:
        import jax

        x, y = engines._jax_data(cell)
        pipeline = blackjax_pipeline(cell.problem.kind, x, y, algorithm)
        draws, spent = 250, 0.0
        while True:
            pipeline(draws, cell.seed + 99)  # compiles this count
            start = time.perf_counter()
            flat = pipeline(draws, cell.seed)
            seconds = time.perf_counter() - start
            spent += seconds
            scored = engines._scored(cell, flat, seconds)
            if scored["accurate"] or spent + 4 * seconds > cell.budget:
                break
            draws *= 2
        cell.shared[("blackjax", algorithm, cell.problem.name, cell.n)] = draws
        jax.clear_caches()
        return {"seconds": round(seconds, 2), "draws": f"{draws} × {engines.CHAINS}", **scored}

    return run


def _blackjax_first(algorithm: str):
    def run(cell: engines.Cell) -> dict:
        import jax

        draws = cell.shared.get(("blackjax", algorithm, cell.problem.name, cell.n), 250)
        x, y = engines._jax_data(cell)
        jax.clear_caches()
        start = time.perf_counter()
        flat = blackjax_pipeline(cell.problem.kind, x, y, algorithm)(draws, cell.seed)
        seconds = time.perf_counter() - start
        scored = engines._scored(cell, flat, seconds)
        return {"seconds": round(seconds, 2), "draws": f"{draws} × {engines.CHAINS}", **scored}

    return run


def _hmcecs_compiled(cell: engines.Cell) -> dict:
    """HMCECS as the harness's ``numpyro-hmcecs``, run twice in one ``MCMC``; the second run is timed (compiled)."""
    import jax
    import jax.numpy as jnp
    from numpyro.infer import HMCECS, MCMC, NUTS
    from numpyro.infer.hmc_gibbs import taylor_proxy

    mode = cell.reference["mode"]
    reference = {"w": jnp.asarray(mode[: cell.problem.d].float().numpy())}
    if "scale" in cell.problem.sites:
        reference["scale"] = jnp.exp(jnp.asarray(float(mode[-1])))
    model = cell.problem.numpyro_model(engines.BATCH)
    kernel = HMCECS(NUTS(model), num_blocks=100, proxy=taylor_proxy(reference, degree=2))
    mcmc = MCMC(kernel, num_warmup=engines.WARMUP, num_samples=engines.DRAWS, num_chains=1, progress_bar=False)
    data = engines._jax_data(cell)
    mcmc.run(jax.random.PRNGKey(cell.seed), *data)  # compiles
    start = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(cell.seed + 1), *data)
    samples = jax.device_get(mcmc.get_samples(group_by_chain=True))
    seconds = time.perf_counter() - start
    flat = cell.problem.flatten({k: torch.from_numpy(v.copy()) for k, v in samples.items()})
    scored = engines._scored(cell, flat, seconds)
    return {"seconds": round(seconds, 2), "draws": f"{engines.DRAWS} × 1", "subsample": engines.BATCH, **scored}


def register() -> None:
    engines.ENGINES["numpyro-hmcecs (compiled)"] = engines.Engine(
        "numpyro-hmcecs (compiled)", "sgmcmc", _hmcecs_compiled, ("numpyro", "jax"), "HMCECS, second run"
    )
    needs = ("blackjax", "optax", "jax")
    for algorithm in ("sgld", "sghmc"):
        name = f"blackjax-{algorithm}-cv"
        about = f"blackjax.{algorithm}, control variates at the mode, step size from the Hessian, 4 chains"
        engines.ENGINES[name] = engines.Engine(name, "sgmcmc", _blackjax_first(algorithm), needs, about)
        engines.ENGINES[f"{name} (compiled)"] = engines.Engine(
            f"{name} (compiled)", "sgmcmc", _blackjax_compiled(algorithm), needs, about + ", second call"
        )


def watchdog(engine_name: str, limit: float) -> None:
    """After ``limit`` s in ``engine_name``'s cell, write it as failed and end the process (its run is one XLA call)."""
    original = engines.ENGINES[engine_name]

    def run(cell: engines.Cell) -> dict:
        def stop() -> None:
            base = records.stamp(torch.get_num_threads(), "cpu")
            record = {**base, "problem": cell.problem.name, "n": cell.n, "engine": engine_name}
            record.update(seed=cell.seed, budget=cell.budget, date=records.now(), status="failed")
            record["reason"] = f"stopped after {limit:.0f} s unfinished (one 500 + 500 run)"
            records.append("peers", record)
            harness.log(f"    {engine_name}: {record['reason']}; the process ends")
            os._exit(3)

        timer = threading.Timer(limit, stop)
        timer.daemon = True
        timer.start()
        try:
            return original.run(cell)
        finally:
            timer.cancel()

    engines.ENGINES[engine_name] = replace(original, run=run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", choices=("logistic", "logistic-d100", "regression"))
    parser.add_argument("--n", type=int, default=10**6)
    parser.add_argument("--only", default="", help="comma-separated engines (default: all of them)")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds before an HMCECS cell is stopped")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    register()
    watchdog("numpyro-hmcecs", args.limit)
    watchdog("numpyro-hmcecs (compiled)", 2 * args.limit)
    chosen = tuple(e for e in ENGINE_ORDER if not args.only or e in args.only.split(","))
    peers = SUITES["peers"]
    SUITES["peers"] = replace(peers, sizes={**peers.sizes, "full": ((args.problem, args.n),)}, engines=chosen)
    from benchmarks.__main__ import main as benchmarks_main

    return benchmarks_main(["run", "peers", "--size", "full", "--threads", "1"])


if __name__ == "__main__":
    sys.exit(main())
