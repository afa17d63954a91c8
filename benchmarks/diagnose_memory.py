"""Where sample-then-optimise's memory goes, phase by phase, counted as live memory (d floats per draw).

Part (b) of ``bench_sample_then_optimize.py`` reports the peak resident memory of a whole run with the C library's
default allocator, which keeps freed blocks of a few tens of MB for reuse and so counts them too. Here every block of
128 KB or more is mapped on its own and returned to the system when freed (``MALLOC_MMAP_THRESHOLD_=131072``), so
the resident memory is the memory in use. For each phase of a run: its peak above the resident memory before
``run``, and (for the minibatch steps) the resident memory when a step starts, i.e. the state between steps. Each
figure is the difference between a run with K draws and one with 1, divided by K − 1: what one more draw costs,
in units of d float32s.

    python benchmarks/diagnose_memory.py                  # d = 1e6 (the MLP of part b, h = 950), K = 8: ~4 min
    python benchmarks/diagnose_memory.py --width 280 --k 16

Writes ``benchmarks/results/memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import _code_version, machine, peak_mb, reset_peak, rss_mb, write_report  # noqa: E402

RESULTS = HERE / "results" / "memory.md"
LIVE = {"MALLOC_MMAP_THRESHOLD_": "131072"}
PHASES = {
    "data_pass": "the perturbation pass (one VJP pass, all rows; again after CG)",
    "targets": "regulariser centres (made; rebuilt after CG)",
    "step": "a minibatch step (JVP, VJP, update)",
    "conjugate_gradient": "conjugate-gradient refinement",
    "finish": "final full-data diagnostics",
}


def worker(width: int, k: int, refine: int, batch: int, n: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    import bench_sample_then_optimize as bench

    from pyro_scalable.infer.sample_then_optimize import centres, core, krylov
    from pyro_scalable.infer.sample_then_optimize import engine as engine_module

    model, sizes = bench.mlp_model(width, batch)
    x, y = bench.mlp_data(sizes, n, seed=0)
    latents = bench.mlp_weights(sizes, seed=1)
    engine = bench._sto()(
        model,
        num_samples=k,
        num_epochs=1,
        linearize_at=latents,
        chunk_size=batch,
        refine_passes=refine,
        seed=0,
        progress_bar=False,
    )
    peaks: dict[str, float] = {}
    entries: list[float] = []

    def wrap(owner, name: str) -> None:
        original = getattr(owner, name)

        def measured(*args, **kwargs):
            if name == "step":
                entries.append(rss_mb())
            reset_peak()
            out = original(*args, **kwargs)
            peaks[name] = max(peaks.get(name, 0.0), peak_mb())
            return out

        setattr(owner, name, measured)

    wrap(core, "step")
    wrap(krylov, "conjugate_gradient")
    wrap(engine_module.Problem, "finish")
    wrap(centres, "data_pass")
    wrap(engine_module.Problem, "targets")  # after its pass's own reset: the peak from the pass on
    start = rss_mb()
    began = time.perf_counter()
    engine.run(x, y)
    seconds = time.perf_counter() - began
    return {
        "d": engine.net.layout.num_params,
        "seconds": seconds,
        "peaks": {name: value - start for name, value in peaks.items()},
        "state": max(entries) - start if entries else None,
        "cg_passes": list(engine.cg_passes),
    }


def spawn(width: int, k: int, refine: int, args) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps([width, k, refine, args.batch, args.n, args.threads])]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **LIVE}, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=950, help="hidden width h of the 100-h-h-1 MLP (950: d = 1e6)")
    parser.add_argument("--k", type=int, default=8, help="draws (compared with a run of --k0)")
    parser.add_argument(
        "--k0",
        type=int,
        default=1,
        help="the smaller run's draws (default 1; 8 at d = 1e6 takes the slope between two runs whose rows fill the "
        "JVP/VJP's row groups, whose buffer is then the same in both)",
    )
    parser.add_argument("--batch", type=int, default=500, help="minibatch and chunk size")
    parser.add_argument("--n", type=int, default=10_000, help="data points")
    parser.add_argument("--refine", type=int, default=5, help="refine_passes of the refined run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))), flush=True)
        return
    runs = {(k, refine): spawn(args.width, k, refine, args) for refine in (0, args.refine) for k in (args.k0, args.k)}
    d = runs[(args.k0, 0)]["d"]

    def per_draw(one: float | None, many: float | None) -> str:
        if one is None or many is None:
            return "–"
        return f"{(many - one) * 2**20 / (args.k - args.k0) / (4 * d):.2f}"

    lines = [
        f"# Sample-then-optimise: live memory by phase, width {args.width}, K = {args.k} against {args.k0} "
        f"({_code_version()})",
        "",
        f"Command: `python benchmarks/diagnose_memory.py --width {args.width} --k {args.k}"
        + (f" --k0 {args.k0}" if args.k0 != 1 else "")
        + f" --out {args.out.relative_to(HERE.parent) if args.out.is_relative_to(HERE.parent) else args.out}` "
        f"(`{' '.join(f'{k}={v}' for k, v in LIVE.items())}` in each run's environment: resident memory = memory in "
        "use).",
        "",
        *machine(args.threads),
        "",
        f"Part (b)'s tanh MLP 100-{args.width}-{args.width}-1, d = {d:,}, float32, N = {args.n:,}, B = {args.batch}, "
        f"one epoch, `chunk_size={args.batch}`; the run with `refine_passes={args.refine}` adds the conjugate-gradient "
        f"refinement after the epoch. Each figure: (peak of the phase with K = {args.k} draws − the same with "
        f"{args.k0}) / ({args.k} − {args.k0}), in d "
        "float32s; *state between steps*: the resident memory when a step starts, the same difference.",
        "",
        "| phase | `refine_passes=0` | " + f"`refine_passes={args.refine}` |",
        "|---|---:|---:|",
    ]
    for name, label in PHASES.items():
        cells = [
            per_draw(runs[(args.k0, r)]["peaks"].get(name), runs[(args.k, r)]["peaks"].get(name))
            for r in (0, args.refine)
        ]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    cells = [per_draw(runs[(args.k0, r)]["state"], runs[(args.k, r)]["state"]) for r in (0, args.refine)]
    lines.append(f"| state between steps | {cells[0]} | {cells[1]} |")
    passes = runs[(args.k, args.refine)]["cg_passes"]
    seconds = ", ".join(f"{runs[(k, r)]['seconds']:.0f}" for r in (0, args.refine) for k in (args.k0, args.k))
    lines += [
        "",
        f"CG passes (K = {args.k}): {passes}; run times (s; K = {args.k0}, {args.k}, each setting): {seconds}.",
        "",
    ]
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
