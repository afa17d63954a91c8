"""SWAG against the K-FAC Laplace fit and SG-MCMC on the digits MLP: cost for a test NLL, side by side in one run.

    python benchmarks/bench_swag.py            # full run (about 10 minutes on 2 CPU cores)
    python benchmarks/bench_swag.py --quick    # smoke-sized run (about 2 minutes)

Prints a markdown report and writes it to ``benchmarks/results/swag.md`` (``--out`` to change); progress goes to
stderr.

The problem: the 8 x 8 digits (``sklearn.datasets.load_digits``; 1,257 training and 540 test images in a fixed random
order), a ``PyroModule`` MLP 64-100-10 with tanh, Normal(0, 1) priors on every weight and bias (7,510 parameters) and
the Categorical likelihood in a plate subsampling 100 points. One MAP (minibatch ``SVI`` with an ``AutoDelta``
guide) is shared; every method starts from it, and its cost is reported once, apart. Then, from the MAP:

* **Laplace** ``kron``: ``AutoLinearizedLaplace(...).laplace_approximation(structure="kron", map_latents=MAP)``,
  the scalar prior precision tuned on the evidence, and the linearised predictive (probit);
* **SWAG**: ``SWAG(model, start=MAP, rank=20)`` with ``lr="auto"`` for E epochs, 50 sampled-weight draws;
* **SG-MCMC**: ``SGHMC`` at T = 1 with its calibrated warm-up, 4 vectorised chains from the MAP for S steps in all
  (half warm-up), 50 draws kept.

Each method's cost is the wall time of the whole call, predictive included (the draws' forward passes for SWAG and
SG-MCMC, the linearised predictive for the Laplace), at one torch thread, the methods interleaved over
``--repeats`` repetitions (the median is reported; the CPU other processes used meanwhile is recorded). The accuracy
is the test NLL of the predictive mean (lower is better), with its standard error over the test points, and the ECE
(15 equal-width confidence bins). Ratios of times, not absolute times, carry over between machines.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from harness import ForeignLoad, is_clean, log, machine, warm_up_torch, write_report  # benchmarks/ is on sys.path
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from pyro.infer.autoguide.initialization import init_to_value
from pyro.nn import PyroModule, PyroSample
from sklearn.datasets import load_digits
from torch import nn

from pyro_scalable import FullDataModel
from pyro_scalable.infer import SGHMC, SWAG, AutoLinearizedLaplace, StochasticMCMC

ROOT = Path(__file__).resolve().parent.parent
DRAWS, CHAINS, BATCH = 50, 4, 100


class MLP(PyroModule):
    """64-100-10 tanh network, Normal(0, 1) priors, the likelihood in a subsampled plate."""

    def __init__(self, widths=(64, 100, 10)):
        super().__init__()
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layer = PyroModule[nn.Linear](fan_in, fan_out)
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out, fan_in]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([fan_out]).to_event(1))
            layers.append(layer)
        self.layers = PyroModule[nn.ModuleList](layers)

    def forward(self, x, y=None):
        data = pyro.plate("data", x.shape[0], subsample_size=min(BATCH, x.shape[0]))
        h = x[data.indices]
        for layer in self.layers[:-1]:
            h = torch.tanh(layer(h))
        logits = self.layers[-1](h)
        with data:
            pyro.deterministic("logits", logits)
            return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])


def digits() -> tuple[torch.Tensor, ...]:
    data = load_digits()
    order = torch.randperm(len(data.data), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(data.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(data.target)[order]
    split = int(0.7 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def fit_map(net, x, y, steps: int) -> dict[str, torch.Tensor]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(net)
    svi = SVI(net, guide, pyro.optim.ClippedAdam({"lr": 3e-3, "lrd": 0.05 ** (1 / steps)}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)
    return {name: value.detach() for name, value in guide.median(x, y).items()}


def draws_probs(net, samples, x) -> torch.Tensor:
    logits = Predictive(FullDataModel(net), posterior_samples=samples, return_sites=["logits"])(x)["logits"]
    return logits.reshape(-1, len(x), logits.shape[-1]).double().softmax(-1).mean(0)


def laplace_kron(net, data, start):
    x, y, x_test, _ = data
    posterior = AutoLinearizedLaplace(net).laplace_approximation(
        x, y, structure="kron", map_latents=start, check_map=False
    )
    posterior.optimize_prior_precision()
    return posterior.predict(x_test).distribution.probs.double()


def swag(epochs: int):
    def method(net, data, start):
        x, y, x_test, _ = data
        with warnings.catch_warnings():  # the capped step is reported in the table instead
            warnings.filterwarnings("ignore", message="lr='auto'", category=UserWarning)
            posterior = SWAG(net, start=start, num_epochs=epochs, rank=20, seed=0, progress_bar=False).run(x, y)
        method.stats = posterior.stats
        return draws_probs(net, posterior.get_samples(DRAWS, seed=0), x_test)

    method.stats = {}
    return method


def sgmcmc(steps: int):
    def method(net, data, start):
        x, y, x_test, _ = data
        per_chain = steps // CHAINS
        kept = max(1, DRAWS // CHAINS)
        mcmc = StochasticMCMC(
            SGHMC(net, init_strategy=init_to_value(values=start)),
            num_samples=kept,
            num_warmup=per_chain // 2,
            thin=max(1, (per_chain // 2) // kept),
            num_chains=CHAINS,
            seed=0,
            progress_bar=False,
        )
        with warnings.catch_warnings():  # the health warning is recorded in the table (r_hat) instead
            warnings.filterwarnings("ignore", message="the chains are not healthy")
            mcmc.run(x, y)
        return draws_probs(net, mcmc.get_samples(), x_test)

    return method


def nll_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> tuple[float, float, float]:
    """Mean NLL, its standard error over the test points, and the ECE."""
    point = -probs[torch.arange(len(y)), y].clamp_min(1e-300).log()
    confidence, guess = probs.max(-1)
    ece = 0.0
    edges = torch.linspace(0, 1, bins + 1, dtype=probs.dtype)
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (confidence > low) & (confidence <= high)
        if inside.any():
            gap = (guess[inside] == y[inside]).double().mean() - confidence[inside].mean()
            ece += float(inside.double().mean() * gap.abs())
    return float(point.mean()), float(point.std() / math.sqrt(len(y))), ece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized run")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per method (default 3; quick 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "swag.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warm_up_torch()
    repeats = args.repeats or (1 if args.quick else 3)
    map_steps = 1_000 if args.quick else 4_000
    epochs = (2, 5) if args.quick else (5, 20, 50)
    steps = (400, 1_600) if args.quick else (1_000, 4_000, 16_000)

    data = digits()
    x, y, x_test, y_test = data
    net = MLP()
    began = time.perf_counter()
    start = fit_map(net, x, y, map_steps)
    map_seconds = time.perf_counter() - began
    map_probs = draws_probs(net, {k: v[None] for k, v in start.items()}, x_test)
    log(f"MAP: {map_seconds:.0f} s")

    methods = {"Laplace kron (evidence-tuned)": laplace_kron}
    methods.update({f"SWAG, {e} epochs": swag(e) for e in epochs})
    methods.update({f"SGHMC, {s:,} steps ({CHAINS} chains)": sgmcmc(s) for s in steps})
    seconds = {name: [] for name in methods}
    loads = {name: [] for name in methods}
    results = {}
    for repeat in range(repeats):
        for name, method in methods.items():
            pyro.clear_param_store()
            probe = ForeignLoad()
            t0 = time.perf_counter()
            probs = method(net, data, start)
            seconds[name].append(time.perf_counter() - t0)
            loads[name].append(probe.cores())
            results[name] = (probs, getattr(method, "stats", {}))
            log(f"repeat {repeat + 1}/{repeats}: {name}: {seconds[name][-1]:.1f} s")

    reference = statistics.median(seconds["Laplace kron (evidence-tuned)"])
    lines = [
        "# SWAG vs the K-FAC Laplace fit vs SG-MCMC on the digits MLP",
        "",
        f"`python benchmarks/bench_swag.py{' --quick' if args.quick else ''}`",
        "",
        *machine(1),
        "",
        f"Digits 64-100-10 tanh MLP (7,510 parameters), {len(x)} training / {len(x_test)} test images, B = {BATCH}. "
        f"Shared MAP ({map_steps:,} SVI steps): {map_seconds:.0f} s, not counted below. Seconds: median of {repeats} "
        "(the call, predictive included); ratio: to the Laplace fit's. NLL ± its standard error over the test points.",
        "",
        "| method | seconds | ratio | test NLL | ECE | accuracy | clean | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    nll, se, ece = nll_ece(map_probs, y_test)
    accuracy = float((map_probs.argmax(-1) == y_test).double().mean())
    lines.append(f"| MAP | — | — | {nll:.4f} ± {se:.4f} | {ece:.4f} | {accuracy:.3f} | — | the start of every method |")
    for name in methods:
        probs, stats = results[name]
        nll, se, ece = nll_ece(probs, y_test)
        accuracy = float((probs.argmax(-1) == y_test).double().mean())
        median = statistics.median(seconds[name])
        clean = f"{sum(is_clean(f) for f in loads[name])}/{repeats}"
        note = ""
        if "lr" in stats:
            note = f"lr {stats['lr']:.3g} (Mandt's {stats['lr_noise']:.3g})"
        lines.append(
            f"| {name} | {median:.1f} | {median / reference:.2f} | {nll:.4f} ± {se:.4f} | {ece:.4f} | "
            f"{accuracy:.3f} | {clean} | {note} |"
        )
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
