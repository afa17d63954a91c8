"""Benchmark of the SG-MCMC engines: cost per step and vectorised chains (time to accuracy: the peers suite).

    python benchmarks/bench_sgmcmc.py            # full run (about 15 minutes on 2 quiet CPU cores)
    python benchmarks/bench_sgmcmc.py --quick    # smoke-sized run (about 2 minutes)
    python benchmarks/bench_sgmcmc.py --device cuda --parts 2   # the chains on a GPU (posteriors not needed)

Prints a markdown report and writes it to ``benchmarks/results/sgmcmc.md`` (``--out`` to change). Two parts:

1. **Cost per step**, one chain: ``pyro_scalable.infer.SGHMC`` driven by ``StochasticMCMC`` (on a Pyro model), a
   hand-written ``torch.autograd`` SGHMC loop and ``posteriors.sgmcmc.sghmc`` (both on the same log density written
   in plain torch), all with the same minibatch size, minibatch sampler (a reshuffled permutation per epoch),
   step size, friction and update. A run of ``K`` steps minus a run of ``k`` steps, divided by ``K - k``, is the
   time per step: one-off setup (tracing and checking the model, initial values, the first permutation) cancels,
   and is reported on its own. Problems: (a) logistic regression, N = 10^6, d = 100, B = 1000; (b) a Bayesian
   MLP 100 -> 300 -> 200 -> 1 (tanh, 90,701 weights), Gaussian regression, N = 10^5, B = 1000.
2. **Vectorised chains**: 16 chains with ``chain_method="vectorized"`` (one ``torch.func.vmap``-ed step) against
   16 chains with ``chain_method="sequential"`` and against a hand-written batched loop (one vmapped density and one
   backward for all 16 chains, in-place updates: the compute-bound floor on a CPU), on (a) and (b), in chain-steps
   per second.

Every timing is repeated (``--reps``) with the implementations interleaved. A repetition during which other
processes used 0.3 cores or more (read from ``/proc/stat``) is set aside as long as two clean ones remain, and
``--max-wait S`` makes each repetition wait up to S seconds for a quiet machine. Medians are reported; ratios are
medians of per-repetition ratios. Compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from harness import (  # benchmarks/ is on sys.path when a script runs
    CLEAN_LIMIT,
    _code_version,
    clean_note,
    load_average,
    log,
    machine,
    median_ratio,
    time_per_step,
    warm_up_torch,
    write_report,
)
from pyro.nn import PyroModule, PyroSample
from torch import Tensor, nn

from pyro_scalable import model_tracing
from pyro_scalable.bridge.traced import TRACE_AFTER
from pyro_scalable.infer import SGHMC, StochasticMCMC
from pyro_scalable.infer.health import HealthWarning
from pyro_scalable.infer.sgmcmc.base import NOISE_EVERY

RESULTS = Path(__file__).resolve().parent / "results" / "sgmcmc.md"
MLP_DIMS = (100, 300, 200, 1)
MLP_NOISE = 0.5
TOLERANCE_MEAN = 0.1  # |mean - reference mean| / reference sd, every coordinate
TOLERANCE_SD = 0.1  # |sd / reference sd - 1|, every coordinate
DEVICE = torch.device("cpu")  # --device: where the data, the chains and the hand-written loops run


def elapsed(start: float) -> float:
    """Seconds since ``start``, after the device's queued work has finished."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - start


def noise_generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


# ====================================================================================== problems
@dataclass
class Problem:
    """A data set, its Pyro model (subsampled plate) and the same log density in plain torch."""

    label: str
    x: Tensor
    y: Tensor
    batch_size: int
    shapes: dict[str, tuple[int, ...]]  # latent shapes, for the hand-written loop and posteriors
    log_density: Callable[[dict[str, Tensor], Tensor, Tensor], Tensor]  # prior + N/B * minibatch log-likelihood
    model: Callable  # Pyro model(x, y): pyro.plate(..., subsample_size=B), the engine draws the indices
    loader_model: Callable  # Pyro model(x, y, idx=None): pyro.plate(..., subsample=idx), fed by a loader
    step_size: float
    friction: float

    @property
    def num_data(self) -> int:
        return self.x.shape[0]


