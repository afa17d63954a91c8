"""Benchmark: scaling efficiency of data-parallel SG-MCMC (``distributed="data"``) on 1 and 2 CPU ranks.

    python benchmarks/bench_distributed.py            # about 3 minutes on 2 CPU cores
    python benchmarks/bench_distributed.py --quick    # smoke-sized run

Launches ``torchrun --standalone --nproc_per_node=K`` (gloo) for K = 1 and 2, each rank with one thread, on a
Bayesian MLP 20 -> 50 -> 1 (tanh, 1,101 weights), Gaussian regression, N = 4000 rows, minibatch B = 1000 (split
B/K per rank), 4 vectorised SGLD chains. Two kernels: the plain minibatch gradient (``gradient_noise="ignore"``)
and the per-example noise estimate and correction (``"correct"``, the heavier step). Time per step is
``(T(K steps) - T(k steps)) / (K - k)`` on rank 0 between barriers, so setup (tracing, initial values) cancels;
median over ``--reps`` repetitions, the two world sizes interleaved. Efficiency = t1 / (2 t2): 1 is perfect
scaling, 0.5 is no gain. The CPU other processes used meanwhile (``/proc/stat`` minus this benchmark's own
processes) is reported next to each row: on a shared machine it, not the code, often sets the figure.
Writes the table to ``benchmarks/results/distributed.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from harness import ForeignLoad  # benchmarks/ is on sys.path when a script runs

RESULTS = Path(__file__).resolve().parent / "results" / "distributed.md"
NUM_DATA, MINIBATCH, DIMS, CHAINS = 4000, 1000, (20, 50), 4


def model(x, y):
    d, h = DIMS
    w1 = pyro.sample("w1", dist.Normal(torch.zeros(d, h), 1.0).to_event(2))
    b1 = pyro.sample("b1", dist.Normal(torch.zeros(h), 1.0).to_event(1))
    w2 = pyro.sample("w2", dist.Normal(torch.zeros(h), 1.0).to_event(1))
    b2 = pyro.sample("b2", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y), subsample_size=MINIBATCH) as idx:
        f = torch.tanh(x[idx] @ w1 + b1) @ w2 + b2
        pyro.sample("obs", dist.Normal(f, 0.5), obs=y[idx])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, DIMS[0], generator=generator)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.5 * torch.randn(NUM_DATA, generator=generator)
    return x, y


def worker(steps: tuple[int, int], reps: int, out: Path) -> None:
    """One rank: for each kernel, time runs of ``steps[0]`` and ``steps[1]`` steps, ``reps`` times."""
    import torch.distributed as dist_

    from pyro_scalable.infer import SGLD, StochasticMCMC

    torch.set_num_threads(1)
    dist_.init_process_group("gloo")
    x, y = data()
    times: dict[str, list[float]] = {}
    for noise in ("ignore", "correct"):
        kernel = SGLD(model, step_size=1e-5, gradient_noise=noise)
        StochasticMCMC(
            kernel, num_samples=steps[0], num_chains=CHAINS, seed=0, progress_bar=False, distributed="data"
        ).run(x, y)  # first calls (vmap, Pyro's tracing caches) are slower
        for _ in range(reps):
            per_run = []
            for num in steps:
                mcmc = StochasticMCMC(
                    kernel, num_samples=num, num_chains=CHAINS, seed=0, progress_bar=False, distributed="data"
                )
                dist_.barrier()
                start = time.perf_counter()
                mcmc.run(x, y)
                dist_.barrier()
                per_run.append(time.perf_counter() - start)
            times.setdefault(noise, []).append((per_run[1] - per_run[0]) / (steps[1] - steps[0]))
    if dist_.get_rank() == 0:
        out.write_text(json.dumps(times))
    dist_.destroy_process_group()


def launch(ranks: int, steps: tuple[int, int], reps: int) -> tuple[dict[str, list[float]], float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            __file__,
            "--worker",
            "--steps",
            f"{steps[0]},{steps[1]}",
            "--reps",
            str(reps),
            "--out",
            str(out),
        ]
        load = ForeignLoad(children=True)
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
        return json.loads(out.read_text()), load.cores()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="launches per world size, interleaved")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", default="10,50", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = tuple(int(s) for s in args.steps.split(","))
    if args.worker:
        worker(steps, args.reps, args.out)
        return
    if args.quick:
        steps, args.rounds, args.reps = (5, 15), 1, 1
    times: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    loads: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for ranks in (1, 2):
            measured, load = launch(ranks, steps, args.reps)
            for kernel, values in measured.items():
                times[ranks].setdefault(kernel, []).extend(values)
            if load is not None:
                loads[ranks].append(load)
            print(f"K={ranks}: {json.dumps(measured)} other processes {load} cores", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"Data-parallel SG-MCMC, {time.strftime('%Y-%m-%d')}, commit `{commit}`, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; MLP {DIMS[0]}-{DIMS[1]}-1, "
        f"N={NUM_DATA}, B={MINIBATCH}, {CHAINS} chains, steps {steps[0]}->{steps[1]}, "
        f"{args.rounds * args.reps} repetitions per row{' (quick)' if args.quick else ''}.",
        "",
        "| gradient | t1 (1 rank) | t2 (2 ranks) | t1 / t2 | efficiency t1 / (2 t2) "
        "| other processes (cores, 1 / 2 ranks) |",
        "|---|---|---|---|---|---|",
    ]
    for kernel, label in (("ignore", "minibatch mean"), ("correct", "per-example + noise correction")):
        t1, t2 = statistics.median(times[1][kernel]), statistics.median(times[2][kernel])
        load = " / ".join(f"{statistics.median(v):.2f}" if v else "n/a" for v in (loads[1], loads[2]))
        ratio = f"{t1 / t2:.2f} | {t1 / (2 * t2):.2f}"
        lines.append(f"| {label} | {1e3 * t1:.1f} ms | {1e3 * t2:.1f} ms | {ratio} | {load} |")
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)


if __name__ == "__main__":
    main()
