"""Sample-then-optimise on a GPU: the step against a forward + backward, and the device memory per sample.

    python benchmarks/studies/bench_sample_then_optimize_gpu.py                       # CUDA (minutes on an H100)
    python benchmarks/studies/bench_sample_then_optimize_gpu.py --device cpu --quick  # smoke run of the same code
    python benchmarks/studies/bench_sample_then_optimize_gpu.py --device cpu --cells cnn:64 --k 5 --cnn-batch 16 \
        --cnn-n 64 --out benchmarks/results/sample_then_optimize_cnn_cpu.md          # the CNN's memory on the CPU

Issue 17's cost and memory targets on a lent GPU, float32, the network linearised at a random draw (no MAP search,
``refine_passes=0``: this measures the minibatch step):

* the tanh MLP 100-h-h-1 of the ``sto-cost`` suite (N = 10,000, B = 500, Normal likelihood) at
  d = 10⁴ … 10⁷;
* a convolutional network of ResNet-18's size (the CIFAR variant: 3×3 stem, four stages of two basic blocks,
  64-128-256-512 channels, a 10-way linear head; 11.2M weights; no batch norm, whose running statistics a
  linearised posterior would hold fixed anyway), on N = 2,048 random 32×32 images with 10 classes (CIFAR-10's shape; the
  GGN pass costs one backward per class), B = 128.

Each cell runs the engine twice, with K = 1 and K = ``--k`` samples. Reported: the median time of the engine's
optimisation step (``core.step``, the device synchronised before and after), a hand-written forward + backward of
the same network on the same B points (``torch.autograd.grad`` of the minibatch loss), their ratio, and the peak
memory of ``run`` above what the model, data and linearisation point hold before it (on a GPU
``torch.cuda.max_memory_allocated``; on the CPU the resident memory's high-water mark), for the whole run and for
the optimisation phase alone (``Problem.solve``; the run's peak can be the curvature pass before it, the same at
any K). Memory per sample is (optimisation peak at K − at 1) / (K − 1), in floats of d.
The report goes to ``benchmarks/results/sample_then_optimize_gpu.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import (  # noqa: E402
    log,
    machine,
    peak_mb,
    release_free_memory,
    reset_peak,
    rss_mb,
    write_report,
)
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

RESULTS = Path(__file__).resolve().parents[1] / "results" / "sample_then_optimize_gpu.md"
INPUTS, NOISE = 100, 0.1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ====================================================================================== networks
class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(INPUTS, width), nn.Linear(width, width), nn.Linear(width, 1)])

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = torch.tanh(x)
        return x.squeeze(-1)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.skip = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        out = self.conv2(torch.relu(self.conv1(x)))
        return torch.relu(out + (x if self.skip is None else self.skip(x)))


class ResNet18(nn.Module):
    """ResNet-18's CIFAR layout without batch norm; ``width`` scales the channels (64 for the real size)."""

    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        blocks, cin = [], width
        for stage, mult in enumerate((1, 2, 4, 8)):
            for k in range(2):
                blocks.append(Block(cin, width * mult, 2 if stage > 0 and k == 0 else 1))
                cin = width * mult
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        h = self.blocks(torch.relu(self.stem(x)))
        return self.head(h.mean((-2, -1)))


def bayesian(net: nn.Module, device: torch.device):
    """The network as a ``PyroModule`` with N(0, 1/fan_in) priors on every weight, and its weights as a dict."""
    weights = {name: p.detach().to(device).clone() for name, p in net.named_parameters()}
    to_pyro_module_(net)
    zero = torch.zeros((), device=device)
    for name, value in weights.items():
        *path, attr = name.split(".")
        module = net.get_submodule(".".join(path))
        fan_in = value[0].numel() if value.dim() > 1 else 1
        prior = dist.Normal(zero, zero + fan_in**-0.5).expand(value.shape).to_event(value.dim())
        setattr(module, attr, PyroSample(prior))
    return net.to(device), weights


class Model(PyroModule):
    """``net(x[idx])`` under a subsampled plate: Normal(f, NOISE) for the MLP, Categorical for the CNN."""

    def __init__(self, net, batch: int, categorical: bool):
        super().__init__()
        self.net, self.batch, self.categorical = net, batch, categorical

    def forward(self, x, y=None):
        data = pyro.plate("data", x.shape[0], subsample_size=self.batch)
        f = self.net(x[data.indices])
        with data as idx:
            obs = None if y is None else y[idx]
            if self.categorical:
                return pyro.sample("y", dist.Categorical(logits=f), obs=obs)
            return pyro.sample("y", dist.Normal(f, NOISE), obs=obs)


def problem(kind: str, size: int, n: int, batch: int, device: torch.device):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if kind == "mlp":
        net = MLP(size)
        x = torch.randn(n, INPUTS, generator=gen)
        with torch.no_grad():
            y = net(x) + NOISE * torch.randn(n, generator=gen)
    else:
        net = ResNet18(size)
        x = torch.randn(n, 3, 32, 32, generator=gen)
        y = torch.randint(10, (n,), generator=gen)
    model_net, weights = bayesian(net, device)
    return Model(model_net, batch, kind == "cnn"), weights, x.to(device), y.to(device)


