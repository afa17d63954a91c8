"""The default kernels on every zoo model over many seeds: how often are the draws accurate? (slow)

``python benchmarks/bench_zoo_seeds.py --out benchmarks/results/zoo_seeds.md`` runs each default kernel (SGHMC,
SGLD, pSGLD: nothing but the model; ``--kernels Multilevel``: ``MultilevelMCMC`` on the models with a group plate) on
each model of ``tests/model_zoo.py`` that has a reference in ``tests/zoo_reference.json``
(``scripts/zoo_reference.py``), with 4 chains, 1,000 warm-up steps and 1,000 draws (the lengths the README uses), for
``--seeds`` seeds, and checks the draws as ``tests/test_zoo_accuracy.py`` does (``tests.model_zoo.accuracy``): every
element's mean within 0.2 reference sd, its sd within 5% plus three Monte-Carlo standard errors, rank-normalised
r_hat at most 1.01. It writes the pass rate per model and kernel, and each failing seed's figures (worst mean error,
sd error, r_hat, least bulk ESS, the run's warnings).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from pyro_scalable.infer import PSGLD, SGHMC, SGLD, MultilevelMCMC, StochasticMCMC  # noqa: E402
from tests.model_zoo import accuracy, reference, zoo_model  # noqa: E402

KERNELS = {"SGHMC": SGHMC, "SGLD": SGLD, "PSGLD": PSGLD, "Multilevel": MultilevelMCMC}


def run_once(model_name: str, kernel: str, seed: int, warmup: int, samples: int, chains: int) -> dict:
    """One default run of ``kernel`` on ``model_name``: its accuracy, time and warnings."""
    model, args = zoo_model(model_name)
    if kernel == "Multilevel":  # an engine, not a kernel of StochasticMCMC
        mcmc = MultilevelMCMC(
            model, num_samples=samples, num_warmup=warmup, num_chains=chains, seed=seed, progress_bar=False
        )
    else:
        mcmc = StochasticMCMC(
            KERNELS[kernel](model),
            num_samples=samples,
            num_warmup=warmup,
            num_chains=chains,
            seed=seed,
            progress_bar=False,
        )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(*args)
    seconds = time.perf_counter() - start
    result = accuracy(mcmc.get_samples(group_by_chain=True), reference()["models"][model_name])
    result.update(
        seconds=seconds,
        restarted=int(mcmc.restarted.sum()) if hasattr(mcmc, "restarted") else 0,
        warmup_divergences=getattr(mcmc, "num_warmup_divergences", 0),
        warnings=[
            str(w.message).split(":")[0][:60] + (" (says NUTS)" if "NUTS" in str(w.message) else "") for w in caught
        ],
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, ..., first-seed + seeds - 1")
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS))
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--chains", type=int, default=4)
    options = parser.parse_args()
    torch.set_num_threads(1)
    models = options.models or list(reference()["models"])
    rows, failures = [], []
    for model_name in models:
        for kernel in options.kernels:
            results = []
            for seed in range(options.first_seed, options.first_seed + options.seeds):
                result = run_once(model_name, kernel, seed, options.warmup, options.samples, options.chains)
                results.append(result)
                if not result["passed"]:
                    failures.append((model_name, kernel, seed, result))
                harness.log(f"{model_name} {kernel} seed {seed}: {result}")
            passed = sum(r["passed"] for r in results)
            rows.append(
                f"| {model_name} | {kernel} | {passed}/{len(results)} "
                f"| {max(r['mean_error'] for r in results):.2f} | {max(r['sd_error'] for r in results):.3f} "
                f"| {max(r['r_hat'] for r in results):.3f} | {min(r['ess'] for r in results):.0f} "
                f"| {sum(r['seconds'] for r in results) / len(results):.1f} |"
            )
    lines = [
        f"# The default kernels on the zoo over {options.seeds} seeds: {', '.join(models)}",
        "",
        f"`python benchmarks/bench_zoo_seeds.py --seeds {options.seeds}` ({options.chains} chains, "
        f"{options.warmup} warm-up steps, {options.samples} draws; pass: every element's mean within 0.2 reference "
        "sd, sd within 5% + 3 MCSE, r_hat <= 1.01).",
        "",
        "| model | kernel | seeds passed | worst mean error (sd) | worst sd error | worst r_hat | least ESS | s/run |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "## Failing seeds",
        "",
        "| model | kernel | seed | mean error | sd error | r_hat | ESS | restarted | warm-up divergences | warnings |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *(
            f"| {m} | {k} | {s} | {r['mean_error']:.2f} | {r['sd_error']:.3f} | {r['r_hat']:.3f} | {r['ess']:.0f} "
            f"| {r['restarted']} | {r['warmup_divergences']} | {'; '.join(r['warnings'])} |"
            for m, k, s, r in failures
        ),
    ]
    text = "\n".join(lines) + "\n"
    if options.out:
        harness.write_report(text, Path(options.out))
    else:
        print(text)


if __name__ == "__main__":
    main()
