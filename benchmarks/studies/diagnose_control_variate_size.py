"""What the control variate at the mode buys, against the number of weights per data point and where the chains are.

    python benchmarks/studies/diagnose_control_variate_size.py --out benchmarks/results/control_variate_size.md

A control variate at the mode replaces the minibatch gradient's noise by the noise of its *difference* from the
gradient at the mode, θ̂. Where the posterior is concentrated (its sd, about 1/√(N·I), small against the scale on
which per-example gradients change), that difference is small: for a model that is locally quadratic per example,
its variance is about ``d/N`` times the plain estimate's (per coordinate, E‖θ - θ̂‖²_I ≈ d/N in Fisher units).
A chain in another mode than θ̂ (a network's hidden units can be permuted and their signs flipped) sees no such
reduction: there the difference is as noisy as the gradient itself.

For each problem this runs ``StochasticMCMC(SGHMC(model))`` with ``control_variate="map"`` (the mode θ̂, the
search's time and passes; its chains start at θ̂) and with ``None`` (its chains start where the init strategy puts
them), and measures, at each chain's last draw θ of each run, the variance over ``--batches`` random minibatches of
the minibatch gradient of the log likelihood scaled to N, plain and minus the same minibatch's gradient at θ̂.
Reported: the ratio of the two variances summed over coordinates (controlled / plain), per chain. At the ``"map"``
run's own draws it is what that run's control variate bought; at the ``None`` run's, what it would buy for chains
that found their own way (on a network, other modes). The gradients are hand-written torch, not the library's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness and the bench_* scripts

import argparse
import math
import time
import warnings
from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch
from harness import load_average, log, machine, write_report
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pyro_scalable.infer import SGHMC, StochasticMCMC  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "control_variate_size.md"
BATCH = 100
NOISE = 0.5


def logistic(n: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = torch.bernoulli(torch.sigmoid(x @ (torch.randn(d, generator=gen) / math.sqrt(d)) * 2), generator=gen)

    def model(x: Tensor, y: Tensor) -> None:
        w = pyro.sample("w", dist.Normal(x.new_zeros(d), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=BATCH) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    def log_lik(latents: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return dist.Bernoulli(logits=xb @ latents["w"]).log_prob(yb).sum()

    return f"logistic regression, d = {d}", x, y, model, log_lik, d


def mlp(n: int, dims: tuple[int, ...], seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = {}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        shapes[f"W{i}"], shapes[f"b{i}"] = (a, b), (b,)
    scales = {k: (s[0] ** -0.5 if len(s) == 2 else 1.0) for k, s in shapes.items()}

    def forward(latents: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x
        for i in range(len(dims) - 1):
            h = h @ latents[f"W{i}"] + latents[f"b{i}"]
            if i < len(dims) - 2:
                h = torch.tanh(h)
        return h.squeeze(-1)

    x = torch.randn(n, dims[0], generator=gen)
    teacher = {k: torch.randn(s, generator=gen) * scales[k] for k, s in shapes.items()}
    y = forward(teacher, x) + NOISE * torch.randn(n, generator=gen)

    def model(x: Tensor, y: Tensor) -> None:
        latents = {
            k: pyro.sample(k, dist.Normal(x.new_zeros(()), scales[k]).expand(s).to_event(len(s)))
            for k, s in shapes.items()
        }
        with pyro.plate("data", x.shape[0], subsample_size=BATCH) as idx:
            pyro.sample("y", dist.Normal(forward(latents, x[idx]), NOISE), obs=y[idx])

    def log_lik(latents: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return dist.Normal(forward(latents, xb), NOISE).log_prob(yb).sum()

    d = sum(math.prod(s) for s in shapes.values())
    return f"tanh MLP {'-'.join(map(str, dims))}", x, y, model, log_lik, d


PROBLEMS: dict[str, Callable] = {
    "logistic10": lambda n, seed: logistic(n, 10, seed),
    "logistic100": lambda n, seed: logistic(n, 100, seed),
    "mlp-small": lambda n, seed: mlp(n, (10, 20, 1), seed),
    "mlp-mid": lambda n, seed: mlp(n, (20, 50, 50, 1), seed),
    "mlp-large": lambda n, seed: mlp(n, (100, 300, 200, 1), seed),
}


def gradient_noise(log_lik, theta, centre, x, y, batches: int, gen: torch.Generator) -> tuple[float, float]:
    """Summed and median per-coordinate variance ratio, controlled over plain, of the N-scaled minibatch gradient."""
    n = x.shape[0]
    grad = torch.func.grad(log_lik)
    plain, controlled = [], []
    for _ in range(batches):
        idx = torch.randint(n, (BATCH,), generator=gen)
        g = torch.cat([v.reshape(-1) for v in grad(theta, x[idx], y[idx]).values()]) * (n / BATCH)
        g0 = torch.cat([v.reshape(-1) for v in grad(centre, x[idx], y[idx]).values()]) * (n / BATCH)
        plain.append(g)
        controlled.append(g - g0)
    vp, vc = torch.stack(plain).var(0), torch.stack(controlled).var(0)
    keep = vp > 0
    return float(vc.sum() / vp.sum()), float((vc[keep] / vp[keep]).median())


def run(args) -> str:
    rows = []
    for spec in args.problems.split(","):
        name, n = spec.split("@")
        n = int(float(n))
        label, x, y, model, log_lik, d = PROBLEMS[name](n, 0)
        log(f"{label}, N = {n}, d = {d}")
        timings, draws = {}, {}
        for option in (None, "map"):
            kernel = SGHMC(model, control_variate=option)
            mcmc = StochasticMCMC(
                kernel,
                num_samples=args.samples,
                num_warmup=args.warmup,
                num_chains=args.chains,
                seed=1,
                progress_bar=False,
            )
            began = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mcmc.run(x, y)
            timings[option] = time.perf_counter() - began
            draws[option] = {k: v[:, -1] for k, v in mcmc.get_samples(group_by_chain=True).items()}
            if option == "map":
                centre = {k: v.detach() for k, v in mcmc.control_variate.centre.items()}
                search = mcmc.mode_search
        gen = torch.Generator().manual_seed(2)
        ranges = []
        for option in (None, "map"):
            ratios = sorted(
                gradient_noise(log_lik, {k: v[c] for k, v in draws[option].items()}, centre, x, y, args.batches, gen)[0]
                for c in range(args.chains)
            )
            ranges.append(f"{ratios[0]:.3g}–{ratios[-1]:.3g}")
        rows.append(
            f"| {label} | {n:,} | {d:,} | {d / n:.3g} | {ranges[1]} | {ranges[0]} "
            f"| {search.seconds:.1f} s ({search.full_passes} + {search.subsample_passes} sub) "
            f"| {timings[None]:.1f} s | {timings['map']:.1f} s |"
        )
        log(rows[-1])
    header = (
        '| problem | N | d | d / N | noise, controlled / plain, at the `"map"` run\'s own final draws (range over '
        "chains) | the same at the `None` run's final draws | mode search (full + subsample passes) | run, `None` "
        '| run, `"map"` |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|'
    )
    return header + "\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--problems",
        default="logistic10@1e4,logistic100@1e4,mlp-small@1e4,mlp-mid@1e4,mlp-large@1e5",
        help="name@N, comma-separated, from: " + ", ".join(PROBLEMS),
    )
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--batches", type=int, default=64, help="minibatches per noise measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/studies/diagnose_control_variate_size.py " + " ".join(sys.argv[1:])
    began = time.perf_counter()
    table = run(args)
    text = "\n".join(
        [
            "# What the control variate at the mode buys, against d / N and where the chains are",
            "",
            f"Command: `{command.strip()}`",
            "",
            *machine(args.threads),
            f"- load average at the end {load_average()}; wall time {time.perf_counter() - began:.0f} s",
            f"- SGHMC at the defaults, {args.chains} chains × ({args.warmup} + {args.samples}) steps, B = {BATCH}; "
            f"noise over {args.batches} minibatches at each chain's last draw of each run",
            "",
            table,
            "",
        ]
    )
    write_report(text, args.out)


if __name__ == "__main__":
    main()
