"""Does ``torch.compile`` pay for the SG-MCMC step on a CPU? The gradient of the minibatch log joint, compiled and not.

    python benchmarks/studies/bench_compile.py              # about 3 minutes on 2 CPU cores (most of it compiling)
    python benchmarks/studies/bench_compile.py --quick      # fewer rounds

The step's cost is its gradient (the update is a few element-wise ops; ``docs/benchmarks.md``, the profile). This
times, on logistic regression (N = 10⁶, d = 100, B = 1,000, float32) and on the Bayesian MLP 100-300-200-1 (90,701
weights, N = 10⁵, B = 1,000), one minibatch's value and gradient by ``torch.autograd.grad`` of

* **ours**: the Pyro model through the bridge (``ModelBridge.log_posterior``: what every kernel calls);
* **ours, compiled**: the same function under ``torch.compile`` (inductor, the default backend);
* **hand-written**: the same log density in plain torch, and that **compiled**.

Each is called on the same 8 fixed minibatches, interleaved, median of ``--rounds`` rounds of 16 calls; the compile
time (the first calls) is reported separately. Prints a markdown table and writes it to
``benchmarks/results/compile.md``.
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
from harness import machine, write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.problems import make_logistic, make_mlp  # noqa: E402
from pyro_scalable.bridge.model import Batch, ModelBridge  # noqa: E402


def gradient_call(fn, latents: dict, batch_args) -> tuple:
    leaves = {name: x.detach().requires_grad_() for name, x in latents.items()}
    value = fn(leaves, *batch_args)
    return torch.autograd.grad(value, list(leaves.values()))


def candidates(problem) -> dict:
    bridge = ModelBridge(problem.model, (problem.x, problem.y))
    plate = next(iter(bridge.plates))
    gen = torch.Generator().manual_seed(0)
    latents = {k: 0.1 * torch.randn(shape, generator=gen) for k, shape in problem.shapes.items()}
    indices = [torch.randperm(problem.num_data, generator=gen)[: problem.batch_size] for _ in range(8)]

    def ours(latents, idx):
        return bridge.log_posterior(latents, Batch({plate: idx}, bridge.args, bridge.kwargs))

    def hand(latents, idx):
        return problem.log_density(latents, problem.x[idx], problem.y[idx])

    compiled_ours = torch.compile(ours, dynamic=False)
    compiled_hand = torch.compile(hand, dynamic=False)
    return (
        latents,
        indices,
        {"ours": ours, "ours, compiled": compiled_ours, "hand-written": hand, "hand-written, compiled": compiled_hand},
    )


def measure(problem, rounds: int) -> list[str]:
    latents, indices, fns = candidates(problem)
    compile_seconds = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        try:
            for idx in indices:
                gradient_call(fn, latents, (idx,))
        except Exception as error:  # noqa: BLE001 — reported in the table, the row left out
            compile_seconds[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        compile_seconds[name] = time.perf_counter() - start
    working = {name: fn for name, fn in fns.items() if not isinstance(compile_seconds[name], str)}
    times = {name: [] for name in working}
    for _ in range(rounds):
        for name, fn in working.items():
            start = time.perf_counter()
            for _ in range(2):
                for idx in indices:
                    gradient_call(fn, latents, (idx,))
            times[name].append((time.perf_counter() - start) / 16 * 1e3)
    reference = torch.cat([g.reshape(-1) for g in gradient_call(fns["ours"], latents, (indices[0],))])
    rows = []
    base = statistics.median(times["ours"])
    for name in fns:
        if name not in working:
            rows.append(f"| {problem.label} | {name} | – | {compile_seconds[name]} | – |")
            continue
        grads = torch.cat([g.reshape(-1) for g in gradient_call(working[name], latents, (indices[0],))])
        agree = float((grads - reference).abs().max() / reference.abs().max())
        ms = statistics.median(times[name])
        first = compile_seconds[name]
        rows.append(f"| {problem.label} | {name} | {ms:.3f} ({ms / base:.2f}×) | {first:.1f} s | {agree:.1e} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "compile.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch._dynamo")
    rounds = 5 if args.quick else 21
    report = [
        "# `torch.compile` and the SG-MCMC step's gradient (CPU)",
        "",
        f"Command: `python benchmarks/studies/bench_compile.py{' --quick' if args.quick else ''}` (median of {rounds} "
        "rounds of 16 calls; ms per minibatch value + gradient; in brackets, against ours uncompiled)",
        "",
        *machine(args.threads),
        "",
        "| problem | function | ms per gradient | first 8 calls (compiling) | max gradient difference (relative) |",
        "|---|---|---:|---:|---:|",
    ]
    problems = [make_logistic(1_000_000, 100, 1000, seed=0), make_mlp(100_000, 1000, seed=0)]
    for problem in problems:
        report += measure(problem, rounds)
    write_report("\n".join(report) + "\n", args.out)


if __name__ == "__main__":
    main()