def logistic_data(n: int, d: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    true_w = torch.randn(d, generator=gen) * (1.5 / math.sqrt(d))
    y = torch.bernoulli(torch.sigmoid(x @ true_w), generator=gen)
    return x.to(DEVICE), y.to(DEVICE)


def logistic_model(batch_size: int | None) -> Callable:
    """Bayesian logistic regression, w ~ N(0, I); ``batch_size=None`` is the full-data model NUTS runs."""

    def model(x: Tensor, y: Tensor) -> None:
        w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
        if batch_size is None:
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Bernoulli(logits=x @ w), obs=y)
        else:
            with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
                pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    return model


def make_logistic(n: int, d: int, batch_size: int, seed: int) -> Problem:
    x, y = logistic_data(n, d, seed)

    def loader_model(x: Tensor, y: Tensor, idx: Tensor | None = None) -> None:
        w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", n, subsample=idx):
            pyro.sample("obs", dist.Bernoulli(logits=x @ w), obs=y)

    def log_density(latents: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        w = latents["w"]
        log_lik = -F.binary_cross_entropy_with_logits(xb @ w, yb, reduction="sum")
        return -0.5 * w.square().sum() + (n / xb.shape[0]) * log_lik

    return Problem(
        f"(a) logistic regression, N={n:.0e}, d={d}, B={batch_size}",
        x,
        y,
        batch_size,
        {"w": (d,)},
        log_density,
        logistic_model(batch_size),
        loader_model,
        step_size=1e-4,
        friction=100.0,
    )


def mlp_forward(latents: dict[str, Tensor], x: Tensor) -> Tensor:
    h = x
    for i in range(len(MLP_DIMS) - 1):
        h = h @ latents[f"W{i}"] + latents[f"b{i}"]
        if i < len(MLP_DIMS) - 2:
            h = torch.tanh(h)
    return h.squeeze(-1)


def mlp_prior_scales() -> dict[str, float]:
    scales = {}
    for i, fan_in in enumerate(MLP_DIMS[:-1]):
        scales[f"W{i}"], scales[f"b{i}"] = fan_in**-0.5, 1.0
    return scales


def mlp_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i, (fan_in, fan_out) in enumerate(zip(MLP_DIMS[:-1], MLP_DIMS[1:])):
        shapes[f"W{i}"], shapes[f"b{i}"] = (fan_in, fan_out), (fan_out,)
    return shapes


def make_mlp(n: int, batch_size: int, seed: int) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, MLP_DIMS[0], generator=gen)
    scales = mlp_prior_scales()
    teacher = {k: torch.randn(shape, generator=gen) * scales[k] for k, shape in mlp_shapes().items()}
    y = mlp_forward(teacher, x) + MLP_NOISE * torch.randn(n, generator=gen)
    x, y = x.to(DEVICE), y.to(DEVICE)

    def model(x: Tensor, y: Tensor) -> None:
        latents = {}
        for name, shape in mlp_shapes().items():
            prior = dist.Normal(x.new_zeros(()), scales[name])  # on the data's device
            latents[name] = pyro.sample(name, prior.expand(shape).to_event(len(shape)))
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            pyro.sample("obs", dist.Normal(mlp_forward(latents, x[idx]), MLP_NOISE), obs=y[idx])

    def loader_model(x: Tensor, y: Tensor, idx: Tensor | None = None) -> None:
        latents = {}
        for name, shape in mlp_shapes().items():
            prior = dist.Normal(x.new_zeros(()), scales[name])  # on the data's device
            latents[name] = pyro.sample(name, prior.expand(shape).to_event(len(shape)))
        with pyro.plate("data", n, subsample=idx):
            pyro.sample("obs", dist.Normal(mlp_forward(latents, x), MLP_NOISE), obs=y)

    def log_density(latents: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        log_prior = sum(-0.5 * (value / scales[name]).square().sum() for name, value in latents.items())
        log_lik = -0.5 * ((yb - mlp_forward(latents, xb)) / MLP_NOISE).square().sum()
        return log_prior + (n / xb.shape[0]) * log_lik

    num_weights = sum(math.prod(s) for s in mlp_shapes().values())
    return Problem(
        f"(b) Bayesian MLP {'-'.join(map(str, MLP_DIMS))} tanh ({num_weights:,} weights), N={n:.0e}, B={batch_size}",
        x,
        y,
        batch_size,
        mlp_shapes(),
        log_density,
        model,
        loader_model,
        step_size=2e-5,
        friction=1000.0,
    )


class PyroModuleMLP(PyroModule):
    """The same MLP written with ``PyroModule[nn.Linear]`` and ``PyroSample`` priors."""

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size
        self.layers = PyroModule[nn.ModuleList](
            [PyroModule[nn.Linear](a, b) for a, b in zip(MLP_DIMS[:-1], MLP_DIMS[1:])]
        )
        zero = torch.zeros((), device=DEVICE)  # the priors' tensors on the data's device
        for layer, fan_in in zip(self.layers, MLP_DIMS[:-1]):
            layer.weight = PyroSample(dist.Normal(zero, fan_in**-0.5).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(zero, 1.0).expand(layer.bias.shape).to_event(1))

    def forward(self, x: Tensor, y: Tensor) -> None:
        for layer in self.layers:  # draw the weights outside the data plate
            layer.weight, layer.bias  # noqa: B018
        with pyro.plate("data", x.shape[0], subsample_size=self.batch_size) as idx:
            h = x[idx]
            for i, layer in enumerate(self.layers):
                h = layer(h)
                if i < len(self.layers) - 1:
                    h = torch.tanh(h)
            pyro.sample("obs", dist.Normal(h.squeeze(-1), MLP_NOISE), obs=y[idx])


# ====================================================================================== the three SGHMC implementations
def epoch_batches(n: int, batch_size: int, gen: torch.Generator):
    """Shuffled minibatch indices, reshuffling when fewer than B remain (what StochasticMCMC's sampler does)."""
    while True:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size].to(DEVICE)


