"""Does ``torch.compile`` pay for the SG-MCMC step on a CPU? The gradient of the minibatch log joint, compiled and not;
with ``--loop``, the whole sampling loop: eager, one step per compiled graph, and compiled blocks of K steps.

    python benchmarks/studies/bench_compile.py              # about 3 minutes on 2 CPU cores (most of it compiling)
    python benchmarks/studies/bench_compile.py --quick      # fewer rounds
    python benchmarks/studies/bench_compile.py --loop       # the sampling loop (minutes: each compiled run compiles)

``--loop`` times ``StochasticMCMC`` runs of SGHMC (step size 1e-4, friction 10, the gradient noise ignored, one chain,
no warm-up) on logistic regression (N = 10⁶, d = 10, B = 1,000, float32) under ``model_tracing``: eager,
``compile=True, block_steps=1`` (one step per graph, its noise drawn inside it) and ``block_steps=K``
(:mod:`pyro_scalable.infer.sgmcmc.compiled_blocks`), beside the hand-written SGHMC loop (eager, and one compiled step)
of ``benchmarks/engines.py``. Time per step: the median over the run's stretches of at least 512 steps after its
first 1,024 (the driver's step and block calls timed); "fixed" is a run's wall time less its steps at that rate
(compiling, the bridge's recording, the first steps), in the first round and (median) in the later ones, where
inductor's on-disk cache holds the graphs: run it with ``TORCHINDUCTOR_CACHE_DIR`` a new folder for a cold first
round. The blocks' draws are compared with the eager run's (same seed).
The table replaces the loop section of ``benchmarks/results/compile.md`` (the gradient table above it stays).

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
import os
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


LOOP_HEADING = "## The compiled sampling loop"
SETTLE, STRETCH = 1024, 512  # steps left out at a run's start; the shortest stretch timed


def timed_run(problem, compile: bool, block: int, steps: int) -> tuple[list[float], float, torch.Tensor, str]:
    """One run's per-step times (ms, per stretch), its wall time, its draws, and why blocks were refused ("")."""
    from pyro_scalable import model_tracing
    from pyro_scalable.infer import SGHMC, StochasticMCMC
    from pyro_scalable.infer.sgmcmc import compiled_blocks, phases

    marks, made = [], []
    step, block_fn, init = phases.step, phases._block, compiled_blocks.CompiledBlocks.__init__

    def timed_step(run, state, t):
        info = step(run, state, t)
        marks.append((t + 1, time.perf_counter()))
        return info

    def timed_block(run, state, t, length, blocks):
        info = block_fn(run, state, t, length, blocks)
        marks.append((t + length, time.perf_counter()))
        return info

    def keep(self, size):
        init(self, size)
        made.append(self)

    kernel = SGHMC(problem.model, step_size=1e-4, friction=10.0, gradient_noise="ignore")
    mcmc = StochasticMCMC(kernel, num_samples=steps, seed=0, progress_bar=False)
    phases.step, phases._block, compiled_blocks.CompiledBlocks.__init__ = timed_step, timed_block, keep
    try:
        with model_tracing(compile=compile, block_steps=block), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the health checks of a short run at a small step size
            start = time.perf_counter()
            mcmc.run(problem.x, problem.y)
            wall = time.perf_counter() - start
    finally:
        phases.step, phases._block, compiled_blocks.CompiledBlocks.__init__ = step, block_fn, init
    stretches, (t0, s0) = [], min((m for m in marks if m[0] >= SETTLE), key=lambda m: m[0])
    for t, s in marks:
        if t - t0 >= STRETCH:
            stretches.append((s - s0) / (t - t0) * 1e3)
            t0, s0 = t, s
    refused = next((b.refused for b in made if b.refused), "")
    if compile and block > 1 and not any(b.compiled_blocks for b in made):
        refused = refused or "no block ran compiled"
    return stretches, wall, mcmc.get_samples()["w"], refused


