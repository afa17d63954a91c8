"""Demo: Bayesian logistic regression on the Wisconsin breast-cancer data with minibatch SGHMC.

Run ``python -m pyro_scalable.demo`` (or ``bash scripts/demo.sh``). The data (569 tumours, 30 features; Street,
Wolberg & Mangasarian 1993, UCI) ships with scikit-learn, so no network is needed. Four SGHMC chains, each
seeing 128 tumours per step, are checked with ArviZ: the summary prints r_hat and ESS, and a trace plot is saved.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

from pyro_scalable._optional import import_optional, missing, missing_extra_message
from pyro_scalable.infer import SGHMC, StochasticMCMC

# Five of the 30 features. They are correlated, so the posterior is badly conditioned along some directions: warm-up
# learns its covariance and the sampler runs in the variables that whiten it (docs: "Warm-up's metric").
FEATURES = ("mean radius", "mean texture", "mean smoothness", "mean symmetry", "mean fractal dimension")
BATCH_SIZE = 128


def load_data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Standardised features, 0/1 labels (1 = malignant) and feature names."""
    datasets = import_optional("sklearn.datasets", "The demo's data set (Wisconsin breast cancer)")
    data = datasets.load_breast_cancer()
    columns = [list(data.feature_names).index(name) for name in FEATURES]
    x = torch.tensor(data.data[:, columns], dtype=dtype)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target == 0, dtype=dtype)
    return x, y, list(FEATURES)


def model(x: torch.Tensor, y: torch.Tensor | None = None, batch_size: int = BATCH_SIZE) -> None:
    """Logistic regression with a Normal prior; the likelihood is estimated from a minibatch by the plate."""
    weight = pyro.sample("weight", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
    bias = pyro.sample("bias", dist.Normal(x.new_zeros(()), 5.0))
    with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        logits = x[idx] @ weight + bias
        pyro.sample("obs", dist.Bernoulli(logits=logits), obs=None if y is None else y[idx])


def main(argv: list[str] | None = None) -> None:
    """Run the demo and print the ArviZ summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the trace plot")
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--num-warmup", type=int, default=1000)
    parser.add_argument("--num-chains", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Checked before the run, not after minutes of sampling: the data set and the trace plot.
    absent = missing(["sklearn", "matplotlib"])
    if absent:
        raise SystemExit(missing_extra_message(absent, "python -m pyro_scalable.demo"))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing", category=FutureWarning)
        import arviz as az

    x, y, names = load_data()
    print(f"Wisconsin breast cancer: {x.shape[0]} tumours, {x.shape[1]} features, {BATCH_SIZE} per minibatch.")
    # nothing to tune: warm-up chooses the step size and friction, corrects the minibatch gradient's noise and learns
    # the posterior's covariance (StochasticMCMC's metric="auto")
    kernel = SGHMC(model)
    mcmc = StochasticMCMC(
        kernel, num_samples=args.num_samples, num_warmup=args.num_warmup, num_chains=args.num_chains, seed=args.seed
    )
    start = time.perf_counter()
    mcmc.run(x, y)
    elapsed = time.perf_counter() - start
    print(f"{args.num_chains} chains x {args.num_warmup + args.num_samples} steps in {elapsed:.1f} s")

    idata = mcmc.to_inference_data(coords={"feature": names}, dims={"weight": ["feature"]})
    summary = az.summary(idata, var_names=["bias", "weight"])
    print(summary.to_string())
    print(f"\nworst r_hat {summary['r_hat'].max():.3f}, smallest bulk ESS {summary['ess_bulk'].min():.0f}")
    print(az.loo(idata))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    # ArviZ 0.x draws traces and densities with plot_trace; 1.x (arviz_plots) with plot_trace_dist
    getattr(az, "plot_trace_dist", az.plot_trace)(idata, var_names=["bias", "weight"])
    path = args.out / "demo_trace.png"
    plt.tight_layout()
    # written next to the target and renamed: an interrupted save never leaves a half-written PNG behind
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.stem}.", suffix=".png", delete=False) as tmp:
        pass
    try:
        plt.savefig(tmp.name, dpi=80, format="png")
        os.replace(tmp.name, path)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    print(f"trace plot saved to {path.resolve()}")


if __name__ == "__main__":
    main()
