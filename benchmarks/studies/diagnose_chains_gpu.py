"""Where 16 vectorised SGHMC chains spend a step on a GPU: a torch.profiler table of one run.

    python benchmarks/studies/diagnose_chains_gpu.py            # needs CUDA; about 30 seconds

The ``sgmcmc-step`` suite's ``ours-16-chains`` measures the throughput; this shows the operations behind it for
logistic regression (N = 10⁶, d = 100, B = 1,000): 1 chain and 16 vectorised chains, 200 steps each after a warm-up run,
the profiler's operator table sorted by self CPU time (launch-bound steps show up there) and the number of
host-device synchronisations (``cudaStreamSynchronize``, ``aten::item``, device-to-host copies) per step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.problems, .engines

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import problems
from benchmarks.engines import run_ours

STEPS = 200


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device here: this diagnosis is for a GPU")
    problems.DEVICE = torch.device("cuda")
    problem = problems.make_logistic(10**6, 100, 1000, seed=0)
    for chains in (1, 16):
        run_ours(problem, 40, 0, num_chains=chains)  # warm-up: the recording, kernels loaded
        seconds, _ = run_ours(problem, STEPS, 1, num_chains=chains)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_ours(problem, STEPS, 1, num_chains=chains)
        events = prof.key_averages()
        syncs = {
            e.key: e.count / STEPS
            for e in events
            if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense")
            or "DtoH" in e.key
        }
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel")) / STEPS
        print(f"\n## {chains} chain(s): {seconds / STEPS * 1e3:.2f} ms per step (run with setup, unprofiled)")
        print(f"kernel launches per step {launches:.0f}; synchronisations per step {syncs}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


if __name__ == "__main__":
    main()