def hand_step_seconds(model: Model, weights, x, y, device, reps: int = 20) -> float:
    """Median time of a forward + backward of the minibatch loss w.r.t. every weight (the plain network)."""
    kind_cnn = model.categorical
    plain = ResNet18(model.net.stem.out_channels) if kind_cnn else MLP(weights["layers.0.weight"].shape[0])
    plain = plain.to(device)
    params = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    gen = torch.Generator().manual_seed(1)
    times = []
    for rep in range(reps + 3):
        idx = torch.randperm(x.shape[0], generator=gen)[: model.batch].to(device)
        sync(device)
        start = time.perf_counter()
        f = torch.func.functional_call(plain, params, (x[idx],))
        if kind_cnn:
            loss = torch.nn.functional.cross_entropy(f, y[idx], reduction="sum")
        else:
            loss = 0.5 * ((f - y[idx]) / NOISE).square().sum()
        grads = torch.autograd.grad(loss, list(params.values()))
        sync(device)
        if rep >= 3:
            times.append(time.perf_counter() - start)
        del grads
    return statistics.median(times)


# ====================================================================================== memory
# On a GPU: the bytes allocated (torch.cuda.max_memory_allocated). On the CPU: the resident memory's high-water mark
# (VmHWM, reset through /proc/self/clear_refs, after glibc's free blocks are given back), in bytes.
def memory_now(device: torch.device) -> int:
    sync(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    release_free_memory()
    return int(rss_mb() * 2**20)


def memory_peak(device: torch.device) -> int:
    sync(device)
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else int(peak_mb() * 2**20)


def reset_memory_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        release_free_memory()
        reset_peak()


# ====================================================================================== one cell
class StepTimer:
    """The engine's ``core.step`` wrapped: device-synchronised wall time of each call (the code unchanged); and the
    optimisation phase (``Problem.solve``) wrapped for its own peak of device memory."""

    def __init__(self, device: torch.device):
        from pyro_scalable.infer.linearized.sampling import core
        from pyro_scalable.infer.linearized.sampling.problem import Problem

        self.reset()
        original = core.step
        solve = Problem.solve

        def measured_solve(*args, **kwargs):
            self.before_peak = max(self.before_peak, memory_peak(device))  # the curvature pass's, before this phase
            reset_memory_peak(device)
            out = solve(*args, **kwargs)
            self.solve_peak = max(self.solve_peak, memory_peak(device))
            return out

        Problem.solve = measured_solve

        def timed(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            sync(device)
            self.times.append(time.perf_counter() - start)
            return out

        core.step = timed

    def reset(self) -> None:
        """Forget the last run's step times and memory peaks."""
        self.times: list[float] = []
        self.solve_peak = self.before_peak = 0


def run_cell(kind: str, size: int, k: int, cfg: dict, device: torch.device, timer: StepTimer) -> dict:
    from pyro_scalable.infer import SampleThenOptimize

    n, batch = cfg[f"{kind}_n"], cfg[f"{kind}_batch"]
    model, weights, x, y = problem(kind, size, n, batch, device)
    d = sum(v.numel() for v in weights.values())
    engine = SampleThenOptimize(
        model,
        num_samples=k,
        num_epochs=cfg["epochs"],
        linearize_at={f"net.{name}": value for name, value in weights.items()},  # the sites' names
        chunk_size=batch,
        refine_passes=0,
        seed=0,
        progress_bar=False,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = memory_now(device)
    reset_memory_peak(device)
    timer.reset()
    start = time.perf_counter()
    engine.run(x, y)
    sync(device)
    seconds = time.perf_counter() - start
    row = {"kind": kind, "size": size, "d": d, "k": k, "seconds": seconds, "steps": len(timer.times)}
    row["step"] = statistics.median(timer.times[1:] or timer.times)  # the first step builds the solver's state
    row["peak_bytes"] = max(timer.before_peak, timer.solve_peak, memory_peak(device)) - base
    row["solve_peak_bytes"] = timer.solve_peak - base
    row["samples_finite"] = all(bool(torch.isfinite(v).all()) for v in engine.get_samples().values())
    del engine
    row["hand"] = hand_step_seconds(model, weights, x, y, device)
    del model, weights, x, y
    return row


CONFIGS = {
    "full": {
        "cells": [("mlp", 60), ("mlp", 270), ("mlp", 950), ("mlp", 3110), ("cnn", 64)],
        "k": 8,
        "epochs": 1,
        "mlp_n": 10_000,
        "mlp_batch": 500,
        "cnn_n": 2_048,
        "cnn_batch": 128,
    },
    "quick": {
        "cells": [("mlp", 60), ("mlp", 270), ("cnn", 8)],
        "k": 4,
        "epochs": 1,
        "mlp_n": 2_000,
        "mlp_batch": 500,
        "cnn_n": 256,
        "cnn_batch": 64,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="default cuda; cpu for a smoke run of the same code")
    parser.add_argument("--quick", action="store_true", help="small cells (a smoke run)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--cells", default=None, help="e.g. 'cnn:64' or 'mlp:950,mlp:3110' (default: the config's)")
    parser.add_argument("--k", type=int, default=None, help="the larger number of samples (default 8, quick 4)")
    parser.add_argument("--cnn-batch", type=int, default=None, help="minibatch and chunk of the CNN (default 128)")
    parser.add_argument("--cnn-n", type=int, default=None, help="images for the CNN (default 2048)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: this benchmark is for a GPU (--device cpu --quick runs its code on the CPU)")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="the samples have not converged")  # one epoch, on purpose
    warnings.filterwarnings("ignore", message="the linearisation point is not a MAP")  # a random draw, on purpose
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.cells:
        cfg["cells"] = [(kind, int(size)) for kind, size in (cell.split(":") for cell in args.cells.split(","))]
    cfg["k"] = args.k or cfg["k"]
    cfg["cnn_batch"] = args.cnn_batch or cfg["cnn_batch"]
    cfg["cnn_n"] = args.cnn_n or cfg["cnn_n"]
    timer = StepTimer(device)
    run_cell("mlp", 8, 2, {**cfg, "mlp_n": 1000}, device, timer)  # warm-up: kernels loaded, the code path run once
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # on the CPU with every block of 128 KB or more mapped on its own, the resident memory is the memory in use
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    live = f"MALLOC_MMAP_THRESHOLD_={threshold} " if threshold and device.type == "cpu" else ""
    report = [
        f"# Sample-then-optimise on {name}: step cost and memory per sample",
        "",
        f"Command: `{' '.join([live + 'python benchmarks/studies/bench_sample_then_optimize_gpu.py', *sys.argv[1:]])}`",
        "",
        *machine(args.threads, f"device {name}, torch {torch.__version__}"),
        "",
        f"float32; linearised at a random draw; {cfg['epochs']} epoch; K = 1 and K = {cfg['k']}. Step: median "
        "time of the engine's `core.step`; hand: a forward + backward of the minibatch loss w.r.t. every weight; "
        "memory per sample: (optimisation-phase peak at K − at 1) / (K − 1) above the model, data and weights, in "
        "floats of d; the run's peak (any phase) beside it.",
        "",
        "| network | d | B | step, K = 1 (ms) | step, K (ms) | hand fwd+bwd (ms) | step K / hand | step K / hand / K "
        "| optimisation peak K = 1 (MB) | optimisation peak K (MB) | **memory per sample (× d floats)** "
        "| run peak K (MB) | run at K (s) | finite |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = []
    for kind, size in cfg["cells"]:
        try:
            one = run_cell(kind, size, 1, cfg, device, timer)
            many = run_cell(kind, size, cfg["k"], cfg, device, timer)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # reported in the table, not hidden
            log(f"{kind} {size}: {type(error).__name__}: {str(error).splitlines()[0]}")
            report.append(
                f"| {kind} {size} | – | – | failed: {type(error).__name__}: {str(error).splitlines()[0][:120]} |"
            )
            continue
        log(f"{one}\n{many}")
        rows.append((one, many))
        label = f"MLP 100-{size}-{size}-1" if kind == "mlp" else f"ResNet-18 layout, width {size}"
        batch = cfg[f"{kind}_batch"]
        per = (many["solve_peak_bytes"] - one["solve_peak_bytes"]) / (cfg["k"] - 1) / (4 * one["d"])
        memory = (
            f"{one['solve_peak_bytes'] / 2**20:,.0f}",
            f"{many['solve_peak_bytes'] / 2**20:,.0f}",
            f"**{per:.2f}**",
            f"{many['peak_bytes'] / 2**20:,.0f}",
        )
        report.append(
            f"| {label} | {one['d']:,} | {batch} | {one['step'] * 1e3:.2f} | {many['step'] * 1e3:.2f} "
            f"| {many['hand'] * 1e3:.2f} | {many['step'] / many['hand']:.2f}× "
            f"| {many['step'] / many['hand'] / cfg['k']:.2f}× | {' | '.join(memory)} | {many['seconds']:.1f} "
            f"| {one['samples_finite'] and many['samples_finite']} |"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report) + "\n")  # after every cell: a run stopped early keeps its rows
    report += [
        "",
        "Targets (issue 17): memory ≤ 4·d floats per sample beyond the model; one step ≤ 3× a forward + backward at "
        "d = 10⁶ (the issue states it for the CPU; here per step of K samples and per sample).",
        "",
    ]
    write_report("\n".join(report) + "\n", args.out)
    if not all(a["samples_finite"] and b["samples_finite"] for a, b in rows):
        sys.exit("some draws were not finite")


if __name__ == "__main__":
    main()
