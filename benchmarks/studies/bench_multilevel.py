"""MultilevelMCMC against NumPyro's NUTS on a many-group model: varying intercepts and slopes, skewed group sizes.

A study, not a suite of the harness: one experiment behind the multilevel guide's large-N figures, whose reference is
a NUTS run of hours cached once per size and whose records are runs (a seed of one engine at rows x groups) compared
side by side in one process, not cells of a problem, size and engine rendered into a table.

The model (centred, as a user writes it): ``mu ~ N(0, 5)`` (2), ``tau ~ HalfNormal(1)`` (2), ``sigma ~ HalfNormal(1)``,
per group ``a_k ~ N(mu_0, tau_0)``, ``b_k ~ N(mu_1, tau_1)``, per row ``y_i ~ N(a_g(i) + b_g(i) x_i, sigma)``; the
groups' sizes follow a Zipf law (weights ``1/k^1.1``, every group at least one row: from 1 row to thousands), in
float32.

``reference``: a long NumPyro NUTS run (one chain per call, ``--chains`` of them in sequence), its per-coordinate
mean, sd and ESS cached in ``benchmarks/results/multilevel/reference_<rows>_<groups>.npz`` with the command in the
file. ``compare``: ``MultilevelMCMC`` at its defaults (4 chains, 1,000 + 1,000 sweeps) over ``--seeds`` seeds and
NumPyro's NUTS (4 chains in sequence, ``--nuts-warmup`` + ``--nuts-samples``), both timed in this process, each
checked against the reference: every coordinate's mean within 0.2 reference sd, sd within 10%, r_hat <= 1.01
(rank-normalised). One JSON line per run goes to ``--out``.

Run (``bench`` extra for NumPyro), one thread each as the other benchmarks::

    OMP_NUM_THREADS=1 python benchmarks/studies/bench_multilevel.py reference --rows 100000 --groups 1000
    OMP_NUM_THREADS=1 python benchmarks/studies/bench_multilevel.py compare --rows 100000 --groups 1000 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyro_scalable.infer import MultilevelMCMC  # noqa: E402
from pyro_scalable.infer.health import bulk_ess, rank_r_hat  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "multilevel"


def simulate(rows: int, groups: int, seed: int = 0):
    """Group index, covariate and outcome (float32): Zipf group sizes, true tau (0.5, 0.3), sigma 1."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, groups + 1) ** 1.1
    g = np.concatenate([np.arange(groups), rng.choice(groups, rows - groups, p=weights / weights.sum())])
    rng.shuffle(g)
    x = rng.normal(size=rows)
    a, b = 1.0 + 0.5 * rng.normal(size=groups), 0.5 + 0.3 * rng.normal(size=groups)
    y = a[g] + b[g] * x + rng.normal(size=rows)
    return torch.as_tensor(g), torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)


def model(g, x, y, groups):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(2), 5.0).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(2)).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("groups", groups):
        a = pyro.sample("a", dist.Normal(mu[0], tau[0]))
        b = pyro.sample("b", dist.Normal(mu[1], tau[1]))
    with pyro.plate("data", len(y), subsample_size=1000) as idx:
        k = g[idx]
        pyro.sample("obs", dist.Normal(a[k] + b[k] * x[idx], sigma), obs=y[idx])


def _numpyro_model(groups):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def numpyro_model(g, x, y):
        mu = numpyro.sample("mu", nd.Normal(jnp.zeros(2), 5.0).to_event(1))
        tau = numpyro.sample("tau", nd.HalfNormal(jnp.ones(2)).to_event(1))
        sigma = numpyro.sample("sigma", nd.HalfNormal(1.0))
        with numpyro.plate("groups", groups):
            a = numpyro.sample("a", nd.Normal(mu[0], tau[0]))
            b = numpyro.sample("b", nd.Normal(mu[1], tau[1]))
        numpyro.sample("obs", nd.Normal(a[g] + b[g] * x, sigma), obs=y)

    return numpyro_model


SITES = ("mu", "tau", "sigma", "a", "b")


def flat(samples: dict) -> np.ndarray:
    """``(chains, draws, coordinates)`` in the order of :data:`SITES`."""
    parts = [np.asarray(samples[s]).reshape(*np.asarray(samples[s]).shape[:2], -1) for s in SITES]
    return np.concatenate(parts, -1)


def _sequential_nuts(model, *, warmup: int, samples: int, chains: int):
    """NumPyro's NUTS on ``model``, its chains in sequence, no progress bar."""
    from numpyro.infer import MCMC, NUTS

    return MCMC(
        NUTS(model),
        num_warmup=warmup,
        num_samples=samples,
        num_chains=chains,
        chain_method="sequential",
        progress_bar=False,
    )


