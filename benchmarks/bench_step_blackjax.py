"""One SG-MCMC step: ours (eager and compiled) against a hand-written torch loop and BlackJAX's jitted step.

    python benchmarks/bench_step_blackjax.py               # about 12 minutes on 2 CPU cores (a third compiling)
    python benchmarks/bench_step_blackjax.py --quick       # fewer rounds and dimensions
    python benchmarks/bench_step_blackjax.py --device cuda --quick --dims 100   # on a GPU; JAX there if it has CUDA

Logistic regression, N = 10⁵ (a step gathers B rows; N does not enter its cost), d = 10 and 100, B = 1,000,
float32, SGHMC with the step size and friction given, one gradient per step; one chain and 4 vectorised chains
(each its own minibatches). Candidates:

* **ours, eager**: ``StochasticMCMC(SGHMC(model, step_size, friction, gradient_noise=...))``'s step, the run's own
  chain stepper stepping on the run's own minibatch sampler after a short run (the driver's bookkeeping, about 5
  operations a step to keep the draw, is not in it); ``gradient_noise="ignore"`` (**plain**) and ``"correct"``
  (**noise-corrected**: what warm-up hands to sampling at the defaults; the noise measured on every 4th step);
* **ours, compiled**: the same under ``model_tracing(compile=True)`` (the whole step in one ``torch.compile``
  graph per phase);
* **hand-written**: the loop a torch user writes (autograd, in-place updates), and that step under
  ``torch.compile`` (``torch.func.grad_and_value``, functional update); on a GPU also compiled with
  ``mode="reduce-overhead"`` (CUDA graphs: the step's kernels replayed as one graph) — how near BlackJAX a torch
  step can come;
* **BlackJAX**: ``jax.jit`` of a ``lax.scan`` of ``blackjax.sgld`` steps (the reference: one gradient per step,
  used) and of ``blackjax.sghmc(..., num_integration_steps=1)`` steps, minibatches gathered inside the scan from
  precomputed epoch permutations; 4 chains by ``jax.vmap``. BlackJAX's SGHMC draws a fresh momentum each step
  and moves the position with it *before* the momentum sees the gradient; with one integration step the
  gradient is never used, XLA drops its computation, and the "step" is a normal draw: it is timed for the record,
  not as a reference.

Interleaved rounds of a block of steps each; the median over rounds of the time per step. Compile seconds (the
first block of a compiled candidate, less its steps at the steady rate) are reported separately. Writes
``benchmarks/results/step_blackjax.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_sgmcmc as bench  # noqa: E402  (benchmarks/ is on sys.path when a script runs)
from harness import machine, write_report  # noqa: E402

from pyro_scalable import model_tracing  # noqa: E402
from pyro_scalable.bridge import Batch  # noqa: E402
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402
from pyro_scalable.infer.sgmcmc import phases  # noqa: E402

N, B, STEP_SIZE, FRICTION = 100_000, 1000, 1e-4, 10.0


# ------------------------------------------------------------------ ours
class Ours:
    """Our step: a short run, then its stepper stepped in blocks on its own sampler."""

    def __init__(self, problem, chains: int, noise: str, compiled: bool):
        self.compiled = compiled
        kernel = SGHMC(problem.model, step_size=STEP_SIZE, friction=FRICTION, gradient_noise=noise)
        mcmc = StochasticMCMC(kernel, num_samples=4, num_warmup=4, num_chains=chains, seed=0, progress_bar=False)
        captured = {}
        original = phases.step

        def spy(run, state, t):
            captured["state"] = state
            return original(run, state, t)

        phases.step = spy
        try:
            mcmc.run(problem.x, problem.y)
        finally:
            phases.step = original
        self.state, self.t = captured["state"], 8

    def __call__(self, steps: int) -> float:
        state, stepper = self.state, self.state.stepper
        args, kwargs = state.bridge.args, state.bridge.kwargs
        with model_tracing(compile=self.compiled):
            start = time.perf_counter()
            for _ in range(steps):
                info = stepper.step(Batch(next(state.sampler), args, kwargs), self.t, state.estimators.calibrated)
                self.t += 1
            elapsed = bench.elapsed(start)
        assert not bool(info.diverging.any())
        return elapsed

    def check(self) -> str:
        compiled = self.state.stepper.compiled
        if self.compiled and (compiled is None or compiled.refused or not compiled.steps):
            return f"not compiled: {None if compiled is None else compiled.refused}"
        return ""


def make_ours(problem, chains, noise, compiled):
    if compiled:  # dynamo recompiles a function at most 8 times per process: each run here its own start
        torch._dynamo.reset()
    with model_tracing(compile=compiled):  # the stepper is built under the switch
        return Ours(problem, chains, noise, compiled)


# ------------------------------------------------------------------ hand-written torch
class Hand:
    """The hand-written SGHMC loop (``bench_sgmcmc.run_hand_written``'s), eager or as one compiled step."""

    def __init__(self, problem, chains: int, compiled: bool, graphs: bool = False):
        self.problem, self.chains, self.graphs = problem, chains, graphs
        gen = torch.Generator().manual_seed(0)
        d = problem.shapes["w"][0]
        self.w = (torch.rand(chains, d, generator=gen) * 4 - 2).to(bench.DEVICE)
        self.m = torch.zeros_like(self.w)
        self.streams = [bench.epoch_batches(problem.num_data, B, gen) for _ in range(chains)]
        self.decay, self.scale = 1.0 - STEP_SIZE * FRICTION, math.sqrt(2.0 * FRICTION * STEP_SIZE)
        density = torch.func.vmap(problem.log_density)

        def step(w, m, idx):
            grads = torch.func.grad(lambda w: density({"w": w}, problem.x[idx], problem.y[idx]).sum())(w)
            m = self.decay * m + STEP_SIZE * grads + self.scale * torch.randn_like(w)
            return w + STEP_SIZE * m, m

        if graphs:  # CUDA graphs: the step's kernels replayed as one graph, no launch per kernel
            self.step = torch.compile(step, dynamic=False, mode="reduce-overhead")
        else:
            self.step = torch.compile(step, dynamic=False) if compiled else None
        self.w1, self.m1 = self.w[0].clone().requires_grad_(), self.m[0].clone()  # one chain, eager
        self.w.requires_grad_(chains > 1 and not compiled)

    def __call__(self, steps: int) -> float:
        x, y, problem = self.problem.x, self.problem.y, self.problem
        start = time.perf_counter()
        if self.step is not None:
            w, m = self.w, self.m
            for _ in range(steps):
                idx = torch.stack([next(s) for s in self.streams])
                if self.graphs:  # the graph's outputs are overwritten by its next replay: the state is copied out
                    torch.compiler.cudagraph_mark_step_begin()
                    w, m = (t.clone() for t in self.step(w, m, idx))
                else:
                    w, m = self.step(w, m, idx)
            self.w, self.m = w, m
            return bench.elapsed(start)
        w, m = (self.w, self.m) if self.chains > 1 else (self.w1, self.m1)
        for _ in range(steps):
            if self.chains > 1:
                idx = torch.stack([next(s) for s in self.streams])
                value = torch.func.vmap(problem.log_density)({"w": w}, x[idx], y[idx]).sum()
            else:
                idx = next(self.streams[0])
                value = problem.log_density({"w": w}, x[idx], y[idx])
            (grad,) = torch.autograd.grad(value, (w,))
            with torch.no_grad():
                m.mul_(self.decay).add_(grad, alpha=STEP_SIZE).add_(
                    torch.randn(w.shape, device=w.device), alpha=self.scale
                )
                w.add_(m, alpha=STEP_SIZE)
        return bench.elapsed(start)

    def check(self) -> str:
        return ""


# ------------------------------------------------------------------ BlackJAX
class BlackJAX:
    """``jax.jit`` of a ``lax.scan`` over ``block`` steps of BlackJAX's SGHMC (one integration step) or SGLD."""

    def __init__(self, problem, chains: int, kind: str, block: int):
        import blackjax
        import jax
        import jax.numpy as jnp

        self.jax, self.block = jax, block
        x, y = jnp.asarray(problem.x.cpu().numpy()), jnp.asarray(problem.y.cpu().numpy())  # on JAX's default device
        d = x.shape[1]

        def logprior(w):
            return -0.5 * jnp.sum(w**2)

        def loglik(w, example):
            xi, yi = example
            logit = xi @ w
            return yi * logit - jnp.logaddexp(0.0, logit)

        grad = blackjax.sgmcmc.gradients.grad_estimator(logprior, loglik, problem.num_data)
        if kind == "sghmc":
            algo = blackjax.sghmc(grad, num_integration_steps=1, alpha=FRICTION)
        else:
            algo = blackjax.sgld(grad)

        def one(key, w, idx):
            return algo.step(key, w, (x[idx], y[idx]), STEP_SIZE)

        step = one if chains == 1 else jax.vmap(one)

        def scan(key, w, idx):
            def body(w, inputs):
                k, i = inputs
                keys = k if chains == 1 else jax.random.split(k, chains)
                return step(keys, w, i), None

            keys = jax.random.split(key, idx.shape[0])
            return jax.lax.scan(body, w, (keys, idx))[0]

        self.run = jax.jit(scan)
        gen = torch.Generator().manual_seed(0)
        epochs = -(-block * B // problem.num_data)  # epochs of shuffled indices, one after another

        def stream():
            return torch.cat([torch.randperm(problem.num_data, generator=gen) for _ in range(epochs)])[: block * B]

        perms = torch.stack([stream() for _ in range(chains)])
        perms = perms.reshape(chains, block, B).transpose(0, 1)
        self.idx = jnp.asarray((perms[:, 0] if chains == 1 else perms).numpy())
        self.w = jnp.zeros(d) if chains == 1 else jnp.zeros((chains, d))
        self.key = jax.random.PRNGKey(0)

    def __call__(self, steps: int) -> float:
        assert steps == self.block, "BlackJAX's scan is compiled for one block length"
        self.key, key = self.jax.random.split(self.key)
        start = time.perf_counter()
        self.w = self.run(key, self.w, self.idx)
        self.w.block_until_ready()
        return time.perf_counter() - start

    def check(self) -> str:
        return "" if bool(self.jax.numpy.isfinite(self.w).all()) else "diverged"


# ------------------------------------------------------------------ the table
def measure(d: int, chains: int, rounds: int, block: int) -> list[str]:
    problem = bench.make_logistic(N, d, B, seed=0)
    candidates = {
        "ours, eager, plain": lambda: make_ours(problem, chains, "ignore", False),
        "ours, eager, noise-corrected": lambda: make_ours(problem, chains, "correct", False),
        "ours, compiled, plain": lambda: make_ours(problem, chains, "ignore", True),
        "ours, compiled, noise-corrected": lambda: make_ours(problem, chains, "correct", True),
        "hand-written torch, eager": lambda: Hand(problem, chains, False),
        "hand-written torch, compiled": lambda: Hand(problem, chains, True),
        **(
            {"hand-written torch, compiled, CUDA graphs": lambda: Hand(problem, chains, True, graphs=True)}
            if bench.DEVICE.type == "cuda"
            else {}
        ),
        "BlackJAX SGHMC, jitted scan": lambda: BlackJAX(problem, chains, "sghmc", block),
        "BlackJAX SGLD, jitted scan": lambda: BlackJAX(problem, chains, "sgld", block),
    }
    built, first, times = {}, {}, {name: [] for name in candidates}
    for name, make in candidates.items():
        start = time.perf_counter()
        built[name] = make()
        first[name] = time.perf_counter() - start + built[name](block)  # setup + the first block (compiling)
    for _ in range(rounds):
        for name, run in built.items():
            times[name].append(run(block) / block * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    hand, jax_sgld = ms["hand-written torch, eager"], ms["BlackJAX SGLD, jitted scan"]
    rows = []
    for name in candidates:
        compile_s = max(first[name] - block * ms[name] / 1e3, 0.0)
        note = built[name].check()
        rows.append(
            f"| d = {d}, {chains} chain{'s' if chains > 1 else ''} | {name} | {ms[name]:.3f} | {ms[name] / hand:.2f}× "
            f"| {ms[name] / jax_sgld:.2f}× | {compile_s:.1f} | {note} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 4], help="the chain counts to measure")
    parser.add_argument("--dims", type=int, nargs="+", default=[10, 100], help="the dimensions to measure")
    parser.add_argument("--device", default="cpu", help="where our steps and the hand-written ones run ('cuda')")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_blackjax.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench.DEVICE = torch.device(args.device)
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    # JAX runs on its default device: the GPU where jax has CUDA (then it must not take the GPU's memory up front)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    where = "the CPU" if bench.DEVICE.type == "cpu" else torch.cuda.get_device_name(bench.DEVICE)
    jax_where = f"JAX on {jax.devices()[0].device_kind} ({jax.devices()[0].platform})"
    warnings.filterwarnings("ignore", message="the chains are not healthy")
    warnings.filterwarnings("ignore", message="in .* of the coordinates")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch._dynamo")
    rounds, block = (3, 200) if args.quick else (5, 300)
    configs = [c for c in [(10, 1), (100, 1), (10, 4), (100, 4)] if c[1] in args.chains and c[0] in args.dims]
    load_before = os.getloadavg()
    rows = []
    for d, chains in configs:
        rows += measure(d, chains, rounds, block)
        print(rows[-8:], flush=True)
    load_after = os.getloadavg()
    report = [
        f"# One SG-MCMC step against BlackJAX's jitted step ({'CPU' if bench.DEVICE.type == 'cpu' else 'GPU'})",
        "",
        f"Command: `python {' '.join(['benchmarks/bench_step_blackjax.py', *sys.argv[1:]])}`; logistic regression, "
        f"N = {N:,}, B = {B:,}, float32, SGHMC ε = {STEP_SIZE}, α = {FRICTION}; median over {rounds} interleaved "
        f"rounds of {block} steps; torch on {where}, `torch.set_num_threads({args.threads})`; {jax_where}, XLA's "
        f"CPU single-threaded. Load average before {load_before[0]:.2f}, after {load_after[0]:.2f}.",
        "",
        *machine(args.threads),
        "",
        "| problem | step | ms per step | / hand-written eager | / BlackJAX SGLD | compile (s) | note |",
        "|---|---|---:|---:|---:|---:|---|",
        *rows,
    ]
    write_report("\n".join(report) + "\n", args.out)


if __name__ == "__main__":
    main()
