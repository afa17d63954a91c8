"""Why the compiled SG-MCMC step costs what it does: dynamo's counters and a profile of the eager and compiled steps.

    python benchmarks/studies/diagnose_compiled_step.py                  # the CPU: a minute
    python benchmarks/studies/diagnose_compiled_step.py --device cuda    # a GPU, where the compiled step was slower
                                                                         # (3.3 ms against 1.4 ms eager on an H200)

The step of the ``step-blackjax`` suite (logistic regression, N = 10⁵, B = 1,000, one chain, noise-corrected SGHMC):
eager, then under ``model_tracing(compile=True, block_steps=1)`` (one step per graph: ``OursStepper`` steps outside
the driver's compiled blocks); for each, the time per step over blocks of 200 steps, then a ``torch.profiler`` table
of 50 steps with the kernel launches and the host-device synchronisations per step; for the
compiled one also dynamo's counters (frames compiled, graph breaks, recompilations, graphs) after the blocks, so that
a step that recompiles, breaks its graph or falls back to eager shows itself.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.problems, .engines
from benchmarks import problems  # noqa: E402
from benchmarks.engines import OursStepper  # noqa: E402

STEPS = 50


def not_compiled(ours: OursStepper) -> str:
    """Why a step meant to be compiled is not ("" when it is, or is not meant to be)."""
    compiled = ours.state.stepper.compiled
    if ours.compiled and (compiled is None or compiled.refused or not compiled.steps):
        return f"not compiled: {None if compiled is None else compiled.refused}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--d", type=int, default=100)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="the chains are not healthy")
    warnings.filterwarnings("ignore", message="in .* of the coordinates")
    torch.set_num_threads(1)
    problems.DEVICE = torch.device(args.device)
    problem = problems.make_logistic(100_000, args.d, problems.STEP_BATCH, seed=0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if problems.DEVICE.type == "cuda" else [])
    from torch._dynamo.utils import counters

    for compiled in (False, True):
        ours = OursStepper(problem, "correct", compiled)
        blocks = [ours(200) / 200 * 1e3 for _ in range(4)]
        print(
            f"\n## {'compiled' if compiled else 'eager'}: ms per step, blocks of 200: {[round(b, 3) for b in blocks]}"
        )
        print(f"check: {not_compiled(ours) or 'ok'}")
        if compiled:
            print("dynamo counters:", {k: dict(v) for k, v in counters.items() if v and k != "unimplemented"})
            print("unsupported (first lines):", [k.splitlines()[0] for k in counters.get("unimplemented", {})][:5])
        with profile(activities=activities) as prof:
            ours(STEPS)
        events = prof.key_averages()
        syncs = {
            e.key: round(e.count / STEPS, 2)
            for e in events
            if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense")
            or "DtoH" in e.key
        }
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel")) / STEPS
        print(f"kernel launches per step {launches:.0f}; synchronisations per step {syncs}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))


if __name__ == "__main__":
    main()
