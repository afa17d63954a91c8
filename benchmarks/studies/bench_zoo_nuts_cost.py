"""What full-batch NUTS costs on the zoo's models: full-data gradients per effective draw.

``python benchmarks/studies/bench_zoo_nuts_cost.py`` runs Pyro's NUTS (one chain, 500 warm-up steps and 1,000 draws,
float64) on the full data of a few models of ``tests/model_zoo.py`` and counts the model's evaluations (one per
leapfrog step's gradient, warm-up included) per effective draw (the least ESS over the sites). The HealthWarning's
advice to use NUTS (``pyro_scalable.infer.health.NUTS_PASSES_PER_ESS``) is the most this measured."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import MCMC, NUTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyro_scalable.bridge.plates import FullDataModel  # noqa: E402
from tests.model_zoo import zoo_model  # noqa: E402

MODELS = ["logistic", "linear-gamma-precision", "hierarchical-non-centred", "hierarchical-centred"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    options = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | model evaluations | least ESS | evaluations per effective draw | seconds |")
    print("|---|---:|---:|---:|---:|")
    for name in options.models:
        model, args = zoo_model(name, torch.float64)
        full, calls = FullDataModel(model), [0]

        def counted(*a, full=full, calls=calls, **k):
            calls[0] += 1
            return full(*a, **k)

        pyro.set_rng_seed(0)
        mcmc = MCMC(NUTS(counted), num_samples=1000, warmup_steps=500, disable_progbar=True)
        start = time.perf_counter()
        mcmc.run(*args)
        seconds = time.perf_counter() - start
        ess = min(float(d["n_eff"].min()) for d in mcmc.diagnostics().values() if isinstance(d, dict) and "n_eff" in d)
        print(f"| {name} | {calls[0]} | {ess:.0f} | {calls[0] / ess:.1f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
