"""How often an exact sampler's largest rank-normalised r_hat exceeds 1.01 at the README's lengths (4 x 1,000 draws).

The zoo's criterion asks every coordinate's r_hat to be at most 1.01. r_hat is itself a Monte-Carlo estimate: for K
coordinates of chains that have mixed, its largest value grows with K and shrinks with the effective sample size.
This study draws exact stationary AR(1) chains (autocorrelation ``phi``, so an ESS of ``(1 - phi) / (1 + phi)`` per
draw), ``4 x 1,000`` draws of ``K`` independent coordinates, and counts the replications whose largest ArviZ
rank-normalised r_hat exceeds 1.01: the rate at which the criterion fails a sampler with nothing wrong.

    OMP_NUM_THREADS=1 python benchmarks/studies/rhat_at_readme_lengths.py --ess 0.35 0.5 1.0 --coordinates 25 103 304

(25, 103 and 304: the zoo's panels, mixed logits and varying-intercept models.)
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np


def exceed_rate(ess_per_draw: float, coordinates: int, replications: int, rng: np.random.Generator) -> tuple:
    """The share of replications whose largest r_hat exceeds 1.01, and the median largest r_hat."""
    import arviz as az

    phi = (1 - ess_per_draw) / (1 + ess_per_draw)
    chains, draws = 4, 1000
    largest = []
    for _ in range(replications):
        x = np.empty((chains, draws, coordinates))
        x[:, 0] = rng.standard_normal((chains, coordinates))
        noise = rng.standard_normal((chains, draws, coordinates)) * np.sqrt(1 - phi**2)
        for t in range(1, draws):
            x[:, t] = phi * x[:, t - 1] + noise[:, t]
        r_hat = az.rhat(az.convert_to_dataset({"x": x}), method="rank")["x"].values
        largest.append(r_hat.max())
    largest = np.asarray(largest)
    return float(np.mean(largest > 1.01)), float(np.median(largest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ess", type=float, nargs="+", default=[0.35, 0.5, 1.0], help="ESS per draw")
    parser.add_argument("--coordinates", type=int, nargs="+", default=[25, 103, 304])
    parser.add_argument("--replications", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing", category=FutureWarning)  # 0.23, at import
    rng = np.random.default_rng(options.seed)
    print("| ESS per draw | coordinates | P(largest r_hat > 1.01) | median largest r_hat |")
    print("|---:|---:|---:|---:|")
    for ess in options.ess:
        for k in options.coordinates:
            rate, median = exceed_rate(ess, k, options.replications, rng)
            print(f"| {ess:.2f} | {k} | {rate:.3f} | {median:.4f} |", flush=True)


if __name__ == "__main__":
    main()
