"""The hierarchies under several seeds: warm-up's defaults for SGHMC and BAOAB, for one copy of the package.

The three models of the ``hierarchies`` suite (``benchmarks/problems.py``: an ill-conditioned regression, a
partial-pooling regression and a non-centred hierarchical logistic regression), each run with every default (4
vectorised chains, 1,000 warm-up steps, 1,000 draws) under seeds 0, 1 and 2, for ``SGHMC(model)`` and ``BAOAB(model)``
(``--kernels`` to choose). One seed's ESS and r_hat on a slowly mixing posterior move a lot between seeds; three show
whether a change of the sampler moved them.
``--package`` runs another copy of ``pyro_scalable`` (e.g. an earlier commit,
``git archive <commit> pyro_scalable | tar -x -C .base``), so that before and after run the same script on the same
machine:

    python benchmarks/studies/bench_friction.py --out benchmarks/results/friction.md                       # this tree
    python benchmarks/studies/bench_friction.py --package .base --commit <commit> \
        --out benchmarks/results/friction_before.md
    python benchmarks/studies/bench_friction.py --kernels SGHMC --draws 5000   # longer runs, in about NUTS's time
    python benchmarks/studies/bench_friction.py --kernels SGHMC --draws 10000 --models hierarchical_logistic

About four minutes each on 2 CPU cores. NUTS is not run (its figures are in the ``hierarchies`` suite's records).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness and the bench_* scripts

import argparse
import statistics
import time
import warnings

import torch
from harness import log, machine, write_report

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
SEEDS = (0, 1, 2)


def add_package_arguments(parser) -> None:
    """``--package`` (another copy of ``pyro_scalable``, e.g. an earlier commit's) and ``--commit`` (its commit)."""
    parser.add_argument("--package", type=Path, default=HERE.parent, help="the directory holding pyro_scalable/")
    parser.add_argument("--commit", default="", help="the commit --package was taken from (for the report)")


def use_package(args) -> tuple[Path, str, str]:
    """Import ``pyro_scalable`` from ``args.package`` (before anything else imports it), so that before and after run
    the same script: the folder it came from, the command's ``--package``/``--commit`` options, the report's words."""
    sys.path.insert(0, str(args.package.resolve()))
    import pyro_scalable

    package = Path(pyro_scalable.__file__).resolve().parent.parent
    option = "" if args.package.resolve() == HERE.parent else f" --package {args.package}"
    option += f" --commit {args.commit}" if args.commit else ""
    origin = f", the package at commit {args.commit}" if args.commit else ""
    return package, option, origin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_package_arguments(parser)
    parser.add_argument("--kernels", default="SGHMC,BAOAB")
    parser.add_argument("--draws", type=int, default=1000, help="draws per chain (warm-up: 1,000 steps)")
    parser.add_argument("--models", default="ill_conditioned,partial_pooling,hierarchical_logistic")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "friction.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    package, option, origin = use_package(args)
    from pyro_scalable import infer
    from pyro_scalable.infer import StochasticMCMC
    from pyro_scalable.infer.health import HealthWarning

    sys.path.insert(1, str(HERE.parent))  # the repository root, after the package chosen above
    from benchmarks import metrics
    from benchmarks import problems as conditioning  # the hierarchies suite's models (no pyro_scalable import)

    warnings.simplefilter("ignore", HealthWarning)  # judged here
    for name in ("kernels", "draws", "models"):
        value = getattr(args, name)
        option += f" --{name} {value}" if value != parser.get_default(name) else ""
    lines = [
        f"# The hierarchies under three seeds, warm-up's defaults: {args.kernels.replace(',', ' and ')}, "
        f"{args.draws:,} draws per chain, models {args.models}, package {args.commit or 'of this checkout'}",
        "",
        f"Command: `python benchmarks/studies/bench_friction.py{option}` (package from `{package}`{origin})",
        "",
        *machine(args.threads),
        "",
        f"Every default, 4 vectorised chains, 1,000 warm-up steps and {args.draws:,} draws per chain. Min ESS over "
        "every unconstrained coordinate and max split-r_hat, as in the `hierarchies` suite; uncorrected: the share of "
        "coordinates × kept steps where the gradient noise alone exceeded the noise the sampler should inject "
        "(`sample_stats.uncorrected`; a run warns above 1%); seconds for the whole run.",
        "",
        "| kernel | model | seed 0: ESS / r_hat / uncorrected / s | seed 1 | seed 2 | median ESS / r_hat |",
        "|---|---|---|---|---|---|",
    ]
    for kernel_name in args.kernels.split(","):
        kernel = getattr(infer, kernel_name)
        for build in (getattr(conditioning, model) for model in args.models.split(",")):
            name, model, data = build()
            cells, esses, r_hats = [], [], []
            for seed in SEEDS:
                start = time.perf_counter()
                mcmc = StochasticMCMC(
                    kernel(model), num_samples=args.draws, num_warmup=1000, num_chains=4, seed=seed, progress_bar=False
                )
                mcmc.run(*data)
                seconds = time.perf_counter() - start
                samples = mcmc.get_samples(group_by_chain=True)
                flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
                ess, r_hat = metrics.diagnose(conditioning.unconstrained(model, data, flat, 4))
                # the share of coordinates × kept steps whose gradient noise alone exceeded the wanted noise
                uncorrected = 100 * float(mcmc.sample_stats["uncorrected"].double().mean())
                log(f"{kernel_name} {name} seed {seed}: ESS {ess:.0f} r_hat {r_hat:.3f} {seconds:.1f} s")
                cells.append(f"{ess:.0f} / {r_hat:.3f} / {uncorrected:.2f}% / {seconds:.0f}")
                esses.append(ess)
                r_hats.append(r_hat)
            median = f"**{statistics.median(esses):.0f} / {statistics.median(r_hats):.3f}**"
            lines.append(f"| {kernel_name} | {name.split(' (')[0]} | {' | '.join(cells)} | {median} |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