def uniform_init(problem: Problem, gen: torch.Generator) -> dict[str, Tensor]:
    """Pyro's ``init_to_uniform`` in unconstrained space (every latent here is real): U(-2, 2)."""
    return {name: (torch.rand(shape, generator=gen) * 4.0 - 2.0).to(DEVICE) for name, shape in problem.shapes.items()}


class EpochLoader:
    """A shuffled loader yielding ``(x[idx], y[idx], idx)``: with ``run(..., batches=loader)`` all chains share it."""

    def __init__(self, problem: Problem, seed: int):
        self.problem, self.seed = problem, seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        for idx in epoch_batches(self.problem.num_data, self.problem.batch_size, gen):
            yield self.problem.x[idx], self.problem.y[idx], idx


def run_ours(problem: Problem, num_steps: int, seed: int, loader: bool = False, **options) -> tuple[float, float]:
    """Our SGHMC; ``loader=True`` feeds one minibatch per step to every chain through ``run(..., batches=)``."""
    model = options.pop("model", problem.loader_model if loader else problem.model)
    noise = options.pop("gradient_noise", "ignore")
    kernel = SGHMC(model, step_size=problem.step_size, friction=problem.friction, gradient_noise=noise)
    mcmc = StochasticMCMC(kernel, num_samples=1, num_warmup=num_steps - 1, seed=seed, progress_bar=False, **options)
    start = time.perf_counter()
    mcmc.run(problem.x, problem.y, batches=EpochLoader(problem, seed) if loader else None)
    return elapsed(start), float(mcmc.sample_stats["lp"].float().mean())


def run_untraced(problem: Problem, num_steps: int, seed: int) -> tuple[float, float]:
    """Our SGHMC with the model run through Pyro on every step (the bridge's recorded log density off)."""
    with model_tracing(False):
        return run_ours(problem, num_steps, seed)


def run_compiled(problem: Problem, num_steps: int, seed: int) -> tuple[float, float]:
    """Our SGHMC with the recorded log density compiled by ``torch.compile`` (the opt-in)."""
    with model_tracing(compile=True):
        return run_ours(problem, num_steps, seed)


def run_hand_written(problem: Problem, num_steps: int, seed: int) -> tuple[float, float]:
    """The loop a torch user writes: autograd, in-place updates, nothing else."""
    start = time.perf_counter()
    gen, noise_gen = torch.Generator().manual_seed(seed), noise_generator(seed)
    latents = {name: value.requires_grad_() for name, value in uniform_init(problem, gen).items()}
    momenta = {name: torch.zeros_like(value) for name, value in latents.items()}
    eps, alpha = problem.step_size, problem.friction
    decay, noise_scale = 1.0 - eps * alpha, math.sqrt(2.0 * alpha * eps)
    batches = epoch_batches(problem.num_data, problem.batch_size, gen)
    x, y = problem.x, problem.y
    for _ in range(num_steps):
        idx = next(batches)
        log_post = problem.log_density(latents, x[idx], y[idx])
        grads = torch.autograd.grad(log_post, tuple(latents.values()))
        with torch.no_grad():
            for (name, value), grad in zip(latents.items(), grads):
                noise = torch.randn(value.shape, generator=noise_gen, device=DEVICE)
                momenta[name].mul_(decay).add_(grad, alpha=eps).add_(noise, alpha=noise_scale)
                value.add_(momenta[name], alpha=eps)
    return elapsed(start), float(log_post.detach())