def hand_run(problem, compiled: bool, steps: int) -> tuple[list[float], float]:
    """The hand-written SGHMC loop of ``benchmarks/engines.py``: ms per step per stretch after the first, wall time."""
    from benchmarks.engines import _HandStepper

    start = time.perf_counter()
    stepper = _HandStepper(problem, compiled)
    chunks = [stepper(STRETCH) / STRETCH * 1e3 for _ in range(steps // STRETCH)]
    return chunks[SETTLE // STRETCH :], time.perf_counter() - start


def loop_study(args) -> str:
    """The sampling loop's table (markdown), rounds interleaved."""
    from benchmarks.problems import make_logistic as make

    problem = make(1_000_000, 10, 1000, seed=0)
    candidates = {"ours, eager": (False, 1), "ours, compiled one step per graph": (True, 1)}
    candidates.update({f"ours, compiled blocks of {k}": (True, k) for k in args.blocks})
    names = [*candidates, "hand-written, eager", "hand-written, one compiled step"]
    times = {name: [] for name in names}
    walls = {name: [] for name in names}
    notes, draws = {}, {}
    for _ in range(args.rounds):
        for name, (compile, block) in candidates.items():
            stretches, wall, samples, refused = timed_run(problem, compile, block, args.steps)
            times[name] += stretches
            walls[name].append(wall)
            draws.setdefault(name, samples)
            notes[name] = refused or notes.get(name, "")
            print(f"{name}: {statistics.median(stretches):.3f} ms per step, {wall:.1f} s", flush=True)
        for name, compiled in (("hand-written, eager", False), ("hand-written, one compiled step", True)):
            stretches, wall = hand_run(problem, compiled, args.steps)
            times[name] += stretches
            walls[name].append(wall)
            print(f"{name}: {statistics.median(stretches):.3f} ms per step, {wall:.1f} s", flush=True)
    base = statistics.median(times["ours, eager"])
    rows = []
    for name in names:
        ms = statistics.median(times[name])
        first, later = (wall - args.steps * ms / 1e3 for wall in (walls[name][0], statistics.median(walls[name][1:])))
        agree = "–"
        if name in draws and name != "ours, eager":
            difference = float((draws[name] - draws["ours, eager"]).abs().max())
            same = name.startswith("ours, compiled blocks")  # the eager run's noise; one step per graph draws its own
            agree = f"{difference:.1e}" + ("" if same else " (other noise)")
        note = f" refused: {notes[name]}" if notes.get(name) else ""
        cells = [name, f"{ms:.3f}", f"{ms / base:.2f}×", str(len(times[name])), f"{first:.1f} s", f"{later:.1f} s"]
        rows.append("| " + " | ".join([*cells, agree + note]) + " |")
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    command = ("TORCHINDUCTOR_CACHE_DIR=<a new folder> " if cache else "") + "nice -n 19 env OMP_NUM_THREADS=1 "
    command += "python benchmarks/studies/bench_compile.py --loop"
    blocks = " ".join(map(str, args.blocks))
    extra = f" --threads {args.threads} --rounds {args.rounds} --steps {args.steps} --blocks {blocks}"
    return "\n".join(
        [
            LOOP_HEADING,
            "",
            f"Command: `{command}{extra}` (SGHMC, step 1e-4, friction 10, the noise "
            f"ignored; one chain; logistic regression N = 10⁶, d = 10, B = 1,000, float32; {args.steps} steps per run, "
            f"{args.rounds} rounds; ms per step: the median over stretches of ≥ {STRETCH} steps after the first "
            f"{SETTLE}; fixed: a run's wall time less its steps at that rate, in the first round (inductor's cache "
            "empty) and the later ones (median; the cache holds the graphs))",
            "",
            *machine(args.threads),
            "",
            "| loop | ms per step | / ours eager | stretches | fixed, first round | fixed, later rounds | max draw "
            "difference from the eager run (same seed) |",
            "|---|---:|---:|---:|---:|---:|---|",
            *rows,
            "",
            "Inductor's cache: "
            + ("empty at the first round." if cache else "the default folder (earlier runs may have filled it).")
            + " A fixed cost below 0 is a run whose first steps went faster than its median stretch (the spread of a "
            "loaded machine).",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "compile.md")
    parser.add_argument("--loop", action="store_true", help="the sampling loop's study (module docstring)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[32], help="--loop: the block lengths K")
    parser.add_argument("--rounds", type=int, default=3, help="--loop: rounds of every candidate")
    parser.add_argument("--steps", type=int, default=8192, help="--loop: steps per run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch._dynamo")
    if args.loop:
        table = loop_study(args)
        kept = args.out.read_text().split(LOOP_HEADING)[0].rstrip("\n") if args.out.exists() else ""
        write_report(f"{kept}\n\n{table}" if kept else table, args.out)
        return
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
