"""The 50-group hierarchy at N = 10⁶: ours against NumPyro's HMCECS, side by side, to an exact reference.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/studies/hierarchy_at_scale.py --n 1000000 --seed 0

The hierarchy of the peers studies (``bench_accuracy.make("hierarchical")``): a linear regression with d = 10
coefficients, a latent noise scale ``σ ~ HalfNormal(1)`` and 50 group intercepts ``b_j ~ N(0, τ)``,
``τ ~ HalfNormal(1)``, centred as users write it, float32 data, about N/50 rows per group. **Reference**: exact, by
quadrature over (log σ, log τ) (``peers_models.exact_reference``: given the scales the rest is Gaussian).
**Accurate**: the harness's criterion (``benchmarks/metrics.py``): every mean within 0.1 reference sd and every sd
within 10%, in the unconstrained space (``w``, ``b``, ``log σ``, ``log τ``).

Engines, run in sequence in one process, each timed from its constructor to its draws (set-up included):

- ``ours-multilevel``: ``MultilevelMCMC(model)`` at its defaults (4 chains, 1,000 + 1,000 sweeps), the engine the
  guide gives for a model with a group plate; draws doubled (same seed) until accurate or ``--budget`` is spent.
- ``ours-sghmc``: ``StochasticMCMC(SGHMC(model), num_warmup=500, num_chains=4)``, every default, B = 1,000: the
  peers harness's ``ours-sghmc`` (draws per chain doubled from 250 until accurate or ``--budget`` is spent).
- ``numpyro-hmcecs``: ``HMCECS(NUTS(model), num_blocks=100, proxy=taylor_proxy(reference, degree=2))``,
  subsample 1,000, one chain of 500 + 500, as the peers harness runs it; the proxy's reference point is the exact
  posterior mean (a centred hierarchy has no finite joint mode to expand at). First run: compilation included;
  ``(compiled)``: the same ``MCMC`` run again with another key.

BlackJAX's SG-MCMC is not run: it has no warm-up, and its step size comes from a rule written for the log-concave
logistic regression (``peers_at_scale.py``), which a model with scales does not satisfy.

One JSON line per engine goes to ``benchmarks/results/hierarchy_at_scale.jsonl``; ``--report`` prints the table of
the latest line per (engine, N, seed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from bench_accuracy import make, unconstrained  # noqa: E402
from peers_models import exact_reference  # noqa: E402

from benchmarks import metrics, records  # noqa: E402
from pyro_scalable.infer import SGHMC, MultilevelMCMC, StochasticMCMC  # noqa: E402

OUT = HERE.parents[0] / "results" / "hierarchy_at_scale.jsonl"
BATCH, CHAINS = 1000, 4


def _scored(problem, samples: dict, reference, seconds: float, chains: int) -> dict:
    flat = unconstrained(problem, samples)
    draws = flat.reshape(chains, -1, flat.shape[-1])
    return {"seconds": round(seconds, 1), **metrics.accuracy(draws, *reference), **metrics.mixing(draws, seconds)}


def _doubling(run, budget: float, first: int) -> dict:
    """``run(draws)`` with draws per chain doubled from ``first`` until accurate or the budget is spent."""
    draws, spent = first, 0.0
    while True:
        scored = run(draws)
        spent += scored["seconds"]
        if scored["accurate"] or spent + 2 * scored["seconds"] > budget:
            return {**scored, "draws": f"{draws} × {CHAINS}", "seconds_all_runs": round(spent, 1)}
        draws *= 2


def ours_multilevel(problem, reference, seed: int, budget: float) -> dict:
    def run(draws: int) -> dict:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mcmc = MultilevelMCMC(problem.model(True), num_samples=draws, seed=seed, progress_bar=False)
            mcmc.run(problem.x, problem.y)
        seconds = time.perf_counter() - start
        samples = mcmc.get_samples()
        scored = _scored(problem, samples, reference, seconds, CHAINS)
        return {**scored, "warned": [str(w.message)[:160] for w in caught if "Health" in type(w.message).__name__]}

    return _doubling(run, budget, 1000)


def ours_sghmc(problem, reference, seed: int, budget: float) -> dict:
    def run(draws: int) -> dict:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # judged against the reference here
            kernel = SGHMC(problem.model(True))
            mcmc = StochasticMCMC(
                kernel, num_samples=draws, num_warmup=500, num_chains=CHAINS, seed=seed, progress_bar=False
            )
            mcmc.run(problem.x, problem.y)
        seconds = time.perf_counter() - start
        return _scored(problem, mcmc.get_samples(), reference, seconds, CHAINS)

    return _doubling(run, budget, 250)


def _hmcecs_model(num_groups: int):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def model(x, y, groups):
        w = numpyro.sample("w", nd.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
        scale = numpyro.sample("scale", nd.HalfNormal(1.0))
        tau = numpyro.sample("tau", nd.HalfNormal(1.0))
        with numpyro.plate("groups", num_groups):
            b = numpyro.sample("b", nd.Normal(0.0, tau))
        with numpyro.plate("data", x.shape[0], subsample_size=BATCH):
            xb = numpyro.subsample(x, event_dim=1)
            yb = numpyro.subsample(y, event_dim=0)
            gb = numpyro.subsample(groups, event_dim=0)
            numpyro.sample("obs", nd.Normal(xb @ w + b[gb], scale), obs=yb)

    return model


def numpyro_hmcecs(problem, reference, seed: int, running: dict):
    import jax
    import jax.numpy as jnp
    from numpyro.infer import HMCECS, MCMC, NUTS
    from numpyro.infer.hmc_gibbs import taylor_proxy

    mean = reference[0]
    d, j = problem.x.shape[1], problem.num_groups
    centre = {  # the exact posterior mean, constrained as the proxy takes it
        "w": jnp.asarray(mean[:d].float().numpy()),
        "b": jnp.asarray(mean[d : d + j].float().numpy()),
        "scale": jnp.exp(jnp.asarray(float(mean[d + j]))),
        "tau": jnp.exp(jnp.asarray(float(mean[d + j + 1]))),
    }
    data = (
        jnp.asarray(problem.x.numpy()),
        jnp.asarray(problem.y.numpy()),
        jnp.asarray(problem.groups.numpy().astype(np.int32)),
    )
    out = []
    jax.clear_caches()
    start = time.perf_counter()
    kernel = HMCECS(NUTS(_hmcecs_model(j)), num_blocks=100, proxy=taylor_proxy(centre, degree=2))
    mcmc = MCMC(kernel, num_warmup=500, num_samples=500, num_chains=1, progress_bar=False)
    for label, key in (("numpyro-hmcecs", seed), ("numpyro-hmcecs (compiled)", seed + 1)):
        running["engine"] = label  # for the watchdog's record
        if out:
            start = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(key), *data)
        samples = jax.device_get(mcmc.get_samples())
        seconds = time.perf_counter() - start
        samples = {k: torch.from_numpy(np.asarray(v).copy()) for k, v in samples.items()}
        out.append({"engine": label, "draws": "500 × 1", **_scored(problem, samples, reference, seconds, 1)})
        yield out[-1]  # recorded before the next run starts, which the watchdog may stop


def _write(record: dict) -> None:
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def _watchdog(limit: float, record: dict) -> None:
    """After ``limit`` s, record HMCECS as stopped unfinished and end the process (its runs are XLA calls)."""

    def stop() -> None:
        _write(
            {**record, "status": "stopped", "reason": f"stopped after {limit:.0f} s unfinished", "date": records.now()}
        )
        os._exit(3)

    timer = threading.Timer(limit, stop)
    timer.daemon = True
    timer.start()


def report() -> None:
    latest = {}
    for line in OUT.read_text().splitlines():
        record = json.loads(line)
        if record.get("status") == "stopped":
            limit = record["reason"].split()[2]  # "stopped after <limit> s unfinished": both runs' limit
            record = {**record, "seconds": "unfinished", "draws": f"500 × 1, stopped at the {limit} s limit"}
            record.update(
                mean_error_sd="–", sd_error=None, accurate=False, ess_min=None, load="", commit=record["commit"]
            )
        latest[(record["engine"], record["n"], record["seed"])] = record
    print(
        "| engine | N | seed | seconds | draws | worst mean error (sd) | worst sd error | accurate | least ESS |"
        " r_hat | load | commit |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---|---:|---:|---|---|")
    for (engine, n, seed), r in sorted(latest.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[1]["date"])):
        print(
            f"| {engine} | {n:,} | {seed} | {r['seconds']} | {r['draws']} | {r['mean_error_sd']} | "
            f"{_percent(r['sd_error'])} | {'yes' if r['accurate'] else 'no'} | {_count(r['ess_min'])} | "
            f"{r.get('r_hat_max', '–')} | {r['load']} | {r['commit']} |"
        )


def _percent(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _count(x) -> str:
    return "–" if x is None else f"{x:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10**6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=1200.0, help="seconds for ours-multilevel (all its runs)")
    parser.add_argument("--sghmc-budget", type=float, default=300.0, help="seconds for ours-sghmc (all its runs)")
    parser.add_argument("--limit", type=float, default=1200.0, help="seconds before HMCECS is stopped (both runs)")
    parser.add_argument("--only", default="", help="comma-separated engines (default: all)")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        report()
        return 0
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    torch.set_num_threads(1)
    problem = make("hierarchical", args.n, 10, BATCH, seed=args.seed)
    reference = exact_reference(problem)
    runs = {
        "ours-multilevel": lambda: [
            {"engine": "ours-multilevel", **ours_multilevel(problem, reference, args.seed, args.budget)}
        ],
        "ours-sghmc": lambda: [
            {"engine": "ours-sghmc", **ours_sghmc(problem, reference, args.seed, args.sghmc_budget)}
        ],
        "numpyro-hmcecs": lambda: numpyro_hmcecs(problem, reference, args.seed, running),
    }
    base = {**records.stamp(1, "cpu"), "n": args.n, "seed": args.seed}
    running = dict(base)
    for name, run in runs.items():
        if args.only and name not in args.only.split(","):
            continue
        load = os.getloadavg()[0]
        if name == "numpyro-hmcecs":
            _watchdog(args.limit, running)
        for record in run():
            after = os.getloadavg()[0]
            _write({**base, **record, "date": records.now(), "load": f"{load:.1f} → {after:.1f}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