def run_hand_batched(problem: Problem, num_steps: int, seed: int, chains: int) -> tuple[float, float]:
    """The compute-bound floor for many chains on a CPU: one batched (``torch.func.vmap``) log density, one backward
    for all chains, in-place updates; each chain its own epoch of minibatches, as ours."""
    start = time.perf_counter()
    gen, noise_gen = torch.Generator().manual_seed(seed), noise_generator(seed)
    inits = [uniform_init(problem, gen) for _ in range(chains)]
    latents = {name: torch.stack([i[name] for i in inits]).requires_grad_() for name in problem.shapes}
    momenta = {name: torch.zeros_like(value) for name, value in latents.items()}
    eps, alpha = problem.step_size, problem.friction
    decay, noise_scale = 1.0 - eps * alpha, math.sqrt(2.0 * alpha * eps)
    streams = [epoch_batches(problem.num_data, problem.batch_size, gen) for _ in range(chains)]
    density = torch.func.vmap(problem.log_density)
    x, y = problem.x, problem.y
    for _ in range(num_steps):
        idx = torch.stack([next(stream) for stream in streams])
        log_post = density(latents, x[idx], y[idx])
        grads = torch.autograd.grad(log_post.sum(), tuple(latents.values()))
        with torch.no_grad():
            for (name, value), grad in zip(latents.items(), grads):
                noise = torch.randn(value.shape, generator=noise_gen, device=DEVICE)
                momenta[name].mul_(decay).add_(grad, alpha=eps).add_(noise, alpha=noise_scale)
                value.add_(momenta[name], alpha=eps)
    return elapsed(start), float(log_post.detach().mean())


