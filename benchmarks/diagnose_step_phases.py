"""Where the hierarchies' runs spend their time: every step of a run timed by what it does, for one package.

The runs of ``bench_conditioning.py`` (SGHMC's defaults, 4 vectorised chains, 1,000 warm-up steps and 1,000 draws)
on the partial-pooling and the non-centred hierarchical logistic regressions, with each chain step timed and
grouped by its kind: warm-up or sampling, burn-in or calibrated, with or without a curvature measurement, with or
without a gradient-noise measurement. ``--package`` runs another copy of ``pyro_scalable`` (e.g. an earlier commit,
``git archive <commit> pyro_scalable | tar -x -C .base``) with this script, so that before and after are timed by
the same code on the same machine:

    python benchmarks/diagnose_step_phases.py --out benchmarks/results/step_phases.md                 # this tree
    python benchmarks/diagnose_step_phases.py --package .base --commit <commit> \
        --out benchmarks/results/step_phases_before.md

About a minute each on 2 CPU cores. NUTS is not run (its figures are in ``conditioning.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from harness import add_package_arguments, log, machine, use_package, write_report  # benchmarks/ is on sys.path

HERE = Path(__file__).resolve().parent


def kind(program, phase) -> str:
    """A step's kind in words, from its program (warm-up or sampling) and its phase."""
    words = ["warm-up" if type(program).__name__ == "Adaptation" else "sampling"]
    if getattr(phase, "burn_in", False):
        words.append("burn-in")
    if getattr(phase, "power_iterations", 0):
        words.append(f"curvature ×{phase.power_iterations}")
    measures = getattr(phase, "noise_every", 1)  # a package before the noise schedule measured on every step
    words.append("noise measured" if measures else "plain gradient")
    return ", ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_package_arguments(parser)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "step_phases.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    package, option, origin = use_package(args)
    from pyro_scalable.infer import SGHMC, StochasticMCMC
    from pyro_scalable.infer.health import HealthWarning
    from pyro_scalable.infer.sgmcmc import chains

    sys.path.insert(1, str(HERE.parent))
    import bench_conditioning as conditioning  # its own import of pyro_scalable finds the one above

    warnings.simplefilter("ignore", HealthWarning)  # judged in bench_conditioning.py
    times: dict[str, list[float]] = defaultdict(list)
    step = chains.ChainStepper.step

    def timed(self, batch, step_index):
        phase = self.program.phase(step_index) if hasattr(self.program, "phase") else None
        name = kind(self.program, phase)
        start = time.perf_counter()
        info = step(self, batch, step_index)
        times[name].append(time.perf_counter() - start)
        return info

    chains.ChainStepper.step = timed
    lines = [
        f"# The hierarchies' runs, step by step (package {args.commit or 'of this checkout'})",
        "",
        f"Command: `python benchmarks/diagnose_step_phases.py{option}` (package from `{package}`{origin}; the "
        "stamp below is the script's)",
        "",
        *machine(args.threads),
        "",
    ]
    for build in (conditioning.partial_pooling, conditioning.hierarchical_logistic):
        name, model, data = build()
        log(name)
        times.clear()
        start = time.perf_counter()
        mcmc = StochasticMCMC(SGHMC(model), num_samples=1000, num_warmup=1000, num_chains=4, seed=0, progress_bar=False)
        mcmc.run(*data)
        seconds = time.perf_counter() - start
        samples = mcmc.get_samples(group_by_chain=True)
        flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
        ess, r_hat = conditioning.diagnose(conditioning.unconstrained(model, data, flat, 4))
        lines += [
            f"## {name}",
            "",
            f"Whole run {seconds:.1f} s (setup included); min ESS {ess:.0f}, max r_hat {r_hat:.3f}.",
            "",
            "| steps | count | median ms | total s |",
            "|---|---:|---:|---:|",
        ]
        for label, values in times.items():
            lines.append(f"| {label} | {len(values)} | {1000 * statistics.median(values):.2f} | {sum(values):.2f} |")
        lines.append("")
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
