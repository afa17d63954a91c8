"""Ill-conditioned and hierarchical posteriors: SGHMC's defaults against Pyro's NUTS, in ESS per second.

    python benchmarks/bench_conditioning.py            # full run (about 15 minutes on 2 quiet CPU cores)
    python benchmarks/bench_conditioning.py --quick    # shorter chains (a few minutes)

Prints a markdown report and writes it to ``benchmarks/results/conditioning.md`` (``--out`` to change).

Three models (float32 data, synthetic, of the sizes a user brings):

1. **ill-conditioned regression**: y = Xw + ε with d = 10 correlated features whose scales span 300× (posterior
   condition number about 5,000), N = 5,000, minibatch 100.
2. **partial-pooling regression** (centred): 11 groups × 20 observations (a firms × years panel), group intercepts
   and slopes drawn around population means with latent group scales, a latent noise scale; minibatch 44.
3. **non-centred hierarchical logistic regression**: 6,366 rows in 60 groups, 3 covariates,
   α_g = μ + τ z_g with z_g ~ N(0, 1); minibatch 256.

**Ours**: ``StochasticMCMC(SGHMC(model), num_chains=4)`` with every default (warm-up chooses the step size and
friction, corrects the gradient noise, learns the metric; the control variate "auto" chooses). **NUTS**:
``pyro.infer.NUTS`` (its defaults: diagonal mass adaptation, no JIT), full batch, one chain (Pyro runs more chains
in processes, which this 2-core machine cannot run side by side). Both: 1,000 warm-up steps then 1,000 draws per
chain (``--quick``: 300 and 300). ESS: Pyro's estimator over all chains, the smallest over every unconstrained
coordinate; r_hat: split-R̂ (with one NUTS chain, the split halves of that chain). ESS per second counts the whole
run (warm-up and setup included).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from harness import ForeignLoad, _code_version, load_average, log, machine, write_report  # benchmarks/ is on sys.path
from pyro.infer import MCMC, NUTS
from pyro.ops.stats import split_gelman_rubin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402
from pyro_scalable.infer.health import HealthWarning, effective_sample_size  # noqa: E402


# ====================================================================================== models
def ill_conditioned():
    g = torch.Generator().manual_seed(0)
    d, n = 10, 5000
    u, _, v = torch.linalg.svd(torch.randn(d, d, generator=g))
    x = torch.randn(n, d, generator=g) @ (u @ torch.diag(torch.logspace(0, -2.5, d)) @ v)
    y = x @ torch.randn(d, generator=g) + torch.randn(n, generator=g)
    precision = x.double().T @ x.double() + torch.eye(d, dtype=torch.float64)
    eig = torch.linalg.eigvalsh(precision)

    def model(x, y, batch=100):
        w = pyro.sample("w", dist.Normal(x.new_zeros(d), 1.0).to_event(1))
        with pyro.plate("data", len(y), subsample_size=batch) as idx:
            pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    return f"ill-conditioned regression (d = 10, condition number {float(eig.max() / eig.min()):,.0f})", model, (x, y)


def partial_pooling():
    g = torch.Generator().manual_seed(1)
    groups, years = 11, 20
    group = torch.arange(groups).repeat_interleave(years)
    x = torch.randn(groups * years, generator=g)
    a = 1.0 + 0.8 * torch.randn(groups, generator=g)
    b = 0.5 + 0.3 * torch.randn(groups, generator=g)
    y = a[group] + b[group] * x + 0.5 * torch.randn(groups * years, generator=g)

    def model(x, group, y, batch=44):
        mu_a = pyro.sample("mu_a", dist.Normal(x.new_zeros(()), 5.0))
        mu_b = pyro.sample("mu_b", dist.Normal(x.new_zeros(()), 5.0))
        tau_a = pyro.sample("tau_a", dist.HalfNormal(x.new_ones(())))
        tau_b = pyro.sample("tau_b", dist.HalfNormal(x.new_ones(())))
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
        with pyro.plate("groups", groups):
            a = pyro.sample("a", dist.Normal(mu_a, tau_a))
            b = pyro.sample("b", dist.Normal(mu_b, tau_b))
        with pyro.plate("data", len(y), subsample_size=batch) as idx:
            pyro.sample("obs", dist.Normal(a[group[idx]] + b[group[idx]] * x[idx], sigma), obs=y[idx])

    return "partial-pooling regression (11 groups × 20, centred)", model, (x, group, y)


def hierarchical_logistic():
    g = torch.Generator().manual_seed(2)
    n, groups, k = 6366, 60, 3
    group = torch.randint(groups, (n,), generator=g)
    x = torch.randn(n, k, generator=g)
    alpha = -0.5 + 0.7 * torch.randn(groups, generator=g)
    y = torch.bernoulli(torch.sigmoid(alpha[group] + x @ torch.tensor([0.8, -0.4, 0.2])), generator=g)

    def model(x, group, y, batch=256):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 5.0))
        tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
        beta = pyro.sample("beta", dist.Normal(x.new_zeros(k), 2.0).to_event(1))
        with pyro.plate("groups", groups):
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
        alpha = mu + tau * z
        with pyro.plate("data", len(y), subsample_size=batch) as idx:
            pyro.sample("obs", dist.Bernoulli(logits=alpha[group[idx]] + x[idx] @ beta), obs=y[idx])

    return "hierarchical logistic regression (6,366 rows, 60 groups, non-centred)", model, (x, group, y)


# ====================================================================================== runs
def unconstrained(model, data, samples: dict[str, torch.Tensor], chains: int) -> torch.Tensor:
    """Draws as (chains, draws, coordinates) in the unconstrained space (log of the positive sites)."""
    trace = pyro.poutine.trace(model).get_trace(*data)
    parts = []
    for name, value in samples.items():
        site = trace.nodes[name]
        transform = torch.distributions.biject_to(site["fn"].support)
        u = transform.inv(value)
        parts.append(u.reshape(chains, u.shape[0] // chains, -1))
    return torch.cat(parts, -1).double()


def diagnose(draws: torch.Tensor) -> tuple[float, float]:
    ess = float(effective_sample_size(draws).min())
    if draws.shape[0] == 1:
        halves = draws.shape[1] // 2
        split = torch.stack([draws[0, :halves], draws[0, halves : 2 * halves]])
        return ess, float(split_gelman_rubin(split).max())
    return ess, float(split_gelman_rubin(draws).max())


def run_ours(model, data, warmup: int, draws: int) -> dict:
    probe = ForeignLoad()
    start = time.perf_counter()
    mcmc = StochasticMCMC(SGHMC(model), num_samples=draws, num_warmup=warmup, num_chains=4, seed=0, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)  # judged here
        mcmc.run(*data)
    seconds = time.perf_counter() - start
    samples = mcmc.get_samples(group_by_chain=True)
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
    ess, r_hat = diagnose(unconstrained(model, data, flat, 4))
    return {
        "seconds": seconds,
        "ess": ess,
        "r_hat": r_hat,
        "foreign": probe.cores(),
        "cv": "off"
        if mcmc.control_variate is None
        else ("at the mode" if mcmc.mode_search is not None else "at warm-up's window means"),
    }


def run_nuts(model, data, warmup: int, draws: int) -> dict:
    def full(*args):
        return model(*args, batch=None)

    pyro.set_rng_seed(0)
    probe = ForeignLoad()
    start = time.perf_counter()
    mcmc = MCMC(NUTS(full), num_samples=draws, warmup_steps=warmup, disable_progbar=True)
    mcmc.run(*data)
    seconds = time.perf_counter() - start
    ess, r_hat = diagnose(unconstrained(full, data, mcmc.get_samples(), 1))
    return {"seconds": seconds, "ess": ess, "r_hat": r_hat, "foreign": probe.cores()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "conditioning.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warmup = draws = 300 if args.quick else 1000
    report = [
        f"# Ill-conditioned and hierarchical posteriors: SGHMC's defaults against Pyro NUTS ({_code_version()}"
        f"{', quick run' if args.quick else ''})",
        "",
        f"Command: `python benchmarks/bench_conditioning.py{' --quick' if args.quick else ''}` "
        f"({warmup} warm-up steps and {draws} draws per chain)",
        "",
        *machine(args.threads),
        "",
        "| model | SGHMC(model), 4 chains: r_hat / min ESS / s | NUTS, 1 chain: r_hat / min ESS / s | "
        "**ESS per second, ours / NUTS** |",
        "|---|---|---|---:|",
    ]
    notes = []
    for build in (ill_conditioned, partial_pooling, hierarchical_logistic):
        name, model, data = build()
        log(name)
        ours = run_ours(model, data, warmup, draws)
        log(f"  ours {ours}")
        nuts = run_nuts(model, data, warmup, draws)
        log(f"  NUTS {nuts}")
        ratio = (ours["ess"] / ours["seconds"]) / (nuts["ess"] / nuts["seconds"])
        cell = "{r_hat:.3f} / {ess:.0f} / {seconds:.0f}"
        report.append(f"| {name} | {cell.format(**ours)} | {cell.format(**nuts)} | **{ratio:.2f}** |")
        notes.append(
            f"- {name}: control variate {ours['cv']} (auto); other processes used "
            f"{ours['foreign'] or 0:.2f} cores during ours, {nuts['foreign'] or 0:.2f} during NUTS."
        )
    report += ["", "Notes (load average at the end: " + load_average() + "):", "", *notes, ""]
    write_report("\n".join(report), args.out)


if __name__ == "__main__":
    main()
