"""Sample-then-optimise's posterior as the next prior: the shrunk covariance against the diagonal.

    python benchmarks/studies/bench_as_prior.py     # about a minute on 2 CPU cores

A linear-Gaussian model with d = 200 correlated features of scales spanning 30x (N = 2,000 per episode; the second
episode's inputs are shifted), in float64. For K = 32 ... 2,048 exact draws of episode 1's posterior, the prior the
engine's ``as_prior`` builds from them (``pyro_scalable.infer.gaussian_prior.shrinkage.gaussian_from_draws``, the
same function) is compared with the exact posterior (KL divergence), and episode 2's ``full`` Laplace under that
prior with the exact posterior on both episodes (the worst coordinate's mean error in posterior sds, and the worst
sd ratio). Exact draws separate the estimator's error from the solver's; ``--engine`` adds the end-to-end run of
``SampleThenOptimize`` with its defaults, whose draws carry its solver's error too. ``--convergence`` runs the
engine on episode 1 alone (K = 64) with the minibatch epochs only (``refine_passes=0``: 20, 50, 200 epochs), and
with the conjugate-gradient refinement (budgets 100 and 200): the worst coordinate of the mean in posterior sds
against the exact one, the engine's diagnostics, and whether it warned.

    python benchmarks/studies/bench_as_prior.py --convergence     # about 30 s

Prints a markdown table (accuracy, not speed: one run each, no timing).
"""

from __future__ import annotations

import argparse
import time
import warnings

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import AutoLinearizedLaplace, SampleThenOptimize
from pyro_scalable.infer.gaussian_prior import GaussianPriorModel, site_specs
from pyro_scalable.infer.gaussian_prior.shrinkage import gaussian_from_draws

D, N, SIGMA = 200, 2000, 0.5
torch.set_default_dtype(torch.float64)


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(D, D, generator=g) / D**0.5 + torch.eye(D)
    scales = torch.logspace(-1, 0.5, D)

    def episode(shift: float):
        x = torch.randn(N, D, generator=g) @ mix * scales + shift
        return x, x @ torch.linspace(-1, 1, D) + SIGMA * torch.randn(N, generator=g)

    return episode(0.0), episode(0.5), g


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(D), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=200) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, SIGMA), obs=None if y is None else y[idx])


def exact(*episodes):
    precision, rhs = torch.eye(D), torch.zeros(D)
    for x, y in episodes:
        precision, rhs = precision + x.T @ x / SIGMA**2, rhs + x.T @ y / SIGMA**2
    covariance = torch.linalg.inv(precision)
    return covariance @ rhs, covariance


def kl(mean0, cov0, mean1, cov1) -> float:
    """KL(N0 || N1)."""
    inverse = torch.linalg.inv(cov1)
    diff = mean1 - mean0
    trace = torch.trace(inverse @ cov0)
    return float(0.5 * (trace + diff @ inverse @ diff - D + torch.logdet(cov1) - torch.logdet(cov0)))


def second_episode(prior: GaussianPriorModel, second, start, both_mean, both_cov) -> tuple[float, float]:
    posterior = AutoLinearizedLaplace(prior).laplace_approximation(
        *second, structure="full", map_latents={"w": start}, check_map=False
    )
    sds = both_cov.diagonal().sqrt()
    error = float(((posterior.mean - both_mean) / sds).abs().max())
    ratio = posterior.precision.inverse_diagonal().sqrt() / sds
    return error, float((ratio.log().abs()).max().exp())


def convergence() -> None:
    first, _, _ = problem()
    mean1, cov1 = exact(first)
    sds = cov1.diagonal().sqrt()
    rows = [
        "| epochs | refine_passes | CG passes | worst mean error (sd) | `error_in_sds` (median) | CG estimate, draws / "
        "mean | warned | seconds |",
        "|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for epochs, refine in ((20, 0), (50, 0), (200, 0), (20, 100), (20, 200)):
        engine = SampleThenOptimize(
            model, num_samples=64, num_epochs=epochs, refine_passes=refine, seed=0, progress_bar=False
        )
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.run(*first)
        seconds = time.perf_counter() - start
        error = float(((engine.mean_unconstrained - mean1) / sds).abs().max())
        stats = engine.sample_stats
        cg = f"{float(stats['cg_error'].max()):.3f} / {engine.mean_error:.3f}" if refine else "–"
        warned = "yes" if any("not converged" in str(w.message) for w in caught) else "no"
        passes = engine.cg_passes[0] if refine else 0
        rows.append(
            f"| {epochs} | {refine} | {passes} | {error:.3f} | {float(stats['error_in_sds'].median()):.3f} | {cg} "
            f"| {warned} | {seconds:.1f} |"
        )
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", action="store_true", help="also the end-to-end SampleThenOptimize run")
    parser.add_argument("--convergence", action="store_true", help="only the engine's convergence on episode 1")
    options = parser.parse_args()
    if options.convergence:
        convergence()
        return
    warnings.filterwarnings("ignore", message="the samples have not converged")
    first, second, g = problem()
    mean1, cov1 = exact(first)
    both_mean, both_cov = exact(first, second)
    bridge_specs = None
    rows = [
        "| draws | K | prior | ρ | KL(exact ‖ prior), nats | episode 2: worst mean error (sd) | worst sd ratio |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    root = torch.linalg.cholesky(cov1)
    for k in (32, 128, 512, 2048):
        offsets = torch.randn(k, D, generator=g) @ root.T
        for correlations in ("shrinkage", "diagonal"):
            if bridge_specs is None:
                engine = SampleThenOptimize(model, num_samples=2, num_epochs=1, progress_bar=False)
                engine.run(*first)
                bridge_specs = site_specs(engine.bridge, ["w"])
            joint = gaussian_from_draws(bridge_specs, mean1, offsets, correlations)
            prior = GaussianPriorModel(model, joint)
            error, ratio = second_episode(prior, second, mean1, both_mean, both_cov)
            divergence = kl(mean1, cov1, joint.mean, joint.covariance_matrix())
            rows.append(
                f"| exact | {k} | {correlations} | {joint.shrinkage:.3f} | {divergence:.1f} | {error:.2f} | "
                f"{ratio:.2f} |"
            )
    if options.engine:
        for k in (32, 128, 512):
            engine = SampleThenOptimize(model, num_samples=k, seed=0, progress_bar=False)
            engine.run(*first)
            for correlations in ("shrinkage", "diagonal"):
                prior = engine.as_prior(correlations=correlations)
                joint = prior.joint
                error, ratio = second_episode(prior, second, mean1, both_mean, both_cov)
                divergence = kl(mean1, cov1, joint.mean, joint.covariance_matrix())
                rows.append(
                    f"| SampleThenOptimize (defaults) | {k} | {correlations} | {joint.shrinkage:.3f} | "
                    f"{divergence:.1f} | {error:.2f} | {ratio:.2f} |"
                )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
