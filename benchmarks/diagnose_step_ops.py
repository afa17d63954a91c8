"""Where one SGHMC step's host time goes on problem (a): ATen operations per step, ours against the hand-written loop.

    python benchmarks/diagnose_step_ops.py        # about 40 seconds; writes benchmarks/results/step_ops.md

bench_sgmcmc.py part 1 times a step of (a), logistic regression; at its size (N = 10⁶, d = 100, B = 1,000) the step
is a few dozen small operations, each costing the dispatcher's few microseconds on a CPU. This counts them with
``torch.profiler`` on the same model at N = 10⁴, B = 10, where arithmetic is negligible: the count per step is the
difference between a 400-step and a 200-step run (setup cancels), for ours (one chain, the step size given) and for
the hand-written loop, and for ours with ``gradient_noise="correct"`` (the noise measured on every 4th step, so its
counts are averages over steps). Operations called inside others (``aten::to`` inside a copy, say) are counted too,
alike for all.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path

import bench_sgmcmc as bench  # benchmarks/ is on sys.path when a script runs
import torch
from harness import machine, write_report
from torch.profiler import ProfilerActivity, profile


def ops_per_step(run) -> dict[str, float]:
    counts = []
    for steps in (200, 400):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(steps)
        counts.append(collections.Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}))
    return {k: (counts[1][k] - counts[0][k]) / 200 for k in counts[1] if counts[1][k] > counts[0][k]}


def main() -> None:
    # the step size is given and the gradient noise ignored, as in part 1: the runs' health warnings say so
    warnings.filterwarnings("ignore", message="the chains are not healthy")
    warnings.filterwarnings("ignore", message="in .* of the coordinates of the kept steps")
    torch.set_num_threads(1)
    problem = bench.make_logistic(10**4, 100, 10, seed=0)
    bench.run_ours(problem, 40, 0)  # the recording, kernels loaded
    runs = {
        "ours": lambda n: bench.run_ours(problem, n, 1),
        # the default once warm-up has chosen the step: the noise measured on every 4th step and corrected
        "ours, noise-corrected": lambda n: bench.run_ours(problem, n, 1, gradient_noise="correct"),
        "hand-written": lambda n: bench.run_hand_written(problem, n, 1),
    }
    counts = {label: ops_per_step(run) for label, run in runs.items()}
    report = [
        "# ATen operations per SGHMC step on the logistic regression: ours against the hand-written loop",
        "",
        "Command: `python benchmarks/diagnose_step_ops.py`; N = 10⁴, d = 100, B = 10, one chain, the step size "
        "given; operations per step = (400-step run - 200-step run) / 200, the driver's bookkeeping included; counts "
        "do not depend on the machine's load.",
        "",
        *machine(1),
        "",
        "ATen operations per step: " + ", ".join(f"{k} {sum(v.values()):.1f}" for k, v in counts.items()),
        "",
        "| operation | " + " | ".join(counts) + " |",
        "|---|" + "---:|" * len(counts),
    ]
    ours = counts["ours, noise-corrected"]
    for name in sorted(set().union(*counts.values()), key=lambda k: -ours.get(k, 0.0)):
        report.append(f"| `{name}` | " + " | ".join(f"{c.get(name, 0.0):.2f}" for c in counts.values()) + " |")
    write_report("\n".join(report) + "\n", Path(__file__).parent / "results" / "step_ops.md")


if __name__ == "__main__":
    main()
