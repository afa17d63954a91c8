"""What warm-up's curvature measurement costs on the two hierarchies, and what measuring it less often would save.

Warm-up measures the curvature (one power iteration, a Hessian-vector product, about two gradients' work) on every
step after the first's eight (``adaptation.power_iterations``). Here the same runs as ``bench_conditioning.py``'s
(SGHMC's defaults, 4 vectorised chains, 1,000 warm-up steps and 1,000 draws) are made with the measurement on every
step (the engine's schedule) and, for comparison only, on every ``k``-th step after the first: the schedule is
swapped in this process, the engine is not changed. NUTS is not rerun (its figures are in ``conditioning.md``).

    python benchmarks/diagnose_warmup_cost.py            # every 1, 4 and 8 on both hierarchies: about 4 minutes

Writes ``benchmarks/results/warmup_cost.md``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from harness import log, machine, write_report  # benchmarks/ is on sys.path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import bench_conditioning as conditioning  # noqa: E402

from pyro_scalable.infer.health import HealthWarning  # noqa: E402
from pyro_scalable.infer.sgmcmc import adaptation  # noqa: E402

ENGINE_SCHEDULE = adaptation.power_iterations


def every(k: int):
    """The first step's iterations, then one on every ``k``-th step (``k = 1``: the engine's own schedule)."""
    if k == 1:
        return ENGINE_SCHEDULE
    return lambda step: ENGINE_SCHEDULE(0) if step == 0 else int(step % k == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", default="1,4,8", help="the schedules to compare (default 1,4,8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "warmup_cost.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", HealthWarning)  # judged here
    schedules = [int(k) for k in args.every.split(",")]
    lines = [
        "# Warm-up's curvature measurement: its cost on the hierarchies",
        "",
        f"Command: `python benchmarks/diagnose_warmup_cost.py --every {args.every}`",
        "",
        *machine(args.threads),
        "",
        "SGHMC's defaults, 4 vectorised chains, 1,000 warm-up steps and 1,000 draws (as `bench_conditioning.py`); "
        "the curvature measured on every k-th warm-up step after the first (k = 1: the engine).",
        "",
        "| model | k | seconds | min ESS | r_hat | ESS per second | other processes (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for build in (conditioning.partial_pooling, conditioning.hierarchical_logistic):
        name, model, data = build()
        for k in schedules:
            adaptation.power_iterations = every(k)
            try:
                run = conditioning.run_ours(model, data, 1000, 1000)
            finally:
                adaptation.power_iterations = ENGINE_SCHEDULE
            log(name, k, run)
            lines.append(
                f"| {name} | {k} | {run['seconds']:.1f} | {run['ess']:.0f} | {run['r_hat']:.3f} | "
                f"{run['ess'] / run['seconds']:.1f} | {run['foreign'] or 0:.2f} |"
            )
    write_report("\n".join(lines + [""]), args.out)


if __name__ == "__main__":
    main()