def nuts(g, x, y, groups, *, warmup: int, samples: int, chains: int, seed: int):
    """NumPyro NUTS, chains in sequence: draws ``(chains, draws, coordinates)``, seconds, leapfrog steps."""
    import jax

    mcmc = _sequential_nuts(_numpyro_model(groups), warmup=warmup, samples=samples, chains=chains)
    start = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), g.numpy(), x.numpy(), y.numpy(), extra_fields=("num_steps",))
    draws = flat(mcmc.get_samples(group_by_chain=True))
    seconds = time.perf_counter() - start
    steps = int(np.asarray(mcmc.get_extra_fields()["num_steps"]).sum())
    return draws, seconds, steps


def collapsed(g, x, y, groups, *, warmup: int, samples: int, chains: int, seed: int, thin: int = 10):
    r"""The exact reference: NumPyro NUTS on the globals' marginal (every group's effects integrated out in closed
    form), then each group's effects as the mixture of their Gaussian conditionals over the globals' draws.

    Given the globals, group k's ``(a_k, b_k)`` has a Gaussian prior and a linear-Gaussian likelihood: with
    :math:`X_k = [1, x]`, its conditional precision is :math:`\Lambda_k = X_k^\top X_k/\sigma^2 +
    \mathrm{diag}(\tau)^{-2}`, its mean :math:`\Lambda_k^{-1}(X_k^\top y_k/\sigma^2 + \mathrm{diag}(\tau)^{-2}\mu)`,
    and its rows' marginal likelihood is closed form from the sufficient statistics :math:`n_k, \sum x, \sum x^2,
    \sum y, \sum xy, \sum y^2`. NUTS then samples 5 coordinates (a pass over the 10,000 groups' statistics per
    gradient, not the 10^6 rows), and the effects' mean and sd are exact given the globals' draws: :math:`E[m_k]`
    and :math:`E[\Lambda_k^{-1}] + \mathrm{Var}[m_k]`. Returns ``(mean, sd, ess, r_hat)`` in :data:`SITES`' order,
    seconds and leapfrog steps.
    """
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    jax.config.update("jax_enable_x64", True)
    gi, xd, yd = g.numpy(), x.double().numpy(), y.double().numpy()
    stats = [
        np.bincount(gi, weights=w, minlength=groups) for w in (np.ones_like(xd), xd, xd * xd, yd, xd * yd, yd * yd)
    ]
    n, sx, sxx, sy, sxy, syy = (jnp.asarray(v) for v in stats)

    def conditional(mu, tau, sigma):
        """Each group's conditional precision (3 entries), mean (2) and log marginal likelihood."""
        p00, p01, p11 = n / sigma**2 + 1 / tau[0] ** 2, sx / sigma**2, sxx / sigma**2 + 1 / tau[1] ** 2
        r0, r1 = sy / sigma**2 + mu[0] / tau[0] ** 2, sxy / sigma**2 + mu[1] / tau[1] ** 2
        det = p00 * p11 - p01**2
        m0, m1 = (p11 * r0 - p01 * r1) / det, (p00 * r1 - p01 * r0) / det
        log_lik = (
            -0.5 * n * jnp.log(2 * jnp.pi * sigma**2)
            - syy / (2 * sigma**2)
            - 0.5 * jnp.log(det)
            - jnp.log(tau[0] * tau[1])
            + 0.5 * (m0 * r0 + m1 * r1)
            - 0.5 * (mu[0] ** 2 / tau[0] ** 2 + mu[1] ** 2 / tau[1] ** 2)
        )
        return (p00, p01, p11, det), (m0, m1), log_lik

    def marginal_model():
        mu = numpyro.sample("mu", nd.Normal(jnp.zeros(2), 5.0).to_event(1))
        tau = numpyro.sample("tau", nd.HalfNormal(jnp.ones(2)).to_event(1))
        sigma = numpyro.sample("sigma", nd.HalfNormal(1.0))
        numpyro.factor("groups", conditional(mu, tau, sigma)[2].sum())

    mcmc = _sequential_nuts(marginal_model, warmup=warmup, samples=samples, chains=chains)
    start = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), extra_fields=("num_steps",))
    s = mcmc.get_samples(group_by_chain=True)
    globals_ = np.concatenate([np.asarray(s["mu"]), np.asarray(s["tau"]), np.asarray(s["sigma"])[..., None]], -1)
    first, second = np.zeros((2, groups)), np.zeros((2, groups))
    kept = globals_[:, ::thin].reshape(-1, 5)
    for z in kept:
        (p00, p01, p11, det), (m0, m1), _ = conditional(z[:2], z[2:4], z[4])
        variances = (np.asarray(p11 / det), np.asarray(p00 / det))
        for j, (m, v) in enumerate(zip((np.asarray(m0), np.asarray(m1)), variances)):
            first[j] += m
            second[j] += m * m + v
    seconds = time.perf_counter() - start
    local_mean = first / len(kept)
    local_sd = np.sqrt(second / len(kept) - local_mean**2)
    t = torch.as_tensor(globals_, dtype=torch.float64)
    mean = np.concatenate([globals_.reshape(-1, 5).mean(0), local_mean.reshape(-1)])
    sd = np.concatenate([globals_.reshape(-1, 5).std(0), local_sd.reshape(-1)])
    steps = int(np.asarray(mcmc.get_extra_fields()["num_steps"]).sum())
    return mean, sd, bulk_ess(t).numpy(), rank_r_hat(t).numpy(), seconds, steps


