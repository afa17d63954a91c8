"""The default kernels on every zoo model over many seeds: how often are the draws accurate? (slow)

``python -m benchmarks zoo-seeds --out benchmarks/results/zoo_seeds.md`` runs each default kernel (SGHMC, SGLD,
pSGLD: nothing but the model; ``--kernels Multilevel``: ``MultilevelMCMC`` on the models with a group plate) on each
model of ``tests/model_zoo.py`` that has a reference in ``tests/zoo_reference.json`` (``scripts/zoo_reference.py``),
with 4 chains, 1,000 warm-up steps and 1,000 draws (the lengths the README uses), for ``--seeds`` seeds, and checks
the draws as ``tests/test_zoo_accuracy.py`` does (``tests.model_zoo.accuracy``): every element's mean within 0.2
reference sd, its sd within 5% plus three Monte-Carlo standard errors, rank-normalised r_hat at most 1.01. It writes
the pass rate per model and kernel, and each failing seed's figures (worst mean error, sd error, r_hat, least bulk
ESS, the run's warnings); ``--cells`` also appends one JSON record per run (model, kernel, seed and those figures).
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import harness, records

KERNELS = ("SGHMC", "SGLD", "PSGLD", "Multilevel")


def run_once(model_name: str, kernel: str, seed: int, warmup: int, samples: int, chains: int) -> dict:
    """One default run of ``kernel`` on ``model_name``: its accuracy, time and warnings."""
    from pyro_scalable import infer
    from tests.model_zoo import accuracy, reference, zoo_model

    model, args = zoo_model(model_name)
    lengths = {"num_samples": samples, "num_warmup": warmup, "num_chains": chains, "seed": seed}
    if kernel == "Multilevel":  # an engine, not a kernel of StochasticMCMC
        mcmc = infer.MultilevelMCMC(model, **lengths, progress_bar=False)
    else:
        mcmc = infer.StochasticMCMC(getattr(infer, kernel)(model), **lengths, progress_bar=False)
    with harness.Timed() as timed:
        mcmc.run(*args)
    result = accuracy(mcmc.get_samples(group_by_chain=True), reference()["models"][model_name])
    result.update(
        seconds=timed.seconds,
        restarted=int(mcmc.restarted.sum()) if hasattr(mcmc, "restarted") else 0,
        warmup_divergences=getattr(mcmc, "num_warmup_divergences", 0),
        warnings=[
            str(w.message).split(":")[0][:60] + (" (says NUTS)" if "NUTS" in str(w.message) else "")
            for w in timed.caught
        ],
    )
    return result


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="the Markdown report (else stdout only)")
    parser.add_argument("--cells", type=Path, default=None, help="also append one JSON record per run here")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, ..., first-seed + seeds - 1")
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--chains", type=int, default=4)


def main(options) -> None:
    from tests.model_zoo import reference

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
                if options.cells:
                    cell = {"model": model_name, "kernel": kernel, "seed": seed, "chains": options.chains}
                    cell |= {"warmup": options.warmup, "samples": options.samples, "date": records.now()}
                    records.write(options.cells, {**cell, **result, "code": harness._code_version()})
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
        f"`python -m benchmarks zoo-seeds --seeds {options.seeds}` ({options.chains} chains, "
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