def run_posteriors(problem: Problem, num_steps: int, seed: int, inplace: bool = True) -> tuple[float, float]:
    """posteriors' SGHMC transform; ``inplace=True`` is its faster mode (a few % here)."""
    import posteriors

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # posteriors draws its noise from the global generator

    def log_posterior(params: dict[str, Tensor], batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        value = problem.log_density(params, *batch)
        return value, value

    transform = posteriors.sgmcmc.sghmc.build(
        log_posterior, lr=problem.step_size, alpha=problem.friction, sigma=1.0, temperature=1.0, momenta=0.0
    )
    state = transform.init(uniform_init(problem, gen))
    batches = epoch_batches(problem.num_data, problem.batch_size, gen)
    x, y = problem.x, problem.y
    for _ in range(num_steps):
        idx = next(batches)
        state, _ = transform.update(state, (x[idx], y[idx]), inplace=inplace)
    return time.perf_counter() - start, float(state.log_posterior)


# ====================================================================================== timing
MAX_WAIT = 0.0  # seconds to wait for a quiet machine before each repetition (--max-wait)


# ====================================================================================== part 1 and 2
def against_posteriors(timing, post) -> tuple[str, str]:
    """posteriors' time per step and ours over it, or "not run" for both (``--without-posteriors``)."""
    if post is None:
        return "not run", "not run"
    return f"{post.median * 1e3:.3f}", f"**{median_ratio(timing, post):.2f}×**"


def variant_row(label: str, timing, hand, post) -> str:
    """A part-1 row for a variant of ours, against the same repetitions' hand-written loop and posteriors."""
    post_ms, post_ratio = against_posteriors(timing, post)
    return (
        f"| {label} | {timing.median * 1e3:.3f} | {hand.median * 1e3:.3f} | {post_ms} "
        f"| **{median_ratio(timing, hand):.2f}×** | {post_ratio} | {timing.median_setup:.2f} | (same) |"
    )


def part_cost_per_step(problems: dict[str, Problem], cfg: dict, report: list[str], summary: dict) -> None:
    report += [
        "## 1. Cost per step, one chain",
        "",
        "Median time per SGHMC step (setup excluded); ratios are medians of per-repetition ratios. Only clean "
        f"repetitions count (other processes used < {CLEAN_LIMIT} cores), unless fewer than two were clean.",
        "",
        "| problem | ours (ms) | hand-written torch (ms) | posteriors (ms) | ours / hand-written | ours / posteriors "
        "| ours: one-off setup (s) | repetitions |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    notes = []
    for key, problem in problems.items():
        short, long = cfg["steps_1"][key]
        log(f"[1] {problem.label}: steps {short} -> {long}")
        runners = {
            "ours": (lambda k, s, p=problem: run_ours(p, k, s), short, long),
            "hand-written": (lambda k, s, p=problem: run_hand_written(p, k, s), short, long),
        }
        if cfg["posteriors"]:
            runners["posteriors"] = (lambda k, s, p=problem: run_posteriors(p, k, s), short, long)
        runners["ours, noise corrected"] = (
            lambda k, s, p=problem: run_ours(p, k, s, gradient_noise="correct"),
            max(short, NOISE_SHORT),  # past the recording of the noise steps' densities (their 16th call, step 61)
            long,
        )
        runners["ours, model through Pyro"] = (lambda k, s, p=problem: run_untraced(p, k, s), short, long)
        runners["ours, compiled"] = (lambda k, s, p=problem: run_compiled(p, k, s), short, long)
        if key == "b":
            module = PyroModuleMLP(problem.batch_size)
            runners["ours, PyroModule"] = (lambda k, s, p=problem, m=module: run_ours(p, k, s, model=m), short, long)
        run_compiled(problem, 20, 0)  # the first compile in a process imports inductor (seconds): not a repetition's
        res = time_per_step(runners, cfg["reps"], MAX_WAIT)
        ours, hand, post = res["ours"], res["hand-written"], res.get("posteriors")
        r_hand = median_ratio(ours, hand)
        summary[f"hand_{key}"] = r_hand
        if post is not None:
            summary[f"posteriors_{key}"] = median_ratio(ours, post)
        summary[f"one_chain_{key}"] = ours.median  # the "1 chain" column of part 2
        post_ms, post_ratio = against_posteriors(ours, post)
        report.append(
            f"| {problem.label} | {ours.median * 1e3:.3f} | {hand.median * 1e3:.3f} | {post_ms} "
            f"| **{r_hand:.2f}×** | {post_ratio} | {ours.median_setup:.2f} | {clean_note(res)} |"
        )
        summary[f"noise_{key}"] = median_ratio(res["ours, noise corrected"], ours)
        summary[f"compiled_{key}"] = median_ratio(res["ours, compiled"], hand)
        summary[f"traced_{key}"] = median_ratio(ours, res["ours, model through Pyro"])
        variants = {
            "ours, noise corrected": f"({key}'') the same, `gradient_noise=\"correct\"` (the default once warm-up "
            "picks the step)",
            "ours, compiled": f"({key}c) the same, the recorded graph compiled (`model_tracing(compile=True)`, opt-in)",
            "ours, model through Pyro": f"({key}‴) the same, the model run through Pyro on every step "
            "(`model_tracing(False)`)",
            "ours, PyroModule": "(b') the same MLP as `PyroModule[nn.Linear]` + `PyroSample`",
        }
        for name, label in variants.items():
            if name in res:
                report.append(variant_row(label, res[name], hand, post))
        if "ours, PyroModule" in res:
            summary["hand_b_pyromodule"] = median_ratio(res["ours, PyroModule"], hand)
        notes.append(f"({key}) {summary[f'traced_{key}']:.2f}×")
        lps = {name: f"{statistics.median(t.final_lp):.4g}" for name, t in res.items()}
        log(f"    final log posterior estimates (sanity: same order of magnitude): {lps}")
    report += [
        "",
        "A step of ours with the recorded log density against the same step with the model run through Pyro "
        f"(median of per-repetition ratios): {', '.join(notes)}.",
        "",
    ]


def part_chains(problems: dict[str, Problem], cfg: dict, report: list[str], summary: dict) -> None:
    chains = cfg["chains"]
    report += [
        f"## 2. {chains} chains: vectorised (`torch.func.vmap`) against sequential",
        "",
        "Throughput in chain-steps per second (median of clean repetitions); ratios are medians of per-repetition "
        'ratios (the methods interleaved). The "1 chain" column is part 1\'s time for ours. By default each chain '
        "draws its own minibatches (the plate's `subsample_size`); the last two columns feed one shared minibatch "
        "per step to all chains instead (`StochasticMCMC(..., shared_minibatches=True)`).",
        "",
        f"| problem | 1 chain | {chains} sequential | {chains} vectorised "
        "| **vectorised / sequential** | vectorised / 1 chain | one-off setup, vectorised (s) "
        f"| {chains} vectorised, shared minibatches | shared vectorised / sequential | hand-written batched "
        "| **vectorised / hand-written batched** | repetitions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, problem in problems.items():
        (short_v, long_v), (short_s, long_s) = cfg["steps_2"][key]
        log(f"[2] {problem.label}: vectorised {short_v} -> {long_v}, sequential {short_s} -> {long_s}")
        res = time_per_step(
            {
                "vectorised": (lambda k, s, p=problem: run_ours(p, k, s, num_chains=chains), short_v, long_v),
                "vectorised, shared": (
                    lambda k, s, p=problem: run_ours(p, k, s, shared_minibatches=True, num_chains=chains),
                    short_v,
                    long_v,
                ),
                "sequential": (
                    lambda k, s, p=problem: run_ours(p, k, s, num_chains=chains, chain_method="sequential"),
                    short_s,
                    long_s,
                ),
                "hand-written batched": (
                    lambda k, s, p=problem: run_hand_batched(p, k, s, chains),
                    short_v,
                    long_v,
                ),
            },
            cfg["reps2"],
            MAX_WAIT,
        )
        vec, seq, shared = res["vectorised"], res["sequential"], res["vectorised, shared"]
        batched = res["hand-written batched"]
        summary[f"chains_floor_{key}"] = median_ratio(batched, vec)  # our throughput / the floor's
        ratio = median_ratio(seq, vec)
        summary[f"chains_{key}"] = ratio
        summary[f"chains_shared_{key}"] = median_ratio(seq, shared)
        one = summary.get(f"one_chain_{key}")
        one_text = f"{1 / one:,.0f}" if one else "–"
        one_ratio = f"{chains / vec.median * one:.2f}×" if one else "–"
        report.append(
            f"| {problem.label} | {one_text} | {chains / seq.median:,.0f} | {chains / vec.median:,.0f} "
            f"| **{ratio:.2f}×** | {one_ratio} | {vec.median_setup:.2f} | {chains / shared.median:,.0f} "
            f"| {median_ratio(seq, shared):.2f}× | {chains / batched.median:,.0f} "
            f"| **{median_ratio(batched, vec):.2f}×** | {clean_note(res)} |"
        )
    report.append("")


# ====================================================================================== report
def targets(summary: dict) -> list[str]:
    lines = ["## Targets", "", "| target | measured | met? |", "|---|---|---|"]

    def row(text: str, value: float | None, limit: float, fmt: str, higher_is_better: bool = False) -> None:
        if value is None:
            lines.append(f"| {text} | not measured | – |")
            return
        ok = value >= limit if higher_is_better else value <= limit
        by = value / limit if not higher_is_better else limit / value
        verdict = "met" if ok else f"missed ({by:.1f}× off)"
        lines.append(f"| {text} | {fmt.format(value)} | {verdict} |")

    row("(a) ours ≤ 1.5× the hand-written loop", summary.get("hand_a"), 1.5, "{:.2f}×")
    row("(b) ours ≤ 1.2× the hand-written loop", summary.get("hand_b"), 1.2, "{:.2f}×")
    row("(a) faster than posteriors", summary.get("posteriors_a"), 1.0, "{:.2f}× posteriors' time")
    row("(b) faster than posteriors", summary.get("posteriors_b"), 1.0, "{:.2f}× posteriors' time")
    for key in ("a", "b"):
        row(
            f"({key}) 16 vectorised chains ≥ 0.75× the hand-written batched loop's throughput",
            summary.get(f"chains_floor_{key}"),
            0.75,
            "{:.2f}×",
            higher_is_better=True,
        )
        if DEVICE.type == "cuda":
            row(
                f"({key}) on the GPU: 16 vectorised chains ≥ 8× the throughput of 16 sequential",
                summary.get(f"chains_{key}"),
                8.0,
                "{:.2f}×",
                higher_is_better=True,
            )
        elif f"chains_{key}" in summary:
            lines.append(
                f"| ({key}) for reference: 16 vectorised chains against 16 sequential | "
                f"{summary[f'chains_{key}']:.2f}× | (no target on a CPU) |"
            )
    return [*lines, ""]


# the noise steps (every 4th) call the densities they record 16 times by step 61: a shorter run would count those
# recordings, and the model run through Pyro before them, in the time per step
NOISE_SHORT = NOISE_EVERY * TRACE_AFTER + 4
CONFIGS = {
    "full": {
        "reps": 5,
        "reps2": 3,
        # every short run goes past the bridge's recording of the model (its 16th call), so that the recording is
        # counted in the one-off setup, not in the time per step
        "steps_1": {"a": (50, 2050), "b": (20, 320)},
        "steps_2": {"a": ((20, 320), (5, 65)), "b": ((20, 60), (5, 25))},
        "chains": 16,
    },
    "quick": {
        "reps": 3,
        "reps2": 3,
        "steps_1": {"a": (20, 520), "b": (20, 80)},
        "steps_2": {"a": ((20, 170), (3, 43)), "b": ((20, 30), (2, 8))},
        "chains": 16,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (about 2 minutes)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--parts", default="1,2", help="which parts to run, e.g. '1'")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each timing (default 5, quick 3)")
    parser.add_argument(
        "--max-wait",
        type=float,
        default=0.0,
        help="before each repetition, wait up to this many seconds for other processes to go quiet (default 0)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    parser.add_argument(
        "--without-posteriors",
        action="store_true",
        help="part 1 without its posteriors column (where the peer is not installed, e.g. a GPU machine)",
    )
    parser.add_argument("--device", default="cpu", help="where data, chains and loops run, e.g. 'cuda' (default cpu)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)

    torch.set_num_threads(args.threads)
    global MAX_WAIT
    MAX_WAIT = args.max_wait
    warnings.filterwarnings("ignore", category=FutureWarning)  # tensordict's notices when posteriors is imported
    # part 1 hand-sets the step with the noise ignored (the peers' update), on purpose: the after-run warning that
    # the draws are too wide is right, and says nothing about cost
    warnings.filterwarnings("ignore", category=HealthWarning)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.reps:
        cfg["reps"] = cfg["reps2"] = args.reps
    parts = {int(p) for p in args.parts.split(",")}
    cfg["posteriors"] = not args.without_posteriors
    peers = "posteriors not run (--without-posteriors)" if args.without_posteriors else ""
    if 1 in parts and cfg["posteriors"]:  # part 2 has no peer
        import posteriors  # (import cost outside the timings)

        peers = f"posteriors {getattr(posteriors, '__version__', '0.1.3')}"
    if DEVICE.type == "cuda":
        peers = ", ".join(filter(None, [peers, f"device {torch.cuda.get_device_name(DEVICE)}"]))
    command = " ".join(["python benchmarks/bench_sgmcmc.py", *sys.argv[1:]])
    report = [
        # the title says what ran (the parts, the device, the code; a non-default --out's name), so that each
        # results page has a title of its own
        f"# SG-MCMC {' and '.join(p for i, p in ((1, 'step cost'), (2, '16 vectorised chains')) if i in parts)} "
        f"on {'the CPU' if DEVICE.type == 'cpu' else torch.cuda.get_device_name(DEVICE)}: logistic regression "
        f"(N = 10⁶, d = 100) and an MLP (90,701 weights, N = 10⁵), {'quick' if args.quick else 'full'} run, "
        f"{_code_version()}" + ("" if args.out == RESULTS else f" (`{args.out.stem}`)"),
        "",
        f"Command: `{command}`",
        "",
        *machine(args.threads, peers),
        "",
    ]
    summary: dict = {}
    start = time.perf_counter()
    warm_up_torch()
    if parts & {1, 2}:
        problems = {"a": make_logistic(10**6, 100, 1000, seed=0), "b": make_mlp(10**5, 1000, seed=0)}
    if 1 in parts:
        part_cost_per_step(problems, cfg, report, summary)
    if 2 in parts:
        part_chains(problems, cfg, report, summary)
    report += targets(summary)
    report.append(f"Total wall time {time.perf_counter() - start:.0f} s; load average at the end {load_average()}.")
    write_report("\n".join(report) + "\n", args.out)


if __name__ == "__main__":
    main()