def reference_path(rows: int, groups: int) -> Path:
    return RESULTS / f"reference_{rows}_{groups}.npz"


def make_reference(options) -> None:
    g, x, y = simulate(options.rows, options.groups)
    if options.collapsed:
        mean, sd, ess, r_hat, seconds, steps = collapsed(
            g, x, y, options.groups, warmup=options.warmup, samples=options.samples, chains=options.chains, seed=1
        )
        RESULTS.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python benchmarks/studies/bench_multilevel.py", *sys.argv[1:]])
        np.savez(
            reference_path(options.rows, options.groups),
            mean=mean,
            sd=sd,
            ess=ess,
            r_hat=r_hat,
            command=command,
            seconds=seconds,
            leapfrog_steps=steps,
            method="collapsed",
        )
        print(f"collapsed reference: {seconds:.0f} s, globals' least ESS {ess.min():.0f}, r_hat {r_hat.max():.4f}")
        return
    draws, seconds, steps = nuts(
        g, x, y, options.groups, warmup=options.warmup, samples=options.samples, chains=options.chains, seed=1
    )
    t = torch.as_tensor(draws, dtype=torch.float64)
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/studies/bench_multilevel.py", *sys.argv[1:]])
    np.savez(
        reference_path(options.rows, options.groups),
        mean=draws.reshape(-1, draws.shape[-1]).mean(0),
        sd=draws.reshape(-1, draws.shape[-1]).std(0),
        ess=bulk_ess(t).numpy(),
        r_hat=rank_r_hat(t).numpy() if draws.shape[0] > 1 else np.full(draws.shape[-1], np.nan),
        command=command,
        seconds=seconds,
        leapfrog_steps=steps,
    )
    print(f"reference: {seconds:.0f} s, {steps} leapfrog steps, least ESS {float(bulk_ess(t).min()):.0f}")


def check(draws: np.ndarray, reference) -> dict:
    """The issue's criterion against the reference: worst mean error (sd), worst sd error, r_hat, least ESS."""
    pooled = draws.reshape(-1, draws.shape[-1])
    mean_error = np.abs(pooled.mean(0) - reference["mean"]) / reference["sd"]
    sd_error = np.abs(pooled.std(0) / reference["sd"] - 1)
    t = torch.as_tensor(draws, dtype=torch.float64)
    r_hat, ess = float(rank_r_hat(t).max()), float(bulk_ess(t).min())
    return {
        "mean_error": float(mean_error.max()),
        "sd_error": float(sd_error.max()),
        "r_hat": r_hat,
        "ess": ess,
        "passed": bool(mean_error.max() <= 0.2 and sd_error.max() <= 0.1 and r_hat <= 1.01),
    }


def compare(options) -> None:
    reference = np.load(reference_path(options.rows, options.groups))
    g, x, y = simulate(options.rows, options.groups)
    out = open(options.out, "a") if options.out else None
    for seed in range(options.seeds):
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mcmc = MultilevelMCMC(model, seed=seed, progress_bar=False).run(g, x, y, options.groups)
        seconds = time.perf_counter() - start
        samples = {k: v.numpy() for k, v in mcmc.get_samples(group_by_chain=True).items()}
        result = {"engine": "MultilevelMCMC", "seed": seed, "seconds": seconds, **check(flat(samples), reference)}
        result["warnings"] = [str(w.message)[:80] for w in caught]
        result["data_passes"] = mcmc.data_passes
        _emit(result, options, out)
    if options.nuts_samples:
        draws, seconds, steps = nuts(
            g, x, y, options.groups, warmup=options.nuts_warmup, samples=options.nuts_samples, chains=4, seed=2
        )
        result = {"engine": "NumPyro NUTS", "seconds": seconds, "leapfrog_steps": steps, **check(draws, reference)}
        _emit(result, options, out)


def _emit(result: dict, options, out) -> None:
    result.update(rows=options.rows, groups=options.groups, threads=torch.get_num_threads())
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["reference", "compare"])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--groups", type=int, default=1_000)
    parser.add_argument("--warmup", type=int, default=1000, help="reference: NUTS warm-up per chain")
    parser.add_argument("--samples", type=int, default=2000, help="reference: NUTS draws per chain")
    parser.add_argument("--chains", type=int, default=2, help="reference: NUTS chains")
    parser.add_argument("--collapsed", action="store_true", help="reference: NUTS on the globals' exact marginal")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nuts-warmup", type=int, default=500)
    parser.add_argument("--nuts-samples", type=int, default=500, help="compare: 0 leaves NUTS out")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    torch.set_num_threads(1)
    make_reference(options) if options.what == "reference" else compare(options)


if __name__ == "__main__":
    main()
