"""The diagonal EKF's accuracy and cost on logistic regression, against the exact posterior and the full Laplace.

    python benchmarks/bench_ekf.py      # about 1 minute on 2 CPU cores

Prints a markdown report and writes it to ``benchmarks/results/ekf.md`` (``--out`` to change).

1. **One coefficient** (N = 10,000, x ~ N(0, 1), true w = 1.3, prior N(0, 1), float64): the exact posterior's mean
   and sd on a grid of 20,001 points; the EKF's mean error (in posterior sds) and sd ratio after one pass, for
   minibatches of 1,000, 100 and 10, with the GGN and with the empirical Fisher.
2. **Ten coefficients** (N = 100,000, independent N(0, 1) features, true w from -1 to 1, prior N(0, I), float32):
   the reference is the full linearised Laplace at an SVI MAP (2,000 steps), its mean moved by a Newton step; the
   EKF's largest mean error in reference sds, its sd ratios, and its time against the reference's, for B = 1,000,
   100 and 10. One torch thread; one run each (the ratios, not the absolute times, carry over).
3. **A network** (the 8 x 8 digits, 1,200 training and 597 test images, a 64-32-10 tanh MLP with Normal(0, 1)
   priors, B = 100, so 12 updates per pass): the filter from a prior draw (``start="sample"``), one pass and five,
   test accuracy and NLL of the linearised predictive; against the MAP (1,500 SVI steps) and its diagonal Laplace
   with the evidence-tuned prior precision.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from harness import log, machine, warm_up_torch, write_report  # benchmarks/ is on sys.path when a script runs
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_scalable.infer import AutoLinearizedLaplace, DiagonalEKF

ROOT = Path(__file__).resolve().parent.parent


def logistic(d: int, batch: int, dtype):
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=batch) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=None if y is None else y[idx])

    return model


def part_one(lines: list[str]) -> None:
    d64 = torch.float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, 1, generator=g, dtype=d64)
    y = torch.bernoulli(torch.sigmoid(1.3 * x[:, 0]), generator=g)
    grid = torch.linspace(1.0, 1.6, 20_001, dtype=d64)
    log_p = dist.Normal(0.0, 1.0).log_prob(grid) + dist.Bernoulli(logits=grid[:, None] * x[None, :, 0]).log_prob(
        y[None]
    ).sum(-1)
    p = (log_p - log_p.max()).exp()
    p = p / p.sum()
    mean = (p * grid).sum()
    sd = (p * (grid - mean) ** 2).sum().sqrt()
    lines += [
        "## 1. One coefficient, against the exact posterior (grid)",
        "",
        f"Exact posterior: mean {float(mean):.4f}, sd {float(sd):.4f}.",
        "",
        "| B | curvature | mean error (sd) | sd / exact sd | seconds |",
        "|---:|---|---:|---:|---:|",
    ]
    for batch in (1000, 100, 10):
        for curvature in ("ggn", "ef"):
            began = time.perf_counter()
            post = DiagonalEKF(logistic(1, batch, d64), curvature=curvature, seed=0, progress_bar=False).run(x, y)
            seconds = time.perf_counter() - began
            error = float((post.mean[0, 0] - mean) / sd)
            ratio = float(post.variance[0, 0].sqrt() / sd)
            lines.append(f"| {batch:,} | {curvature} | {error:+.3f} | {ratio:.3f} | {seconds:.2f} |")
            log(f"part 1: B={batch} {curvature}: {error:+.3f} sd")
    lines.append("")


def part_two(lines: list[str]) -> None:
    g = torch.Generator().manual_seed(0)
    n, d = 100_000, 10
    x = torch.randn(n, d, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ torch.linspace(-1, 1, d)), generator=g)
    model = logistic(d, 1000, torch.float32)
    began = time.perf_counter()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(model)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.01 ** (1 / 2000)}), Trace_ELBO())
    for _ in range(2000):
        svi.step(x, y)
    point = {k: v.detach() for k, v in guide.median(x, y).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the MAP check: the Newton step moves the mean anyway
        laplace = AutoLinearizedLaplace(model).laplace_approximation(x, y, structure="full", map_latents=point)
    reference_seconds = time.perf_counter() - began
    mean = laplace.mean.double()
    sd = laplace.precision.to_dense().double().inverse().diagonal().sqrt()
    lines += [
        "## 2. Ten coefficients, against the full Laplace at the MAP",
        "",
        f"Reference (SVI MAP, 2,000 steps, then the full Laplace): {reference_seconds:.1f} s.",
        "",
        "| B | curvature | largest mean error (sd) | sd / reference sd | seconds | time / reference |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for batch in (1000, 100, 10):
        for curvature in ("ggn", "ef"):
            began = time.perf_counter()
            post = DiagonalEKF(logistic(d, batch, torch.float32), curvature=curvature, seed=0, progress_bar=False)
            posterior = post.run(x, y)
            seconds = time.perf_counter() - began
            error = float(((posterior.mean[0].double() - mean) / sd).abs().max())
            ratio = posterior.variance[0].double().sqrt() / sd
            lines.append(
                f"| {batch:,} | {curvature} | {error:.2f} | {float(ratio.min()):.3f}–{float(ratio.max()):.3f} | "
                f"{seconds:.2f} | {seconds / reference_seconds:.3f} |"
            )
            log(f"part 2: B={batch} {curvature}: {error:.2f} sd")
    lines.append("")


def part_three(lines: list[str]) -> None:
    from pyro.nn import PyroModule, PyroSample
    from sklearn.datasets import load_digits
    from torch import nn

    class MLP(PyroModule):
        def __init__(self):
            super().__init__()
            self.hidden = PyroModule[nn.Linear](64, 32)
            self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([32, 64]).to_event(2))
            self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([32]).to_event(1))
            self.out = PyroModule[nn.Linear](32, 10)
            self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 32]).to_event(2))
            self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([10]).to_event(1))

        def forward(self, x, y=None):
            data = pyro.plate("data", x.shape[0], subsample_size=min(100, x.shape[0]))
            logits = self.out(torch.tanh(self.hidden(x[data.indices])))
            with data:
                return pyro.sample("y", dist.Categorical(logits=logits), obs=None if y is None else y[data.indices])

    digits = load_digits()
    order = torch.randperm(len(digits.data), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target)[order]
    x_train, y_train, x_test, y_test = x[:1200], y[:1200], x[1200:], y[1200:]
    net = MLP()

    def scores(probs):
        probs = probs.double()
        nll = float(-probs[torch.arange(len(y_test)), y_test].clamp_min(1e-300).log().mean())
        return float((probs.argmax(-1) == y_test).double().mean()), nll

    lines += [
        "## 3. A network: the digits MLP (2,410 weights, 12 updates per pass)",
        "",
        "| method | seconds | test accuracy | test NLL |",
        "|---|---:|---:|---:|",
    ]
    for epochs in (1, 5):
        for curvature in ("ggn", "ef"):
            began = time.perf_counter()
            ekf = DiagonalEKF(net, num_epochs=epochs, curvature=curvature, start="sample", seed=0, progress_bar=False)
            posterior = ekf.run(x_train, y_train)
            seconds = time.perf_counter() - began
            accuracy, nll = scores(posterior.predict(x_test).distribution.probs)
            name = f"EKF {curvature}, {epochs} pass(es), from a prior draw"
            lines.append(f"| {name} | {seconds:.1f} | {accuracy:.3f} | {nll:.3f} |")
            log(f"part 3: EKF {curvature} x{epochs}: {accuracy:.3f}")
    began = time.perf_counter()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(net)
    svi = SVI(net, guide, pyro.optim.ClippedAdam({"lr": 3e-3, "lrd": 0.1 ** (1 / 1500)}), Trace_ELBO())
    for _ in range(1500):
        svi.step(x_train, y_train)
    point = {k: v.detach() for k, v in guide.median(x_train, y_train).items()}
    laplace = AutoLinearizedLaplace(net).laplace_approximation(
        x_train, y_train, structure="diag", map_latents=point, check_map=False
    )
    laplace.optimize_prior_precision()
    seconds = time.perf_counter() - began
    accuracy, nll = scores(laplace.predict(x_test).distribution.probs)
    lines.append(
        f"| MAP (1,500 SVI steps) + diagonal Laplace, evidence-tuned | {seconds:.1f} | {accuracy:.3f} | {nll:.3f} |"
    )
    lines.append("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ekf.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warm_up_torch()
    lines = ["# The diagonal EKF on logistic regression", "", "`python benchmarks/bench_ekf.py`", "", *machine(1), ""]
    part_one(lines)
    part_two(lines)
    part_three(lines)
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
